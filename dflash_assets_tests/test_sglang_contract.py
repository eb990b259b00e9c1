"""SGLang 0.5.23's own code judges every command line, request and reply of the SGLang path (issue 38).

The tests until now spoke to ``dflash_simulators.sglang_stub``, which encodes what we believe SGLang does. Here
SGLang itself decides: its wheel is installed ``--no-deps`` into an environment of its own (it pins another
torch, transformers and openai than the project) with the few pure-Python packages its parsers and protocol
models import (:data:`JUDGE_REQUIREMENTS`), made once per machine under the engine cache
(:class:`~dflash_assets.generation.engines.environments.EngineEnvironment`), and ``dflash_simulators/sglang_judge.py``
runs SGLang's code there in a subprocess, exchanging JSON:

- every command line the project builds (the GPU config's servers, with and without an API key file; the
  DFLASH engine mode; the router's server flags) is parsed by SGLang's ``ServerArgs`` parser and
  ``prepare_server_args``, and the parsed values are the ones the config asks for;
- every request body (chat, a continuation with ``continue_final_message``, a tail chunk and its follow-up,
  ``/generate`` for engine tau) is validated by SGLang's ``ChatCompletionRequest`` (no key it would drop in
  silence) or ``GenerateReqInput`` / ``SamplingParams``;
- replies SGLang's ``_build_chat_response`` makes (stop; length inside and after the thinking; abort; with
  and without reasoning; raw text for a chunk) are served on a real socket to the project's client and become
  rows with the model's exact ids; ``/generate``'s ``meta_info`` speculative fields, as SGLang's tokenizer
  manager computes them, become the engine-tau record.

Skipped, saying so, only when PyPI cannot be reached to make the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from dflash_assets.common import config as cfg
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.client.completion_client import CompletionClient
from dflash_assets.generation.engines.environments import EngineEnvironment, EngineEnvironmentError
from dflash_assets.generation.engines.hybrid_standin import CHAT_TEMPLATE
from dflash_assets.generation.processes.ports import free_port_block
from dflash_assets.generation.rows.continuation import continuation_body
from dflash_assets.generation.rows.records import row_from_result
from dflash_assets.generation.rows.tail_chunks import TailChunker
from dflash_assets.generation.servers.group import write_key_config
from dflash_assets.generation.servers.pool import API_KEY_ENV, ServerPool
from dflash_assets.generation.servers.sglang_dflash import (
    GREEDY_SAMPLING,
    SPEC_FIELDS,
    EnginePrompt,
    dflash_server_flags,
    engine_generate,
)
from dflash_assets.generation.servers.sglang_servers import build_router_command, build_sglang_commands
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_simulators.behaviours import Raw
from dflash_simulators.simulated_replies import THINK_TOKEN_ID, reply_token_ids
from dflash_simulators.stand_in_server import FakeServer

ROOT = Path(__file__).resolve().parents[1]
JUDGE = ROOT / "bench" / "dflash_simulators" / "sglang_judge.py"
GPU_CONFIG = ROOT / "dflash_assets" / "configs" / "gpu_qwen36_27b.yaml"
#: SGLang's wheel without its dependencies, and the pure-Python packages its parsers and protocol code import
#: (versions as resolved next to it; ``openai`` is SGLang's own pin). Everything heavy is stood in.
JUDGE_REQUIREMENTS = (
    "sglang==0.5.23",
    "annotated-types==0.8.0",
    "anyio==4.16.0",
    "certifi==2026.10.19.post1",
    "charset-normalizer==3.5.3",
    "dill==0.4.1",
    "distro==1.9.0",
    "h11==0.16.0",
    "httpcore==1.0.9",
    "httpx==0.29.0",
    "idna==3.20",
    "jiter==0.19.0",
    "msgspec==0.23.0",
    "numpy==2.4.6",
    "openai==2.8.0",
    "orjson==3.13.0",
    "packaging==26.4",
    "psutil==7.2.2",
    "pybase64==1.5.1",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "PyYAML==6.0.4",
    "regex==2026.11.19",
    "requests==2.34.2",
    "sniffio==1.3.1",
    "tqdm==4.70.1",
    "typing-inspection==0.4.5",
    "typing_extensions==4.16.0",
    "urllib3==2.8.0",
)
SGLANG_ENV = EngineEnvironment(
    "sglang-judge",
    JUDGE_REQUIREMENTS,
    import_check="import importlib.metadata as m; assert m.version('sglang') == '0.5.23'",
    extra_pip_args=("--no-deps",),
)
#: what pip says when it cannot reach the index (the only reason the tests skip)
UNREACHABLE = (
    "NewConnectionError",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Name or service not known",
    "ConnectTimeoutError",
)
VOCAB = 248_320  # Qwen3.6's vocabulary
THINK, ANSWER = [1001, 1002, 1003], [2001, 2002]  # the "model's" ids in the replies below


@pytest.fixture(scope="module")
def sglang_python() -> Path:
    """The judge environment's interpreter (made on first use, ~40 MB; reused after)."""
    try:
        return SGLANG_ENV.ensure()
    except EngineEnvironmentError as exc:
        if any(sign in str(exc) for sign in UNREACHABLE):
            pytest.skip(f"PyPI is unreachable, so SGLang 0.5.23 cannot be installed to judge the contract: {exc}")
        raise


def judge(python: Path, cases: list[dict]) -> list[dict]:
    """SGLang's verdict on each case (``sglang_judge.py``), in one subprocess."""
    proc = subprocess.run(
        [str(python), str(JUDGE)], input=json.dumps(cases), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert len(results) == len(cases)
    for case, result in zip(cases, results):
        assert "crash" not in result, (case, result)
    return results


def gpu_resources(monkeypatch, tmp_path, seed: int | None = None) -> dict:
    """The bundled GPU config's resources (with ``generation.seed`` set when given)."""
    resources = yaml.safe_load(GPU_CONFIG.read_text())["resources"]
    config = {"resources": {"inference": resources["inference"], "generation": resources["generation"]}}
    if seed is not None:
        config["resources"]["generation"]["seed"] = seed
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("DFLASH_CONFIG", str(path))
    return cfg.build_resources({"inference": InferenceServerResource, "generation": GenerationResource})


# ------------------------------------------------------------------------------------------ command lines


def server_argv(argv: tuple[str, ...]) -> list[str]:
    """A launch command's flags: everything after ``python -m <module>``."""
    assert argv[1] == "-m"
    return list(argv[3:])


def test_every_command_line_parses_in_sglangs_own_parser_with_the_values_intended(sglang_python, monkeypatch, tmp_path):
    built = gpu_resources(monkeypatch, tmp_path)
    inference = built["inference"]
    want = yaml.safe_load(GPU_CONFIG.read_text())["resources"]["inference"]  # read apart from the resource
    servers = inference.sglang_commands()
    dflash = dflash_server_flags(
        "/exports/drafter", 16, draft_attention_backend="fa3", mamba_strategy="extra_buffer", draft_window_size=2048
    )
    engine = inference.sglang_commands(extra_args=dflash, use_router=False)
    key_file = write_key_config(tmp_path, "sk-judge-0123")
    keyed = build_sglang_commands(want["sglang"]["model_path"], api_key_env=API_KEY_ENV)[0]
    router = build_router_command(
        want["sglang"]["model_path"], num_servers=7, port=30000, worker_port_base=31000, context_length=16384
    )
    router_flags = server_argv(router.argv)
    at = router_flags.index("--router-dp-worker-base-port")  # sglang_router's own flag: not ServerArgs'
    assert router_flags[at + 1] == "31000"
    del router_flags[at : at + 2]
    deterministic = inference.sglang_commands(extra_args=["--enable-deterministic-inference"])[0]
    cases = [{"op": "server_args", "argv": server_argv(c.argv)} for c in servers]
    cases += [
        {"op": "server_args", "argv": server_argv(engine[0].argv)},
        {"op": "server_args", "argv": server_argv(tuple(keyed.launch_argv(key_file)))},
        {"op": "server_args", "argv": router_flags},
        {"op": "server_args", "argv": server_argv(deterministic.argv)},
        {"op": "server_args", "argv": ["--model-path", "/m", "--speculative-dflash-draft-window-size", "8"]},
    ]
    verdicts = judge(sglang_python, cases)

    g = want["sglang"]
    intended = {
        "model_path": g["model_path"],
        "tp_size": g["tp_size"],
        "max_running_requests": want["max_running_requests"],
        "max_mamba_cache_size": g["max_mamba_cache_size"],
        "mem_fraction_static": g["mem_fraction_static"],
        "context_length": g["context_length"],
        "reasoning_parser": g["reasoning_parser"],
        "host": "127.0.0.1",
    }
    assert len(servers) == g["num_servers"] == 7
    for i, verdict in enumerate(verdicts[: len(servers)]):
        assert "error" not in verdict, verdict
        for parsed in (verdict["namespace"], verdict["prepared"]):
            assert {k: parsed[k] for k in intended} == intended
            assert parsed["port"] == 30000 + i
    engine_verdict = verdicts[len(servers)]["prepared"]
    assert {k: engine_verdict[k] for k in intended} == intended
    assert engine_verdict["speculative_algorithm"] == "DFLASH"
    assert engine_verdict["speculative_draft_model_path"] == "/exports/drafter"
    assert engine_verdict["speculative_num_draft_tokens"] == 16
    assert engine_verdict["speculative_draft_attention_backend"] == "fa3"
    assert engine_verdict["mamba_radix_cache_strategy"] == "extra_buffer"
    assert engine_verdict["speculative_draft_window_size"] == 2048
    # the key reaches SGLang through its --config file, never the command line
    keyed_verdict = verdicts[len(servers) + 1]
    assert "sk-judge" not in " ".join(keyed.launch_argv(key_file))
    assert keyed_verdict["prepared"]["api_key"] == "sk-judge-0123"
    router_verdict = verdicts[len(servers) + 2]["prepared"]
    assert (router_verdict["dp_size"], router_verdict["context_length"], router_verdict["port"]) == (7, 16384, 30000)
    assert verdicts[len(servers) + 3]["prepared"]["enable_deterministic_inference"] is True
    # the judge can refuse: a flag SGLang dropped in 0.5.20 is an argparse error naming it
    assert "--speculative-dflash-draft-window-size" in verdicts[-1]["error"]


# ------------------------------------------------------------------------------------------ request bodies

PROMPT = {"index": 3, "prompt_id": "p:3", "source": "p", "messages": [{"role": "user", "content": "What is 2+2?"}]}


def test_every_request_body_is_one_sglangs_request_models_take_whole(sglang_python, monkeypatch, tmp_path):
    built = gpu_resources(monkeypatch, tmp_path, seed=11)
    settings, inference = built["generation"].settings(), built["inference"]
    assert settings.seed == 11
    pool = ServerPool(["http://x/v1"], inference.sglang.model_path, None, 40, "sglang")
    chat = pool.adapt_body(settings.request_body(pool.model, PROMPT["messages"], PROMPT["index"]))
    row = {"completion_tokens": 100}
    continued = pool.adapt_body(
        continuation_body(settings, pool.model, PROMPT["messages"], row, "<think>\nSo far", PROMPT["index"])
    )
    chunker = TailChunker(
        settings, pool.model, pool.adapt_body, opened=True, chunk_tokens=64, window_rows=1, total_rows=1
    )
    first_chunk = chunker.first_body(1, PROMPT, chat)
    bodies = [chat, continued, first_chunk]

    # /generate as engine_generate sends it, caught on a real socket
    reply = {"text": "4", "output_ids": [19], "meta_info": {"id": "a", "finish_reason": {"type": "stop"}}}
    with FakeServer(Raw(200, json.dumps(reply).encode())) as server:
        engine_generate([server.url], [EnginePrompt("d", 0, [5, 6, 7])], 32, stop_token_ids=[248044])
        generate_body = server.bodies[0]
    cases = [{"op": "chat_request", "body": b} for b in bodies]
    cases += [
        {"op": "generate_request", "body": generate_body, "vocab_size": VOCAB},
        {"op": "generate_request", "body": {**generate_body, "sampling_params": {"max_new_token": 8}}, "vocab_size": 9},
        {"op": "chat_request", "body": {**chat, "return_token_id": True}},
    ]
    verdicts = judge(sglang_python, cases)

    for body, verdict in zip(bodies, verdicts):
        assert "error" not in verdict and verdict["unknown"] == [], verdict
        fields = verdict["fields"]
        assert {k: fields[k] for k in body if k != "messages"} == {k: v for k, v in body.items() if k != "messages"}
        assert fields["return_token_ids"] is True and fields["seed"] == 11 + PROMPT["index"]
    assert verdicts[1]["fields"]["continue_final_message"] is True
    assert verdicts[1]["fields"]["separate_reasoning"] is False
    assert verdicts[2]["fields"]["max_tokens"] == 64 and verdicts[2]["fields"]["separate_reasoning"] is False
    assert generate_body == {
        "input_ids": [5, 6, 7],
        "sampling_params": {**GREEDY_SAMPLING, "max_new_tokens": 32, "stop_token_ids": [248044]},
    }
    assert verdicts[3] == {"ok": True, "stubbed": verdicts[3]["stubbed"]}
    # the judge can refuse: a misspelt sampling key is SGLang's 400, a misspelt chat key is dropped in silence
    assert "max_new_token" in verdicts[4]["error"]
    assert verdicts[5]["unknown"] == ["return_token_id"]


# ------------------------------------------------------------------------------------------ replies to rows

THINKING_ON = {"model": "m", "messages": PROMPT["messages"], "max_tokens": 5, "return_token_ids": True}
THINKING_OFF = {**THINKING_ON, "chat_template_kwargs": {"enable_thinking": False}}
QWEN3 = ["--model-path", "/models/Qwen3.6-27B", "--reasoning-parser", "qwen3"]
NO_PARSER = ["--model-path", "/models/Qwen3.6-27B"]
# (name, server flags, request, the generated text, finish_reason, the row wanted:
#  reasoning_content, content, finish_reason, truncated_in_reasoning)
REPLIES = [
    ("stop", QWEN3, THINKING_ON, "Two and two.</think>\n\n4", {"type": "stop", "matched": 248046},
     ("Two and two.", "4", "stop", False)),
    ("length inside thinking", QWEN3, THINKING_ON, "Two and", {"type": "length", "length": 5},
     ("Two and", "", "length", True)),
    ("length after thinking", QWEN3, THINKING_ON, "Two.</think>\n\nIt is", {"type": "length", "length": 5},
     ("Two.", "It is", "length", False)),
    ("abort", QWEN3, THINKING_ON, "Two", {"type": "abort", "message": "aborted by the scheduler"},
     ("Two", "", "abort", False)),
    ("no reasoning, thinking off", QWEN3, THINKING_OFF, "4", {"type": "stop", "matched": 248046},
     (None, "4", "stop", False)),
    ("no reasoning parser", NO_PARSER, THINKING_ON, "4", {"type": "stop", "matched": 248046},
     (None, "4", "stop", False)),
    ("a tail chunk: raw text", QWEN3, {**THINKING_ON, "separate_reasoning": False}, "Two.</think>\n\n4",
     {"type": "stop", "matched": 248046}, ("Two.", "4", "stop", False)),
]  # fmt: skip


def rows_through_the_client(bodies: list[bytes], settings: GenerationSettings) -> list[dict]:
    """Each reply body served on a real socket, read by the project's client, made a row."""
    rows = []
    for body in bodies:
        with FakeServer(Raw(200, body)) as server:
            results = []
            client = CompletionClient([server.url], concurrency=1, max_attempts=1, vocab_size=VOCAB)
            asyncio.run(client.generate([(PROMPT["index"], THINKING_ON)], results.append))
        rows.append(row_from_result(results[0], {**PROMPT, "content_hash": "h"}, settings))
    return rows


def test_replies_sglang_builds_become_rows_with_the_models_exact_ids(sglang_python):
    ids = THINK + ANSWER
    cases = [
        {
            "op": "chat_reply",
            "server_argv": argv,
            "chat_template": CHAT_TEMPLATE,  # Qwen3.6's layout: the generation prompt opens the thinking
            "request": request,
            "text": text,
            "output_ids": ids,
            "finish_reason": finish,
            "prompt_tokens": 17,
        }
        for _, argv, request, text, finish, _ in REPLIES
    ]
    cases.append({**cases[0], "request": {k: v for k, v in THINKING_ON.items() if k != "return_token_ids"}})
    verdicts = judge(sglang_python, cases)
    replies = [json.loads(v["body"]) for v in verdicts]
    rows = rows_through_the_client([v["body"].encode() for v in verdicts], GenerationSettings(max_output_tokens=5))

    # what SGLang sends, for the simulator to follow: ids under response_token_ids, "" (not null) for a cut
    # inside the thinking, null reasoning when there is none
    assert replies[0]["choices"][0]["response_token_ids"] == ids and "token_ids" not in replies[0]["choices"][0]
    assert replies[1]["choices"][0]["message"]["content"] == ""
    assert replies[4]["choices"][0]["message"]["reasoning_content"] is None
    for (name, *_, want), row in zip(REPLIES, rows):
        got = (row["reasoning_content"], row["content"], row["finish_reason"], row["truncated_in_reasoning"])
        assert got == want, name
        assert row["error"] is None and row["output_token_ids"] == ids, name
        assert row["output_token_ids_source"] == "response_token_ids", name
        assert (row["prompt_tokens"], row["completion_tokens"]) == (17, len(ids)), name
    # not asked for ids: SGLang sends none and the row says so
    assert rows[-1]["output_token_ids"] is None and rows[-1]["output_token_ids_source"] == "none"


def test_generate_meta_info_from_sglangs_own_arithmetic_becomes_the_engine_tau_record(sglang_python):
    verdict = judge(
        sglang_python,
        [
            {
                "op": "generate_meta",
                "num_draft_tokens": 16,
                "spec_verify_ct": 8,
                "spec_num_correct_drafts": 31,
                "completion_tokens": 39,
                "histogram": [1, 2, 5],
            }
        ],
    )[0]
    meta = {
        "id": "r",
        "finish_reason": {"type": "length", "length": 39},
        "prompt_tokens": 3,
        "completion_tokens": 39,
        "cached_tokens": 0,
        **verdict["meta"],
    }
    reply = {"text": "x", "output_ids": list(range(39)), "meta_info": meta}
    with FakeServer(Raw(200, json.dumps(reply).encode())) as server:
        record = engine_generate([server.url], [EnginePrompt("d", 0, [5, 6, 7])], 39)[0]
    assert verdict["meta"]["spec_accept_length"] == 39 / 8  # SGLang: completion_tokens / spec_verify_ct
    assert verdict["meta"]["spec_num_proposed_drafts"] == 8 * 15
    assert {k: record[k] for k in SPEC_FIELDS} == {k: verdict["meta"][k] for k in SPEC_FIELDS}
    assert (record["finish_reason"], record["completion_tokens"]) == ("length", 39)


# ------------------------------------------------------------------------------------------ the simulator


@pytest.fixture
def stub(tmp_path):
    """The GPU-node simulator in its own process: 100-token sequences (90 thinking), ids returned."""
    port = free_port_block(1)
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "dflash_simulators.sglang_stub", "--port", str(port), "--sim-startup-s", "0"),
            *("--sim-speed", "1000", "--sim-median-tokens", "100", "--sim-sigma", "0", "--sim-token-ids"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.05)
        yield url
    finally:
        proc.kill()
        proc.wait()


def test_the_simulator_answers_where_sglang_does_as_sglang_does(sglang_python, stub):
    """issue 38, Why item 5: the simulator's replies take SGLang's shape (ids as response_token_ids, ``""`` on a
    cut inside the thinking) and it refuses the /generate keys SGLang does; where it differs, it says so."""
    settings = GenerationSettings(max_output_tokens=10)
    pool = ServerPool([f"{stub}/v1"], "simulated-model", None, 1, "sglang")
    cut = pool.adapt_body(settings.request_body(pool.model, PROMPT["messages"]))  # 10 of 90 thinking tokens
    past = {**cut, "max_tokens": 5, "continue_final_message": True}
    past["messages"] = [*PROMPT["messages"], {"role": "assistant", "content": "t " * 90 + "a "}]  # thinking done
    replies = [httpx.post(f"{stub}/v1/chat/completions", json=b, timeout=30).json() for b in (cut, past)]
    unknown = {"input_ids": [1, 2], "sampling_params": {"temperature": 0.0, "max_new_token": 4}}
    refused = httpx.post(f"{stub}/generate", json=unknown, timeout=30)
    verdicts = judge(
        sglang_python,
        [
            {**case, "op": "chat_reply", "chat_template": CHAT_TEMPLATE, "output_ids": THINK, "prompt_tokens": 3}
            for case in (
                {"server_argv": QWEN3, "request": cut, "text": "t t t", "finish_reason": {"type": "length"}},
                {"server_argv": QWEN3, "request": past, "text": "a a", "finish_reason": {"type": "length"}},
            )
        ]
        + [{"op": "generate_request", "body": unknown, "vocab_size": VOCAB}],
    )
    sglang = [json.loads(v["body"])["choices"][0] for v in verdicts[:2]]
    simulated = [r["choices"][0] for r in replies]
    assert sglang[0]["message"]["content"] == simulated[0]["message"]["content"] == ""
    # past the thinking the simulator sends no reasoning (null, as SGLang does for none); SGLang, whose parser
    # never sees the prefix's </think>, labels the answer reasoning: the stub's docstring says so, and
    # test_continuation shows the project keeps such text as answer either way
    assert simulated[1]["message"] == {"role": "assistant", "content": "a " * 5, "reasoning_content": None}
    assert sglang[1]["message"]["reasoning_content"] == "a a" and sglang[1]["message"]["content"] == ""
    for ours, theirs in zip(simulated, sglang):
        assert "response_token_ids" in ours and "response_token_ids" in theirs and "token_ids" not in ours
    assert simulated[0]["response_token_ids"] == reply_token_ids(100, 10)
    assert refused.status_code == 400 and "max_new_token" in refused.text and "max_new_token" in verdicts[2]["error"]

    # the project's client reads the simulator's ids as it reads SGLang's
    results = []
    asyncio.run(CompletionClient([f"{stub}/v1"], concurrency=1).generate([(0, cut)], results.append))
    assert results[0].output_token_ids == reply_token_ids(100, 10) == [THINK_TOKEN_ID] * 10
    assert results[0].output_token_ids_source == "response_token_ids"


@pytest.mark.parametrize(
    "flags, resolved",
    [
        ([], "flashinfer"),  # unset: the target's backend (SGLang picks one per GPU; the simulator says flashinfer)
        (["--attention-backend", "triton"], "triton"),  # unset: the target's
        (["--speculative-draft-attention-backend", "fa3"], "fa3"),
        (["--speculative-draft-attention-backend", "no-such-backend"], "flashinfer"),  # warned, then the fallback
    ],
)
def test_the_simulator_resolves_the_draft_attention_backend_as_sglang_does(flags, resolved):
    from dflash_simulators.sglang_dflash import draft_backend
    from dflash_simulators.sglang_stub import parse_args

    assert draft_backend(parse_args(flags)) == resolved  # a free string, as SGLang's argparse takes it
