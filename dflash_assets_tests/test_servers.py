"""Inference-server launchers and the inference resource.

The local-server tests talk to a real ``transformers serve`` (the session fixture ``local_server``,
greedy decoding); the SGLang tests check command building only (no GPU here).
"""

from __future__ import annotations

import shlex
import sys

import httpx
import pytest

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.processes.ports import free_port
from dflash_assets.generation.servers.group import LaunchCommand
from dflash_assets.generation.servers.pool import ServerPool
from dflash_assets.generation.servers.sglang_servers import build_router_command, build_sglang_commands
from dflash_assets.generation.servers.transformers_server import (
    LocalTransformersServer,
    transformers_generation_config,
)
from dflash_assets.stages.resources.inference import InferenceServerResource

STOP_PROMPT = [{"role": "user", "content": "What is 2+2? Answer with just the number."}]
LENGTH_PROMPT = [{"role": "user", "content": "Write a long story about a dragon."}]


@pytest.fixture(scope="module")
def tokenizer(local_server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local_server.model_dir)


def _chat(server, messages, max_tokens, **extra):
    body = {"model": server.model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _prompt_len(tokenizer, messages) -> int:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---------------------------------------------------------------- local transformers serve (real)


def test_local_server_length_at_cap(local_server, tokenizer):
    reply = _chat(local_server, LENGTH_PROMPT, max_tokens=8)
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 8
    assert reply["usage"]["prompt_tokens"] == _prompt_len(tokenizer, LENGTH_PROMPT)
    assert reply["choices"][0]["message"]["content"]
    assert "reasoning_content" not in reply["choices"][0]["message"]  # llama: no response parser


def test_local_server_stop_counts_end_of_turn(local_server, tokenizer):
    reply = _chat(local_server, STOP_PROMPT, max_tokens=64)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    content = choice["message"]["content"]
    assert "4" in content
    # completion_tokens = the answer's tokens + the <|im_end|> that stopped it (decoded away from content).
    answer_ids = tokenizer(content, add_special_tokens=False)["input_ids"]
    assert reply["usage"]["completion_tokens"] == len(answer_ids) + 1 < 64
    assert reply["usage"]["prompt_tokens"] == _prompt_len(tokenizer, STOP_PROMPT)


def test_local_server_accepts_adapted_default_body(local_server):
    pool = local_server.pool()
    body = GenerationSettings(max_output_tokens=4, seed=3).request_body(pool.model, STOP_PROMPT, index=1)
    raw = httpx.post(f"{pool.base_urls[0]}/chat/completions", json=body, timeout=120)
    assert raw.status_code == 422 and "top_k" in raw.text  # transformers serve rejects non-OpenAI fields
    r = httpx.post(f"{pool.base_urls[0]}/chat/completions", json=pool.adapt_body(body), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 4


def test_local_server_rejects_other_model_name(local_server):
    body = {"model": "not-the-served-model", "messages": STOP_PROMPT, "max_tokens": 2}
    r = httpx.post(f"{local_server.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400


def test_local_server_failure_reports_log_tail(tmp_path, local_server):
    log = tmp_path / "bad.log"
    server = LocalTransformersServer(
        local_server.model_dir, log_path=log, extra_args=("--no-such-flag",), startup_timeout_s=120
    )
    with pytest.raises(RuntimeError, match="no-such-flag"):
        server.__enter__()
    assert server._proc is None  # stopped


def test_local_server_argv_sizes_kv_cache(tmp_path):
    argv = LocalTransformersServer(tmp_path, port=1234, kv_cache_tokens=32769, max_batch_tokens=512).argv()
    assert argv[argv.index("serve") + 1] == str(tmp_path)
    assert argv[argv.index("--port") + 1] == "1234" and "--continuous-batching" in argv
    assert argv[argv.index("--cb-num-blocks") + 1] == "129"  # ceil(32769 / 256)
    assert argv[argv.index("--cb-max-batch-tokens") + 1] == "512"
    mine = LocalTransformersServer(tmp_path, extra_args=("--cb-num-blocks", "7"), max_batch_tokens=None).argv()
    assert mine.count("--cb-num-blocks") == 1 and mine[-1] == "7" and "--cb-max-batch-tokens" not in mine


def test_local_server_refuses_non_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        LocalTransformersServer(tmp_path).__enter__()


def test_generation_config_freezes_settings_sampling(local_server):
    cfg = transformers_generation_config(local_server.model_dir, GenerationSettings(temperature=0.6, top_k=-1))
    assert cfg["do_sample"] is True and cfg["temperature"] == 0.6 and cfg["top_p"] == 0.95 and cfg["top_k"] == 0
    assert cfg["eos_token_id"] == 2  # kept from the model's generation_config.json
    greedy = transformers_generation_config(local_server.model_dir, GenerationSettings(temperature=0.0))
    assert greedy["do_sample"] is False
    assert transformers_generation_config(local_server.model_dir, None) == {}


# ---------------------------------------------------------------- SGLang command building


SECRET = "sk-test-7f3a9c1e"


def test_sglang_commands_one_per_gpu(monkeypatch):
    monkeypatch.setenv("MY_KEY", SECRET)
    cmds = build_sglang_commands(
        "/models/Qwen3.6-27B",
        num_servers=3,
        gpu_ids=[2, 4, 6],
        port_base=31000,
        max_running_requests=40,
        max_mamba_cache_size=200,
        mem_fraction_static=0.85,
        context_length=32768,
        api_key_env="MY_KEY",
        extra_args=("--enable-metrics",),
        python="/venv/bin/python",
    )
    assert [c.env for c in cmds] == [{"CUDA_VISIBLE_DEVICES": g} for g in ("2", "4", "6")]
    assert [c.port for c in cmds] == [31000, 31001, 31002]
    assert [c.base_url for c in cmds] == [f"http://127.0.0.1:{p}/v1" for p in (31000, 31001, 31002)]
    assert list(cmds[1].argv) == [
        "/venv/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/Qwen3.6-27B",
        "--tp-size",
        "1",
        "--max-running-requests",
        "40",
        "--max-mamba-cache-size",
        "200",
        "--mem-fraction-static",
        "0.85",
        "--context-length",
        "32768",
        "--reasoning-parser",
        "qwen3",
        "--host",
        "127.0.0.1",
        "--port",
        "31001",
        "--enable-metrics",
    ]
    for c in cmds:
        assert SECRET not in " ".join(c.argv) and SECRET not in c.redacted() and SECRET not in repr(c)
        assert "api-key: $MY_KEY" in c.redacted() and "--api-key" not in c.redacted()
        launched = c.launch_argv("/private/key.yaml")  # the key goes in the file, never on the command line
        assert launched[-2:] == ["--config", "/private/key.yaml"] and launched[:-2] == list(c.argv)


def test_sglang_commands_tensor_parallel_groups_and_defaults():
    cmds = build_sglang_commands("/m", num_servers=2, tp_size=2, reasoning_parser=None, max_running_requests=None)
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in cmds] == ["0,1", "2,3"]
    argv = list(cmds[0].argv)
    assert argv[argv.index("--tp-size") + 1] == "2"
    for absent in ("--reasoning-parser", "--max-running-requests", "--max-mamba-cache-size", "--api-key"):
        assert absent not in argv
    assert cmds[0].launch_argv() == argv  # no key named: nothing appended
    with pytest.raises(ValueError):
        build_sglang_commands("/m", num_servers=2, gpu_ids=[0])
    with pytest.raises(ValueError):
        build_sglang_commands("/m", num_servers=2, gpu_ids=[1, 1])


def test_missing_api_key_variable_is_an_error(monkeypatch, tmp_path):
    from dflash_assets.generation.servers.sglang_servers import SGLangServers

    monkeypatch.delenv("ABSENT_KEY", raising=False)
    (cmd,) = build_sglang_commands("/m", api_key_env="ABSENT_KEY", port_base=free_port())
    with pytest.raises(ValueError, match="ABSENT_KEY"):
        cmd.launch_argv()
    with pytest.raises(KeyError, match="ABSENT_KEY"), SGLangServers([cmd], tmp_path / "logs"):
        pass


def test_router_command():
    cmd = build_router_command(
        "/m", num_servers=4, port=30000, worker_port_base=32000, max_running_requests=40, python="py"
    )
    argv = list(cmd.argv)
    assert argv[:3] == ["py", "-m", "sglang_router.launch_server"]
    assert argv[argv.index("--dp-size") + 1] == "4"
    assert argv[argv.index("--port") + 1] == "30000"
    assert argv[argv.index("--router-dp-worker-base-port") + 1] == "32000"
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert cmd.base_url == "http://127.0.0.1:30000/v1"
    assert shlex.split(cmd.redacted()) == ["CUDA_VISIBLE_DEVICES=0,1,2,3", *argv]


def test_resource_sglang_mode_builds_commands_without_key_value():
    r = InferenceServerResource(
        mode="sglang", model_path="/m", num_servers=2, gpu_ids=[0, 1], max_mamba_cache_size=200, api_key=SECRET
    )
    cmds = r.sglang_commands()
    assert len(cmds) == 2 and all(c.api_key_env == "DFLASH_SERVER_API_KEY" for c in cmds)
    assert all(SECRET not in " ".join(c.argv) for c in cmds)
    assert cmds[0].argv[cmds[0].argv.index("--max-running-requests") + 1] == "40"
    assert r.tokenizer_path().as_posix() == "/m"
    router = InferenceServerResource(mode="sglang", model_path="/m", num_servers=2, use_router=True)
    routed = router.sglang_commands()
    assert len(routed) == 1 and "sglang_router.launch_server" in routed[0].argv
    # the router runs from SGLang's own environment (sglang-router is pinned there), not the project's interpreter
    sglang_python = router.sglang_environment().directory() / "bin" / "python"
    assert isinstance(routed[0], LaunchCommand) and routed[0].argv[0] == str(sglang_python) != sys.executable


# ---------------------------------------------------------------- resource modes


def test_resource_external_mode_yields_given_urls(local_server, tmp_path):
    r = InferenceServerResource(
        mode="external",
        base_urls=[local_server.base_url],
        served_model_name=local_server.model_name,
        api_key=SECRET,
        external_tokenizer_path="/tok",
    )
    with r.serve(tmp_path) as pool:
        assert pool == ServerPool([local_server.base_url], local_server.model_name, SECRET, 40, "openai")
        assert SECRET not in repr(pool)
        assert pool.headers() == {"Authorization": f"Bearer {SECRET}"}
    assert r.tokenizer_path().as_posix() == "/tok"


def test_resource_external_mode_probe_fails_on_dead_url(tmp_path):
    from dflash_assets.generation.processes.ports import free_port

    port = free_port()
    r = InferenceServerResource(
        mode="external", base_urls=[f"http://127.0.0.1:{port}/v1"], served_model_name="m", startup_timeout_s=5
    )
    # issue 16: the error names the URL and what to try (was a bare httpx "Connection refused")
    with (
        pytest.raises(
            RuntimeError, match=rf"probe POST http://127.0.0.1:{port}/v1/chat/completions failed: ConnectError.*curl"
        ),
        r.serve(tmp_path),
    ):
        pass


def test_resource_defaults():
    local = InferenceServerResource()
    assert local.mode == "local" and local.effective_max_running_requests() == 16
    assert InferenceServerResource(mode="sglang").effective_max_running_requests() == 40
    with pytest.raises(ValueError):
        InferenceServerResource(mode="external").tokenizer_path()


def test_free_port_block_skips_a_block_with_a_taken_port_and_stays_below_the_ephemeral_range(monkeypatch):
    """The simulator tests once drew port_base with port 0 and got EADDRINUSE on port_base + 1 (an
    outgoing connection's ephemeral port): a block must be free as a whole, below 32768."""
    import socket

    from dflash_assets.generation.processes import ports
    from dflash_assets.generation.processes.ports import free_port_block

    # the binding rule alone: a draw's claim on the machine (test_server_trust) would make base unavailable below
    monkeypatch.setattr(ports, "claim_ports", lambda block, ttl_s=0.0: True)

    base = free_port_block(3)
    assert base >= 20000 and base + 3 <= 32000
    for port in range(base, base + 3):  # every port of the block binds
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        # the only block in [base, base + 2) of 2 ports holds the taken one: no block is offered
        with pytest.raises(RuntimeError, match="no 2 consecutive free ports"):
            free_port_block(2, low=base, high=base + 3)
        assert free_port_block(1, low=base, high=base + 2) == base


def test_sglang_requests_ask_for_the_models_token_ids_and_others_do_not():
    """SGLang's chat endpoint returns ``choices[0].response_token_ids`` when asked (``return_token_ids``, its
    ChatCompletionRequest; vLLM: ``token_ids``): the model's own tokens, which tokenization trains on and a
    lowered cap cuts exactly. transformers serve rejects unknown fields with 422, so it is not asked."""
    from dflash_assets.generation.api.replies import parse_chat_completion

    body = {"model": "m", "messages": [], "top_k": 20}
    assert ServerPool(["http://x/v1"], "m", None, 1, "sglang").adapt_body(body)["return_token_ids"] is True
    assert "return_token_ids" not in ServerPool(["http://x/v1"], "m", None, 1, "transformers").adapt_body(body)
    assert "return_token_ids" not in ServerPool(["http://x/v1"], "m", None, 1, "openai").adapt_body(body)
    reply = {
        "choices": [{"message": {"content": "hi"}, "finish_reason": "stop", "response_token_ids": [5, 6, 2]}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3},
    }
    assert parse_chat_completion(reply)["output_token_ids"] == [5, 6, 2]
