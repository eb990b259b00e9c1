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
import polars as pl
import pytest
import yaml

from dflash_assets.common import config as cfg
from dflash_assets.common.conversation import stored_message
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.sequence_builder import SequenceBuilder
from dflash_assets.data.tokenization import TokenizePolicy, tokenize_partition
from dflash_assets.generation.client.completion_client import CompletionClient
from dflash_assets.generation.engines.engine_render import engine_tools, sglang_messages
from dflash_assets.generation.engines.environments import EngineEnvironment, EngineEnvironmentError
from dflash_assets.generation.engines.hybrid_standin import CHAT_TEMPLATE
from dflash_assets.generation.processes.ports import free_port_block
from dflash_assets.generation.rows.continuation import continuation_body
from dflash_assets.generation.rows.records import row_from_result, rows_to_frame
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
from dflash_assets.generation.servers.sglang_servers import build_sglang_commands
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets_tests.engine_bodies import TOJSON_TEMPLATE, project_bodies
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
    "sglang-router==0.3.2",  # its launch_server parser (a Rust extension module that loads on any x86-64 Linux)
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
    router = inference.sglang_commands(use_router=True)[0]  # one sglang_router --dp-size 7 for the same servers
    deterministic = inference.sglang_commands(extra_args=["--enable-deterministic-inference"])[0]
    cases = [{"op": "server_args", "argv": server_argv(c.argv)} for c in servers]
    cases += [
        {"op": "server_args", "argv": server_argv(engine[0].argv)},
        {"op": "server_args", "argv": server_argv(tuple(keyed.launch_argv(key_file)))},
        {"op": "router_args", "argv": server_argv(router.argv)},
        {"op": "server_args", "argv": server_argv(deterministic.argv)},
        {"op": "server_args", "argv": [*server_argv(deterministic.argv), "--attention-backend", "fa4"]},
        {"op": "server_args", "argv": ["--model-path", "/m", "--speculative-dflash-draft-window-size", "8"]},
        {"op": "router_args", "argv": ["--model-path", "/m", "--router-dp-worker-base-prot", "31000"]},
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
    # the router's command line through sglang-router's own launch_server parser (its ServerArgs and RouterArgs)
    router_verdict = verdicts[len(servers) + 2]
    parsed = router_verdict["server"]
    assert {k: parsed[k] for k in intended} == intended
    assert (parsed["dp_size"], parsed["port"]) == (g["num_servers"], 30000)
    assert router_verdict["worker_base_port"] == 31000  # build_router_command's default
    assert (router_verdict["router"]["host"], router_verdict["router"]["port"]) == ("127.0.0.1", 30000)
    # --enable-deterministic-inference, as SGLang resolves it at launch on a B200: another attention backend, the
    # pytorch sampler and no radix cache (prefix reuse lost: docs/configuration.md says so where the seed is set)
    seeded = verdicts[len(servers) + 3]
    assert seeded["prepared"]["enable_deterministic_inference"] is True
    assert seeded["deterministic"] == {
        "attention_backend": "flashinfer",
        "sampling_backend": "pytorch",
        "disable_radix_cache": True,
    }
    # with --attention-backend fa4 beside it (what the GPU config's comment advises) the radix cache stays
    assert verdicts[len(servers) + 4]["deterministic"] == {
        "attention_backend": "fa4",
        "sampling_backend": "pytorch",
        "disable_radix_cache": False,
    }
    # the judge can refuse: a flag SGLang dropped in 0.5.20 is an argparse error naming it; so is a router flag
    # misspelt
    assert "--speculative-dflash-draft-window-size" in verdicts[-2]["error"]
    assert "--router-dp-worker-base-prot" in verdicts[-1]["error"]


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


# ------------------------------------------------------------------------------------------ the template's inputs

TOOL_DUMP_EXTRA = len(', "defer_loading": null')  # what SGLang's Tool dump adds to each tool written by tojson


@pytest.fixture(scope="module")
def tojson_tokenizer():
    """The embedded SmolLM2 tokenizer with a ``{{ tool | tojson }}`` template (the Qwen2.5 / Qwen3 form)."""
    from transformers import AutoTokenizer

    from dflash_assets.generation.engines.local_model import ensure_local_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_local_model()))
    tokenizer.chat_template = TOJSON_TEMPLATE.read_text()
    return tokenizer


def sglang_process(python: Path, bodies: list, prompt_ids: list[int] | None = None) -> list[dict]:
    """SGLang's ``chat_process`` verdict on each body (served with the qwen3 reasoning parser, the tojson template)."""
    cases = [
        {
            "op": "chat_process",
            "server_argv": QWEN3,
            "chat_template": TOJSON_TEMPLATE.read_text(),
            "body": b.body,
            **({"prompt_ids": prompt_ids} if prompt_ids else {}),
        }
        for b in bodies
    ]
    return judge(python, cases)


@pytest.fixture(scope="module")
def processed(sglang_python) -> tuple[list, list[dict]]:
    """Every body the project sends SGLang and SGLang's ``chat_process`` verdict on each (one judge run)."""
    bodies = project_bodies("sglang")
    return bodies, sglang_process(sglang_python, bodies, prompt_ids=[7, 8, 9])


def test_sglang_hands_the_template_what_the_project_renders_for_every_body(processed, tojson_tokenizer):
    """Issue 49 items 2 and 3: every body the project sends (a plain prompt, a BFCL tool conversation with 31
    tools, the tool probe, tools without a description, an on-policy turn, a tail chunk and its follow-up, a
    continuation, the start-up probe) goes through SGLang's own ``_convert_to_internal_request``; the messages,
    tools and template arguments SGLang hands ``apply_chat_template`` are the project's, key order included, and
    rendered with a tojson template they give the same text; SGLang asks its tokenizer manager for the prompt's ids
    and honours the seed's value as ``sampling_seed``."""
    bodies, verdicts = processed
    builder = SequenceBuilder(tojson_tokenizer, engine="sglang")
    for b, verdict in zip(bodies, verdicts, strict=True):
        assert "error" not in verdict, (b.name, verdict)
        (call,) = verdict["template_calls"]
        messages = sglang_messages(b.api_messages, continue_final_message=b.continued)
        tools, kwargs = engine_tools("sglang", b.api_tools), {"add_generation_prompt": True, **b.template_kwargs}
        assert json.dumps(call["messages"]) == json.dumps(messages), b.name  # key order too
        assert json.dumps(call["tools"]) == json.dumps(tools), b.name
        assert {k: call[k] for k in kwargs} == kwargs and call["tokenize"] is False, b.name
        assert set(call) - {"messages", "tools"} == {*kwargs, "tokenize", "return_dict"}, b.name  # nothing else
        theirs = tojson_tokenizer.apply_chat_template(
            call["messages"], tools=call["tools"], **{k: v for k, v in call.items() if k not in ("messages", "tools")}
        )
        thinking = b.template_kwargs.get("enable_thinking", True)
        assert builder.prompt_text(b.messages, thinking, b.tools) == theirs, b.name
        generate = verdict["generate"]
        prefix = [b.body["messages"][-1]["content"]] if b.continued else []  # SGLang encodes it after the prompt
        assert verdict["encoded"] == prefix, b.name
        assert generate["input_ids"] == [7, 8, 9] + [0] * len("".join(prefix)), b.name
        # every body that carries return_token_ids (all but the start-up probe) gets the prompt's ids back
        assert generate["return_prompt_token_ids"] is bool(b.body.get("return_token_ids")), b.name
        assert generate["sampling_params"]["sampling_seed"] == b.body.get("seed"), b.name
    # what SGLang's tool dump does to a tojson template, computed apart from the project's dump: the raw tools
    # render 23 characters shorter per tool, and a function without a description gains "description": null
    by_name = {b.name: b for b in bodies}
    bfcl = by_name["tool conversation (BFCL, 31 tools)"]
    raw = SequenceBuilder(tojson_tokenizer)  # the project's rendering before issue 49: the tools as stored
    ours, before = (b.prompt_text(bfcl.messages, True, bfcl.tools) for b in (builder, raw))
    extra = len(ours) - len(before)
    assert len(bfcl.api_tools) == 31 and extra == 31 * TOOL_DUMP_EXTRA == 713
    bare = by_name["tools without a description, with strict"]
    text = builder.prompt_text(bare.messages, True, bare.tools)
    assert '{"name": "lookup", "parameters": {"type": "object", "properties": {}}, "description": null}' in text
    assert '"strict": true, "description": null}, "defer_loading": null}' in text


def test_a_reply_with_prompt_ids_is_the_tokenized_row_exactly(sglang_python, processed, tojson_tokenizer):
    """Done when, on SGLang's own code: a BFCL tool conversation's context as SGLang hands it to a tojson template,
    rendered and encoded by the real tokenizer, is the engine output's ``prompt_token_ids``; SGLang's
    ``_build_chat_response`` puts them beside the generated ids; the project's client reads both, the row says
    they are the server's, and the tokenized row is exactly prompt ids + output ids + the end token."""
    b, verdict = next((b, v) for b, v in zip(*processed, strict=True) if b.name.startswith("tool conversation"))
    (call,) = verdict["template_calls"]
    text = tojson_tokenizer.apply_chat_template(
        call["messages"], tools=call["tools"], **{k: v for k, v in call.items() if k not in ("messages", "tools")}
    )
    prompt_ids = tojson_tokenizer.encode(text)  # as SGLang encodes it (no special token added for this tokenizer)
    answer = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    output_ids = tojson_tokenizer.encode(answer, add_special_tokens=False)
    (reply,) = judge(
        sglang_python,
        [
            {
                "op": "chat_reply",
                "server_argv": NO_PARSER,
                "chat_template": TOJSON_TEMPLATE.read_text(),
                "request": b.body,
                "text": answer,
                "output_ids": output_ids,
                "finish_reason": {"type": "stop", "matched": 2},
                "prompt_tokens": len(prompt_ids),
                "prompt_token_ids": prompt_ids,
            }
        ],
    )
    choice = json.loads(reply["body"])["choices"][0]
    assert (choice["prompt_token_ids"], choice["response_token_ids"]) == (prompt_ids, output_ids)
    origin = {"engine": "sglang", "engine_version": "sglang 0.5.23", "template_sha256": "t" * 64}
    with FakeServer(Raw(200, reply["body"].encode())) as server:
        results = []
        client = CompletionClient([server.url], concurrency=1, max_attempts=1, vocab_size=49152, origin=origin)
        asyncio.run(client.generate([(4, b.body)], results.append))
    prompt = {"index": 4, "prompt_id": "bfcl:4", "source": "bfcl", "content_hash": "h4"}
    row = row_from_result(results[0], prompt, GenerationSettings(max_output_tokens=16))
    assert (row["ids_source"], row["engine"], row["engine_version"]) == ("server", "sglang", "sglang 0.5.23")
    corpus = pl.DataFrame(
        {
            "index": [4],
            "prompt_id": ["bfcl:4"],
            "messages": [[stored_message(m) for m in b.api_messages]],
            "tools": [b.tools],
            "content_hash": ["h4"],
        }
    )
    builder = SequenceBuilder(tojson_tokenizer, engine="sglang")
    tokenized, aside, counts = tokenize_partition(rows_to_frame([row]), corpus, builder, TokenizePolicy(8192))
    (tok,) = tokenized.iter_rows(named=True)
    assert tok["input_ids"] == prompt_ids + output_ids + [builder.end_token_id] and tok["prompt_len"] == len(prompt_ids)
    assert (tok["ids_source"], tok["rendering_matches"], tok["template_sha256"]) == ("server", True, "t" * 64)
    assert counts["ids_server"] == 1 and counts["prompt_ids_checked"] == 1 and aside.height == 0


def test_the_length_pre_filter_is_sglangs_own_rule(sglang_python):
    """Issue 49 item 5: SGLang's ``_validate_one_request`` takes a prompt of exactly context - cap tokens (the
    pre-filter's room) and refuses one token more, and a prompt as long as the context whatever the cap."""
    settings = GenerationSettings(max_output_tokens=64).with_context(200)
    room = settings.prompt_room("sglang")
    cases = [
        {"op": "length_check", "context_length": 200, "prompt_tokens": n, "max_new_tokens": cap}
        for n, cap in ((room, 64), (room + 1, 64), (200, 1), (199, 1))
    ]
    verdicts = judge(sglang_python, cases)
    assert room == 136 and verdicts[0]["ok"] is True and verdicts[3]["ok"] is True
    assert "137 tokens from the input messages and 64 tokens" in verdicts[1]["error"]
    assert "The input (200 tokens) is longer than the model's context length" in verdicts[2]["error"]


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
