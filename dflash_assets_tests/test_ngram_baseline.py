"""Issue 42: the drafter against the free baseline (n-gram lookup), in tokens per target forward.

The arithmetic with values computed by hand; vLLM's counters around one real n-gram request (captured from the
CPU build) against an independent replay of its n-gram lookup; the summary line, the launch flags and the plot.
The real engine path (both servers, one run) is in ``test_vllm_ngram.py``.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest

from dflash_assets.app.summary_lines import baseline_lines
from dflash_assets.dflash.decoding.evaluation import acceptance_histogram_png
from dflash_assets.generation.servers.sglang_dflash import ngram_server_flags
from dflash_assets.generation.servers.vllm_servers import ngram_speculative_config
from dflash_assets.stages.evaluation.baseline import (
    baseline_check,
    compare_methods,
    context_bucket,
    engine_forward_figures,
    in_process_forward_figures,
    ngram_lossless,
    paired_engine_figures,
    paired_ratio,
    tokens_per_forward,
    verdict,
)
from dflash_assets.stages.evaluation.vllm_counters import parse_spec_counters

DATA = Path(__file__).parent / "data"


def ngram_replay(prompt: list[int], output: list[int], lo: int, hi: int, k: int) -> dict:
    """vLLM's n-gram lookup replayed on a known greedy output, written here from its rule (not its code): at each
    step the longest context suffix of ``lo``..``hi`` tokens that occurs earlier, at its earliest occurrence,
    proposes the up to ``k`` tokens that followed it; the target accepts the drafts that equal the greedy
    continuation and adds one token. Returns target forwards (prefill included), drafts, draft tokens, accepted
    and accepted per position, counting only tokens inside ``output`` (vLLM also counts a last step's accepted
    drafts past the stop, which it then trims)."""

    def propose(ctx: list[int]) -> list[int]:
        n = len(ctx)
        for v in range(min(hi, n - 1), lo - 1, -1):
            for s in range(0, n - v):
                if ctx[s : s + v] == ctx[n - v :]:
                    return ctx[s + v : s + v + k]
        return []

    got, forwards, drafts, draft_tokens, accepted, per_pos = 1, 1, 0, 0, 0, [0] * k
    while got < len(output):
        d = propose(prompt + output[:got])
        a = 0
        while a < len(d) and got + a < len(output) and d[a] == output[got + a]:
            a += 1
        if d:
            drafts, draft_tokens, accepted = drafts + 1, draft_tokens + len(d), accepted + a
            for j in range(a):
                per_pos[j] += 1
        got, forwards = got + a + 1, forwards + 1
    return {"forwards": forwards, "drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted, "pos": per_pos}


def test_forwards_come_from_vllms_step_count_not_generated_minus_accepted():
    """The input that showed it: an n-gram request whose last step accepted 2 drafts past the 48-token stop. vLLM
    counted them (18 accepted), so 48 - 18 = 30 forwards, but the target ran 33 (the step count, and the replay)."""
    capture = json.loads((DATA / "vllm_0.32.0_ngram_request.json").read_text())
    delta = parse_spec_counters(capture["metrics_after"]).minus(parse_spec_counters(capture["metrics_before"]))
    out = capture["output_ids"]
    replay = ngram_replay(capture["prompt_ids"], out, lo=1, hi=4, k=3)
    assert len(out) == 48 and delta.generation_tokens == 48
    assert (delta.iterations, delta.drafts, delta.draft_tokens) == (33, 22, 66)
    assert (replay["forwards"], replay["drafts"], replay["draft_tokens"]) == (33, 22, 66)
    assert delta.accepted == 18 and replay["accepted"] == 16  # 2 accepted past the stop, trimmed
    assert delta.per_position == [9, 5, 4] and replay["pos"] == [9, 4, 3]
    assert len(out) - delta.accepted == 30  # what generated - accepted would have claimed
    record = {"completion_tokens": 48, "forwards": 33, "drafts": 22, "accepted_per_position": [9, 5, 4]}
    fig = engine_forward_figures([record])
    assert fig["tokens_per_forward"] == pytest.approx(48 / 33)
    assert fig["decode_forwards"] == 32 and fig["draft_rate"] == pytest.approx(22 / 32)
    assert fig["accepted_per_decode_step"] == pytest.approx([9 / 32, 5 / 32, 4 / 32])


def test_tokens_per_forward_pooled_and_per_prompt():
    fig = tokens_per_forward([(48, 30), (48, 33), (5, 0)])  # a pair without forwards is left out
    assert fig["tokens_per_forward"] == pytest.approx(96 / 63)
    assert fig["tokens_per_forward_mean"] == pytest.approx((48 / 30 + 48 / 33) / 2)
    assert fig["tokens_per_forward_mean_stderr"] == pytest.approx(abs(48 / 30 - 48 / 33) / 2)
    assert (fig["prompts"], fig["generated_tokens"], fig["target_forwards"]) == (2, 96, 63)
    empty = tokens_per_forward([])
    assert empty["tokens_per_forward"] is None and empty["prompts"] == 0


def test_in_process_figures_and_plain_decoding_is_one():
    # prompt 0: steps of 2, 1, 3 tokens -> 1 + 6 = 7 tokens in 1 + 3 = 4 forwards; prompt 1: 1 + 4 = 5 in 2
    fig = in_process_forward_figures([[2, 1, 3], [4]], block_size=4)
    assert fig["tokens_per_forward"] == pytest.approx(12 / 6)
    assert fig["tokens_per_forward_mean"] == pytest.approx((7 / 4 + 5 / 2) / 2)
    # draft k (1-based) accepted iff the step made >= k + 1 tokens: of steps 2, 1, 3, 4 that is 3, 2, 1 of 4
    assert fig["accepted_per_decode_step"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    plain = in_process_forward_figures([[1] * 10, [1] * 3, []], block_size=4)
    assert plain["tokens_per_forward"] == 1.0 and plain["tokens_per_forward_mean"] == 1.0


def test_engine_figures_count_steps_without_a_draft():
    # 20 tokens in 10 forwards: 9 decode steps, 4 of which drafted; an errored prompt is left out
    records = [
        {"completion_tokens": 20, "forwards": 10, "drafts": 4, "accepted_per_position": [4, 3, 3]},
        {"completion_tokens": 8, "forwards": 8, "drafts": 0, "accepted_per_position": [0, 0, 0]},
        {"error": "ReplyError: x"},
    ]
    fig = engine_forward_figures(records)
    assert fig["tokens_per_forward"] == pytest.approx(28 / 18)
    assert fig["decode_forwards"] == 16 and fig["draft_rate"] == pytest.approx(4 / 16)
    assert fig["accepted_per_decode_step"] == pytest.approx([4 / 16, 3 / 16, 3 / 16])
    # per step: 1 + sum of acceptance per decode step = tokens per decode forward when no token was trimmed
    assert 1 + sum(fig["accepted_per_decode_step"]) == pytest.approx((20 - 1 + 8 - 1) / 16)


def test_paired_ratio_is_the_delta_method_on_log_r():
    """Computed independently: log R = log sum t_a - log sum f_a - log sum t_b + log sum f_b, whose gradient per
    prompt gives the influence ``t_ai / T_a - f_ai / F_a - t_bi / T_b + f_bi / F_b``."""
    rows = [(48, 30, 48, 33), (40, 20, 40, 31), (64, 40, 64, 36), (12, 9, 12, 12)]
    ta, fa, tb, fb = (sum(r[k] for r in rows) for k in range(4))
    z = [r[0] / ta - r[1] / fa - r[2] / tb + r[3] / fb for r in rows]
    ratio = (ta / fa) / (tb / fb)
    se = ratio * math.sqrt(len(rows) / (len(rows) - 1) * sum(x * x for x in z))
    got = paired_ratio(rows)
    assert got["ratio"] == pytest.approx(ratio) and got["ratio_stderr"] == pytest.approx(se)
    assert got["ratio_z"] == pytest.approx((ratio - 1) / se) and got["prompts"] == 4
    diffs = [a / b - c / d for a, b, c, d in rows]
    assert got["mean_difference"] == pytest.approx(sum(diffs) / 4)
    assert paired_ratio([(5, 0, 5, 3)])["ratio"] is None  # no forward: not a pair


def test_the_paired_standard_error_matches_the_spread_of_the_ratio():
    """Monte Carlo: 400 draws of 32 prompts whose forwards vary together; the mean stated standard error is within
    15% of the ratio's observed spread (an unpaired one would be far larger)."""
    rng = random.Random(0)
    ratios, ses = [], []
    for _ in range(400):
        rows = []
        for _ in range(32):
            tokens, easy = rng.randint(20, 64), rng.uniform(1.2, 2.4)  # a prompt easy for both or hard for both
            rows.append(
                (tokens, max(1, round(tokens / easy)), tokens, max(1, round(tokens / (easy * rng.uniform(0.8, 1.0)))))
            )
        got = paired_ratio(rows)
        ratios.append(got["ratio"])
        ses.append(got["ratio_stderr"])
    spread = statistics.stdev(ratios)
    assert statistics.fmean(ses) == pytest.approx(spread, rel=0.15)


def test_verdict_needs_two_paired_standard_errors():
    win = paired_ratio([(40, 20, 40, 30), (40, 19, 40, 28), (40, 21, 40, 31), (40, 20, 40, 29)])
    assert verdict(win)[0] == "drafter"
    assert verdict(win)[1].startswith(
        "DFlash 2.00 vs n-gram lookup 1.36 tokens per forward (no training), pooled over 4 "
    )
    assert "the drafter wins by more than 2 standard errors" in verdict(win)[1]
    noisy = paired_ratio([(40, 20, 40, 22), (40, 30, 40, 25), (40, 20, 40, 24), (40, 26, 40, 22)])
    assert verdict(noisy)[0] == "tie" and "within 2 standard errors of a tie" in verdict(noisy)[1]
    lose = paired_ratio([(40, 30, 40, 20), (40, 29, 40, 19), (40, 31, 40, 21)])
    assert verdict(lose)[0] == "ngram"
    assert verdict(None) == (None, None)


def test_splits_by_turn_kind_and_context_length():
    assert [context_bucket(n) for n in (10, 512, 513, 1024, 2048, 2049)] == [
        "<=512", "<=512", "513-1024", "513-1024", "1025-2048", ">2048",
    ]  # fmt: skip
    drafter = [_rec("d", i, 30, f, 1, 1, [1, 0, 0]) for i, f in enumerate([10, 15, 20, 12])]
    ngram = [_rec("d", i, 30, f, 1, 1, [1, 0, 0]) for i, f in enumerate([20, 15, 10, 24])]
    groups = {("d", i): {"turn kind": k} for i, k in enumerate(["tool call", "plain", "plain", "tool call"])}
    got = paired_engine_figures(drafter, ngram, groups)["d"]
    assert got["ratio"] == pytest.approx((120 / 57) / (120 / 69))
    by = got["by turn kind"]
    assert set(by) == {"plain", "tool call"}
    assert by["tool call"]["ratio"] == pytest.approx((60 / 22) / (60 / 44)) and by["tool call"]["prompts"] == 2


def _section(drafter_tpf_records, ngram_records):
    from dflash_assets.stages.evaluation.vllm_engine import vllm_tau_by_dataset

    return {
        "kind": "vllm",
        "simulated": False,
        "requests": drafter_tpf_records,
        "datasets": vllm_tau_by_dataset(drafter_tpf_records),
        "ngram": {"datasets": vllm_tau_by_dataset(ngram_records), "requests": ngram_records},
    }


def _rec(dataset, position, tokens, forwards, drafts, accepted, per_pos, out=None):
    return {
        "dataset": dataset,
        "position": position,
        "completion_tokens": tokens,
        "forwards": forwards,
        "drafts": drafts,
        "accepted": accepted,
        "accepted_per_position": per_pos,
        "output_ids": out or [1] * tokens,
    }


def test_compare_methods_and_the_warning_check():
    # heldout: DFlash 30 tokens / 20 forwards = 1.5 vs n-gram 30 / 15 = 2.0; other: DFlash 3.0 vs n-gram 1.2
    drafter = [_rec("heldout", 0, 30, 20, 19, 10, [6, 3, 1]), _rec("other", 0, 30, 10, 9, 20, [9, 7, 4])]
    ngram = [_rec("heldout", 0, 30, 15, 10, 15, [8, 4, 3]), _rec("other", 0, 30, 25, 5, 5, [3, 1, 1])]
    local = {"heldout": {"trained": {"accepted_lengths": [[2, 2, 1]], "block_size": 4}}}
    comparison = compare_methods(local, _section(drafter, ngram))
    head, other = comparison["heldout"], comparison["other"]
    assert head["plain"] == 1.0
    assert head["drafter"] == pytest.approx(1.5) and head["drafter_source"] == "engine"
    assert head["drafter_in_process"]["tokens_per_forward"] == pytest.approx(6 / 4)
    assert head["ngram_tokens_per_forward"] == pytest.approx(2.0) and head["winner"] == "ngram"
    assert head["margin"] == pytest.approx(-0.5)
    assert other["winner"] == "drafter" and other["drafter_in_process"] is None
    check = baseline_check(comparison)
    assert not check["passed"] and check["compared"]
    assert check["reasons"] == [
        "heldout: DFlash 1.50 vs n-gram lookup 2.00 tokens per forward (no training), pooled over 1 prompts in one "
        "vLLM run each: 0.75x +- 0.00 (paired standard error): the drafter loses by more than 2 standard errors"
    ]
    # no engine: the in-process figure stands alone and the check passes, saying why nothing was compared
    alone = compare_methods(local, None)
    assert alone["heldout"]["drafter_source"] == "in-process" and alone["heldout"]["winner"] is None
    assert baseline_check(alone, "no engine run") == {
        "passed": True,
        "reasons": [],
        "compared": False,
        "why": "no engine run",
    }


def test_ngram_output_is_checked_against_plain_greedy():
    records = [_rec("d", 0, 3, 3, 0, 0, [], out=[5, 6, 7]), _rec("d", 1, 2, 2, 0, 0, [], out=[8, 9])]
    assert ngram_lossless(records, {"d": [[5, 6, 7], [8, 9]]}) == []
    (line,) = ngram_lossless(records, {"d": [[5, 6, 7], [8, 4]]})
    assert "prompt 1, generated token 1 (expected id 4, got 9)" in line
    assert ngram_lossless(records, {"d": [None, [8, 9]]}) == []  # unknown expected output: not compared


def test_summary_lines_say_who_wins_per_dataset():
    lose = verdict(paired_ratio([(40, 30, 40, 20), (40, 29, 40, 19), (40, 31, 40, 21)]))[1]
    win = verdict(paired_ratio([(40, 20, 40, 30), (40, 19, 40, 28), (40, 21, 40, 31)]))[1]
    s = {
        "tokens_per_forward_by_dataset": {"humaneval": {"verdict": win}, "bfcl": {"verdict": lose}},
        "baseline_statistic": "pooled ratio",
    }
    assert baseline_lines(s) == [
        f"vs n-gram lookup   humaneval: {win}",
        f"                   bfcl: {lose}",
        "                   (statistic: pooled ratio; plain decoding 1.00)",
    ]
    alone = {"drafter_tokens_per_forward": 1.6, "ngram_baseline_not_compared": "no engine run (engine: none)"}
    assert baseline_lines(alone)[0].endswith("n-gram lookup not measured: no engine run (engine: none)")
    assert baseline_lines({}) == []


def test_launch_settings_for_the_ngram_run():
    assert ngram_speculative_config(3, 4, 1) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    with pytest.raises(ValueError, match="prompt_lookup_min 5 is above prompt_lookup_max 4"):
        ngram_speculative_config(3, 4, 5)
    assert ngram_server_flags(16) == ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "16"]
    with pytest.raises(ValueError):
        ngram_server_flags(1)


def test_the_plot_gets_a_per_position_panel():
    one = acceptance_histogram_png({"trained": [1, 2, 3]}, 4)
    two = acceptance_histogram_png({"trained": [1, 2, 3]}, 4, per_position={"n-gram": [0.5, 0.2, 0.1]})
    width, height = (int.from_bytes(two[16:20], "big"), int.from_bytes(two[20:24], "big"))
    assert two[:8] == b"\x89PNG\r\n\x1a\n" and (width, height) == (700, 640)
    assert int.from_bytes(one[20:24], "big") == 360


def test_the_evaluations_checks_cover_ngram_output_and_its_metadata(tmp_path):
    """The lossless check covers the engine's n-gram decoding too; the metadata carries the held-out figures."""
    from dflash_assets.stages.evaluation.run import baseline_metadata, evaluation_checks

    (tmp_path / "config.json").write_text(
        json.dumps({"dflash_config": {"block_size": 4, "target_layer_ids": [1], "mask_token_id": 7}})
    )
    trained = {
        "per_prompt_tau": [1.5],
        "plain_output_ids": [[1, 2, 3]],
        "lossless": True,
        "accepted_lengths": [[2]],
        "block_size": 4,
        "step_parity": {"prompts_replayed": 1, "steps_compared": 1, "mismatches": 0, "ties": 0, "listed": []},
    }
    report = {"datasets": {"heldout": {"trained": trained, "untrained": {"lossless": True}}}}
    drafter = [_rec("heldout", 0, 3, 2, 1, 1, [1, 0, 0], out=[1, 2, 3])]
    drafter[0].update(tau=1.5, steps=[[3, 1]])  # 1 + accepted / drafts, as vLLM counts it
    ngram = [_rec("heldout", 0, 3, 3, 0, 0, [0, 0, 0], out=[1, 2, 9])]
    section = {**_section(drafter, ngram), "requests": drafter}
    meta = {"block_size": 4, "target_layer_ids": [1], "mask_token_id": 7}
    checks = evaluation_checks(report, section, meta, str(tmp_path), in_process=True)
    assert checks["engine_parity"]["passed"], checks
    assert not checks["lossless"]["passed"]
    assert checks["lossless"]["reasons"] == [
        "heldout: the engine's n-gram output differs from the greedy output at prompt 0, generated token 2 "
        "(expected id 3, got 9)"
    ]
    md = baseline_metadata(compare_methods(report["datasets"], section))
    assert md["drafter_tokens_per_forward"] == pytest.approx(1.5) and md["ngram_tokens_per_forward"] == 1.0
    assert md["drafter_in_process_tokens_per_forward"] == pytest.approx(3 / 2)
    assert md["baseline_winner"] == "drafter" and md["plain_tokens_per_forward"] == 1.0
    assert md["tokens_per_forward_by_dataset"]["heldout"]["ngram"] == 1.0


def test_a_drafter_losing_to_ngram_is_logged_as_a_warning_not_an_error():
    """A fresh user saw the WARN check drafter_beats_ngram printed at ERROR beside real failures."""
    import logging

    from dflash_assets.stages.evaluation.run import log_failed_checks

    log = logging.getLogger("test_ngram_warn")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log.addHandler(handler)
    try:
        log_failed_checks(
            log,
            {
                "drafter_beats_ngram": {"passed": False, "reasons": ["n-gram 1.75 > drafter 1.54"]},
                "engine_parity": {"passed": False, "reasons": ["differs by 0.2"]},
                "lossless": {"passed": True, "reasons": []},
            },
        )
    finally:
        log.removeHandler(handler)
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.WARNING, "check drafter_beats_ngram failed: n-gram 1.75 > drafter 1.54"),
        (logging.ERROR, "check engine_parity failed: differs by 0.2"),
    ]
