"""Issue 40, findings 3 and 4: ``/metrics`` values that lie cost their prompt; a verdict needs most prompts.

The inputs that showed them, each sent by a stand-in vLLM server in its own process (``/v1/completions`` and
``/metrics`` in vLLM 0.32's shapes, over HTTP): a NaN or +Inf counter raised out of the evaluation; a
``position="3000000"`` label built 3,000,001-entry lists per prompt; counters that went down gave their prompt
``tau None`` yet the dataset reported a tau from them; with 63 of 64 replies rejected, ``engine_parity`` and
``lossless`` passed on the one prompt left and the summary said ``on 64 prompts``.

Every honest request of the stand-in decodes 8 tokens in 3 verification steps, accepting 4 drafted tokens
(2, 1, 1 at positions 0, 1, 2): tau = 1 + 4 / 3 per prompt, the figure asserted below.
"""

from __future__ import annotations

import json
import time

import pytest

from dflash_assets.app.summary_lines import engine_line
from dflash_assets.generation.servers.sglang_dflash import EnginePrompt
from dflash_assets.stages.evaluation.engine import engine_metadata
from dflash_assets.stages.evaluation.parity import MIN_MEASURED_SHARE, engine_parity, lossless_summary
from dflash_assets.stages.evaluation.vllm_engine import vllm_decode, vllm_tau_by_dataset
from dflash_assets_tests.script_server import script_server

TAU = 1 + 4 / 3
BLOCK = 4  # 3 drafted tokens per step
OUTPUT = list(range(1, 9))

SERVER = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NAMES = ("drafts", "draft_tokens", "accepted_tokens")
state = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "pos": [0.0, 0.0, 0.0]}
hostile = []  # the next /metrics read only: (name or "pos", value or label)

def exposition():
    lines, once = [], dict(hostile)
    hostile.clear()
    for name in NAMES:
        value = once.get(name, repr(state[name]))
        lines += [f"# TYPE vllm:spec_decode_num_{name}_total counter",
                  f'vllm:spec_decode_num_{name}_total{{engine="0",model_name="m"}} {value}']
    lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter")
    labels = [str(k) for k in range(3)] if "pos" not in once else [once["pos"]]
    for k, label in enumerate(labels):
        lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",'
                     f'position="{label}"}} {state["pos"][k]}')
    return ("\n".join(lines) + "\n").encode()

class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def reply(self, body, kind="application/json"):
        self.send_response(200); self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        self.reply(exposition() if self.path == "/metrics" else b"ok", "text/plain")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        first = body["prompt"][0]
        ids = list(range(1, 9))
        if first == 900:  # a reply the client must refuse: a token id outside the vocabulary
            ids = [1, 10**6] + ids[2:]
        elif first == 904:  # the server restarted: its counters start again from this request's
            state.update(drafts=0.0, draft_tokens=0.0, accepted_tokens=0.0, pos=[0.0, 0.0, 0.0])
        if first != 900:
            state["drafts"] += 3; state["draft_tokens"] += 9; state["accepted_tokens"] += 4
            state["pos"] = [state["pos"][0] + 2, state["pos"][1] + 1, state["pos"][2] + 1]
        hostile.extend({901: [("drafts", "NaN")], 902: [("accepted_tokens", "+Inf")],
                        903: [("pos", "3000000")], 905: [("accepted_tokens", "-4.0")]}.get(first, []))
        out = {"choices": [{"token_ids": ids, "finish_reason": "length", "text": "x"}],
               "usage": {"completion_tokens": len(ids)}}
        self.reply(json.dumps(out).encode())

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def stand_in():
    with script_server(SERVER) as url:
        yield url


def decode(url: str, firsts: list[int]) -> list[dict]:
    prompts = [EnginePrompt("heldout", i, (first, 5, 6)) for i, first in enumerate(firsts)]
    return vllm_decode(url, "m", prompts, 8, vocab_size=100, block_size=BLOCK)


def test_hostile_counters_cost_their_prompt_with_the_reason(stand_in):
    firsts = [7, 901, 7, 902, 7, 903, 7, 904, 7, 905, 7]
    started = time.monotonic()
    records = decode(stand_in, firsts)
    lost = {i: r["error"] for i, r in enumerate(records) if "error" in r}
    assert set(lost) == {1, 3, 5, 7, 9}, lost
    assert "vllm:spec_decode_num_drafts_total is nan, not a count" in lost[1]
    assert "vllm:spec_decode_num_accepted_tokens_total is inf, not a count" in lost[3]
    assert "position='3000000', not a draft position of a block of 4" in lost[5]
    assert "counters went down (drafts 21 -> 3)" in lost[7], lost[7]
    assert "vllm:spec_decode_num_accepted_tokens_total is -4.0, not a count" in lost[9]
    # every other prompt is measured as the stand-in counted it, its baseline read after the one lost before it
    assert [r["tau"] for i, r in enumerate(records) if i not in lost] == pytest.approx([TAU] * 6)
    assert all(r["accepted_per_position"] == [2, 1, 1] for i, r in enumerate(records) if i not in lost)
    assert len(json.dumps(records)) < 20_000  # no list as long as a hostile label
    assert time.monotonic() - started < 30  # no wait on counters that went down
    d = vllm_tau_by_dataset(records)["heldout"]
    assert (d["requests"], d["requests_measured"], d["errors"]) == (11, 6, 5)
    assert d["tau"] == pytest.approx(TAU) and d["tau_pooled"] == pytest.approx((6 * 7) / (6 * 3))
    assert d["acceptance_per_position"] == pytest.approx([2 / 3, 1 / 3, 1 / 3])


def test_counters_that_went_down_never_give_the_dataset_a_tau(stand_in):
    # the first 904 takes drafts 6 -> 3 (lost: went down); the second 3 -> 3 (no step counted: tau None)
    records = decode(stand_in, [7, 7, 904, 904])
    assert [("error" in r) for r in records] == [False, False, True, False], records
    assert "counters went down (drafts 6 -> 3)" in records[2]["error"] and records[3]["tau"] is None
    d = vllm_tau_by_dataset(records)["heldout"]
    assert (d["requests"], d["requests_measured"], d["errors"]) == (4, 2, 1) and d["tau"] == pytest.approx(TAU)
    # a dataset no prompt measured has no tau, not one made of the unmeasured prompts
    only_lost = vllm_tau_by_dataset(records[2:])["heldout"]
    assert only_lost["tau"] is None and only_lost["tau_pooled"] is None and only_lost["requests_measured"] == 0


def _in_process(n: int) -> dict:
    return {"heldout": {"trained": {"per_prompt_tau": [TAU] * n, "plain_output_ids": [OUTPUT] * n, "lossless": True}}}


TRAINED = {"block_size": BLOCK}
EXPORT = {"dflash_config": {"block_size": BLOCK}}


def test_parity_and_lossless_fail_when_few_prompts_were_measured(stand_in):
    # 63 of the 64 replies rejected: the verdicts rested on one prompt
    records = decode(stand_in, [7] + [900] * 63)
    section = {"kind": "vllm", "requests": records, "datasets": vllm_tau_by_dataset(records)}
    parity = engine_parity(section, _in_process(64), TRAINED, EXPORT)
    assert not parity["passed"]
    assert any("vLLM tau measured on 1 of 64 prompts, fewer than the 58 needed (90%)" in r for r in parity["reasons"])
    assert "outside [0, 100)" in " ".join(parity["reasons"])  # why they were lost
    lossless = lossless_summary(_in_process(64), parity)
    assert not lossless["passed"] and "compared with plain greedy decoding on 1 of 64 prompts" in lossless["reasons"][0]
    # the summary says how many prompts the engine's figure rests on
    s = {"engine_kind": "vllm", **_summary_keys(section)}
    assert "on 1 of 64 prompts" in engine_line(s), engine_line(s)

    # at the stated share (58 of 64 = 90.6%) both pass
    assert MIN_MEASURED_SHARE == 0.9
    records = decode(stand_in, [7] * 58 + [900] * 6)
    section = {"kind": "vllm", "requests": records, "datasets": vllm_tau_by_dataset(records)}
    parity = engine_parity(section, _in_process(64), TRAINED, EXPORT)
    assert parity["passed"], parity["reasons"]
    assert lossless_summary(_in_process(64), parity)["passed"]
    assert "on 58 of 64 prompts" in engine_line({"engine_kind": "vllm", **_summary_keys(section)})


def _summary_keys(section: dict) -> dict:
    meta = engine_metadata({**section, "simulated": False, "label": "vLLM", "server_flags": []}, None)
    return {k: meta[k] for k in ("engine_requests", "engine_requests_measured", "engine_tau")}
