"""Engine environments (issue 40 findings 2 and 7, and the suspected items on them): an environment proves itself
before it is reused, a broken one is made again saying why, failed and old ones are removed, a kill -9 while one
is made leaves no pip holding the lock and the next use resumes it, credentials in requirement URLs never reach a
log. Small specs through the real code path (real venvs, real pip, real processes); each "run" is a process of
its own, as each `python -m dflash_assets run` is."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_assets.generation.engines.environments import EngineEnvironment, EngineEnvironmentError
from dflash_assets.generation.processes.proc_info import is_running

ROOT = Path(__file__).resolve().parents[1]
#: a new run's variables: the project importable, nothing else on PYTHONPATH (it is not the environment's)
RUN_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

_RUN = """
import json, sys
from pathlib import Path
from dflash_assets.generation.engines.environments import EngineEnvironment
spec, root = json.loads(sys.argv[1]), Path(sys.argv[2])
env = EngineEnvironment(spec["name"], tuple(spec["requirements"]), import_check=spec["import_check"])
print("PYTHON", env.ensure(lambda line: print("LINE", line, flush=True), root=root), flush=True)
"""


def ensure_in_a_new_process(spec: dict, root: Path, timeout: float = 180) -> tuple[str, list[str]]:
    """``EngineEnvironment(**spec).ensure(root=root)`` in a process of its own (a new run): its interpreter path
    and log lines."""
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, json.dumps(spec), str(root)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=RUN_ENV,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line[5:] for line in proc.stdout.splitlines() if line.startswith("LINE ")]
    (python,) = [line[7:] for line in proc.stdout.splitlines() if line.startswith("PYTHON ")]
    return python, lines


def imports(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def test_a_broken_environment_is_proven_and_made_again_saying_why(tmp_path):
    """Finding 2: an environment was reused on the word of ``ready.json`` alone: with a package deleted inside it,
    or its ``bin/python``, every later run failed at server start and never repaired it."""
    spec = {"name": "proof", "requirements": [], "import_check": "import pip"}
    python, lines = ensure_in_a_new_process(spec, tmp_path)
    target = Path(python).parent.parent
    assert imports(python, "pip") and (target / "ready.json").is_file()
    assert ensure_in_a_new_process(spec, tmp_path)[1] == [f"engine environment proof: reusing {target}"]

    site = next((target / "lib").glob("python3*/site-packages"))
    for package in site.glob("pip*"):  # a package deleted inside the environment
        subprocess.run(["rm", "-rf", str(package)], check=True)
    python, lines = ensure_in_a_new_process(spec, tmp_path)
    assert imports(python, "pip"), lines
    assert f"engine environment proof: {target} is broken (`import pip` fails: " in lines[0]
    assert "No module named 'pip'" in lines[0] and lines[-1].startswith("engine environment proof: ready in")

    Path(python).unlink()  # its interpreter deleted
    python, lines = ensure_in_a_new_process(spec, tmp_path)
    assert Path(python).exists() and imports(python, "pip"), lines
    assert f"is broken (its interpreter {python} is missing): making it again" in lines[0]

    ready = json.loads((target / "ready.json").read_text())
    assert len(ready["spec_hash"]) == 12
    (target / "ready.json").write_text(json.dumps({**ready, "spec_hash": "0123456789ab"}))  # another spec's
    python, lines = ensure_in_a_new_process(spec, tmp_path)
    assert f"is broken (ready.json records spec 0123456789ab, not {ready['spec_hash']})" in lines[0]
    assert json.loads((target / "ready.json").read_text())["spec_hash"] == ready["spec_hash"]


def test_a_failed_install_is_removed_and_old_environments_too(tmp_path):
    """Suspected: a failed install left gigabytes behind, and environments of an older spec were never removed.
    A failed one is removed at once (its log stays); one of another spec unused for a week is removed by the
    next use of its name, never one used lately or one whose lock a process holds."""
    engines = tmp_path / "engines"
    bad = EngineEnvironment("bad", ("dflash-assets-no-such-package==0.0.0",), extra_pip_args=("--no-index",))
    with pytest.raises(EngineEnvironmentError, match=r"pip install failed .*was removed .*install\.log"):
        bad.ensure(lambda line: None, root=tmp_path)
    assert not bad.directory(tmp_path).exists()
    assert "dflash-assets-no-such-package" in bad.directory(tmp_path).with_suffix(".install.log").read_text()

    week_ago = time.time() - 8 * 24 * 3600
    old, recent, busy = (engines / f"plain-{h * 12}" for h in "abc")
    for directory in (old, recent, busy):
        (directory / "lib").mkdir(parents=True)
        (directory / "lib" / "big").write_bytes(b"x" * 2_000_000)
        (directory.with_name(directory.name + ".lock")).write_text("")
    for directory in (old, busy):
        os.utime(directory.with_name(directory.name + ".lock"), (week_ago, week_ago))
    other_name = engines / f"vllm-{'d' * 12}"  # another engine's: never this name's to remove
    other_name.mkdir()
    os.utime(other_name, (week_ago, week_ago))
    lines: list[str] = []
    env = EngineEnvironment("plain", (), import_check="import json")
    with open(busy.with_name(busy.name + ".lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # in use by another process (another open file: flock excludes it too)
        env.ensure(lines.append, root=tmp_path)
    assert not old.exists() and recent.exists() and busy.exists() and other_name.exists()
    (removed,) = [line for line in lines if "removed" in line]
    assert f"engine environment plain: removed {old} (0.0 GB), unused since " in removed


def test_credentials_in_requirement_urls_never_reach_a_log(tmp_path):
    """Suspected: credentials in ``vllm.packages`` (an index URL, a direct wheel URL) were printed as given to the
    log line and to ``install.log`` (the step's command line). Now each is ``***`` there, in the error and in
    ``ready.json``, while pip still gets them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens, pip fails fast
    requirements = (
        f"--index-url=http://dflash:s3cr3t-pw@127.0.0.1:{port}/simple",
        f"nosuch @ http://tok9f8e7d6c@127.0.0.1:{port}/nosuch-1.0-py3-none-any.whl",
    )
    env = EngineEnvironment("cred", requirements, extra_pip_args=("--retries", "0", "--timeout", "2"))
    lines: list[str] = []
    with pytest.raises(EngineEnvironmentError) as err:
        env.ensure(lines.append, root=tmp_path)
    install_log = env.directory(tmp_path).with_suffix(".install.log").read_text()
    assert f"127.0.0.1:{port}" in install_log and "--index-url" in install_log  # the step was logged
    for secret in ("s3cr3t-pw", "tok9f8e7d6c"):
        assert secret not in install_log and secret not in str(err.value) and secret not in " ".join(lines)
    assert "http://dflash:***@127.0.0.1" in " ".join(lines) and "http://***@127.0.0.1" in install_log


# ------------------------------------------------------------------- kill -9 while an environment is made

BACKEND = r'''
"""A PEP 517 backend in the project itself: its first build stalls (the install a kill -9 cuts off)."""
import base64, hashlib, os, time, zipfile

STALL = {stall!r}


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    if not os.path.exists(STALL):
        with open(STALL, "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(0.2)
    info = "dflash_fake_engine-1.0.dist-info/"
    files = {{
        "dflash_fake_engine.py": b"VALUE = 7\n",
        info + "METADATA": b"Metadata-Version: 2.1\nName: dflash-fake-engine\nVersion: 1.0\n",
        info + "WHEEL": b"Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }}
    record = "".join(
        f"{{p}},sha256={{base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()}},{{len(b)}}\n"
        for p, b in files.items()
    )
    files[info + "RECORD"] = (record + info + "RECORD,,\n").encode()
    name = "dflash_fake_engine-1.0-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as whl:
        for p, b in files.items():
            whl.writestr(p, b)
    return name
'''


def stalling_project(tmp_path: Path) -> tuple[Path, Path]:
    """A local project whose first wheel build stalls, writing its pid to the returned file first."""
    project, stall = tmp_path / "fake_engine", tmp_path / "build.pid"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
        '[project]\nname = "dflash-fake-engine"\nversion = "1.0"\n'
    )
    (project / "backend.py").write_text(BACKEND.format(stall=str(stall)))
    return project, stall


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_kill_9_while_an_environment_is_made_leaves_no_orphan_holding_the_lock(tmp_path):
    """Finding 7: a run killed (kill -9) while it made an environment left its pip running and holding the
    environment's lock; the next run stalled on that lock in silence until the orphan ended, then installed
    again from scratch. Now the step dies with the run (its leader at once; what it started is stopped by
    the next run, which says so), the lock is free, and the next run resumes the half-made environment."""
    project, stall = stalling_project(tmp_path)
    root = tmp_path / "cache"
    spec = {
        "name": "fake",
        "requirements": [f"dflash-fake-engine @ {project.as_uri()}"],
        "import_check": "import dflash_fake_engine",
    }
    env = EngineEnvironment(spec["name"], tuple(spec["requirements"]), import_check=spec["import_check"])
    target = env.directory(root)
    first = subprocess.Popen(
        [sys.executable, "-c", _RUN, json.dumps(spec), str(root)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=RUN_ENV,
    )
    builder = None
    try:
        wait_for(lambda: stall.exists() and stall.read_text(), 180, "the wheel build to start")
        builder = int(stall.read_text())
        record = target.with_suffix(".install.json")  # the step's leader, as recorded
        pip = json.loads(record.read_text()) if record.exists() else None
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        if pip is not None:
            wait_for(lambda: not is_running(pip["pid"], pip["start_time"]), 10, "pip to die with its run")
        assert is_running(builder, None)  # what pip started outlives it (orphaned): the next run stops it
        (target / "kept-marker").write_text("")  # a from-scratch install would remove it
        lines: list[str] = []
        started = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _RUN, json.dumps(spec), str(root)],
                capture_output=True,
                text=True,
                timeout=90,
                env=RUN_ENV,
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"the next run stalled for 90 s; it said: {exc.stdout!r}") from None
        lines = [line[5:] for line in proc.stdout.splitlines() if line.startswith("LINE ")]
        assert proc.returncode == 0, proc.stdout + proc.stderr
        took = time.monotonic() - started
    finally:
        first.kill()
        if builder is not None and is_running(builder, None):
            os.kill(builder, signal.SIGKILL)  # (before the fix: the orphan pip then ends)
    assert not is_running(builder, None)  # the orphaned build was stopped, not waited for
    assert "stopped 1 process(es) of an install step that a killed run left running" in lines[0], lines
    assert lines[1] == f"engine environment fake: resuming the install cut off earlier in {target}"
    assert (target / "kept-marker").exists() and imports(str(target / "bin" / "python"), "dflash_fake_engine")
    assert took < 90 and pip is not None, took


def test_a_run_that_fails_early_says_it_waits_for_the_install_and_ctrl_c_stops_it(tmp_path):
    """Suspected and confirmed: ``run`` returning 1 early (here: a prompt file with no usable row) left the
    background install thread unjoined; the process then hung at exit, without a word, for as long as the
    install took. Now it says it waits for the install, and Ctrl-C stops the install's whole process group
    (the next run resumes it) instead of waiting."""
    import queue
    import threading

    project, stall = stalling_project(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "resources": {
                    "storage": {"root": str(tmp_path / "data")},
                    "inference": {
                        "mode": "vllm",
                        "vllm": {"packages": [f"dflash-fake-engine @ {project.as_uri()}"], "remove_packages": []},
                    },
                },
                "ops": {"prompt_corpus": {"config": {"sources": [str(tmp_path / "empty.jsonl")]}}},
            }
        )
    )
    env = {**RUN_ENV, "DAGSTER_HOME": str(tmp_path), "DFLASH_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.Popen(
        [sys.executable, "-m", "dflash_assets", "run", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in run.stdout], daemon=True).start()
    seen: list[str] = []

    def until(text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r} within {timeout} s; output:\n{''.join(seen)}")

    builder = None
    try:
        until("prompt_corpus failed", 300)
        until("waiting for the engine environment's install to finish", 30)
        wait_for(lambda: stall.exists() and stall.read_text(), 180, "the wheel build to start")
        builder = int(stall.read_text())
        run.send_signal(signal.SIGINT)  # Ctrl-C
        run.wait(60)
        until("install stopped; the next run resumes it", 10)
        wait_for(lambda: not is_running(builder, None), 10, "the install's process group to stop")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        if builder is not None and is_running(builder, None):
            os.kill(builder, signal.SIGKILL)
    assert run.returncode != 0


def test_the_wait_line_names_an_import_check_when_the_environment_was_made_before():
    """A fresh user's second run (no work) printed "waiting for the engine environment's install to finish": the
    environment was made, only its import check was running. The line now says which one it waits for."""
    import threading

    from dflash_assets.generation.engines.install import wait_for_installs

    def waiting_line(proving_only: bool) -> list[str]:
        release = threading.Event()
        thread = threading.Thread(target=release.wait)
        thread.proving_only = proving_only
        thread.start()
        lines: list[str] = []
        threading.Timer(0.2, release.set).start()
        wait_for_installs([thread, None], lines.append)
        return lines

    assert waiting_line(True) == ["waiting for the engine environment's import check to finish (it is made; seconds)"]
    assert waiting_line(False)[0].startswith("waiting for the engine environment's install to finish")
