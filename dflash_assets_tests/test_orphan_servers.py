"""Inference servers do not outlive a launcher killed with SIGKILL (real processes, real kills).

A launcher child process starts a server the project's way, prints its pid and port, and sleeps;
the test kills it with SIGKILL. With the parent-death signal the server must exit by itself; without
it the server survives and :func:`reap_orphaned_servers` must stop it (whole process group), drop its
pidfile and free its port, sparing a server whose launcher lives and a recycled pid.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from dflash_assets.generation.processes.ports import free_port
from dflash_assets.generation.processes.sessions import stop_process_group
from dflash_assets.generation.servers.registry import (
    REGISTRY_ENV,
    orphan_message,
    reap_orphaned_servers,
    start_process,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux")

# A stand-in server: forks a child into its own process group (as SGLang's workers are), then serves HTTP.
STANDIN = (
    "import http.server, subprocess, sys\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()\n"
)

LAUNCHER = """
import json, os, sys, time
from pathlib import Path
mode, pdeath, log = sys.argv[1], sys.argv[2] == "1", Path(sys.argv[3])
if mode == "transformers":
    from dflash_assets.generation.engines.local_model import ensure_local_model
    from dflash_assets.generation.servers.transformers_server import LocalTransformersServer
    server = LocalTransformersServer(ensure_local_model(), log_path=log, parent_death_signal=pdeath,
                                     startup_timeout_s=120).__enter__()
    pid, port = server._proc.pid, server.port
    import threading, httpx
    # a generation in flight when the launcher dies: SIGTERM would make uvicorn wait for it (~100 s)
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 2000}
    threading.Thread(target=lambda: httpx.post(server.base_url + "/chat/completions", json=body, timeout=600),
                     daemon=True).start()
    time.sleep(1.0)
else:
    import httpx
    from dflash_assets.generation.processes.ports import free_port
    from dflash_assets.generation.servers.registry import start_process
    port = free_port()
    proc = start_process([sys.executable, "-c", sys.argv[4], str(port)], dict(os.environ), log, port=port,
                          label="stand-in", parent_death_signal=pdeath)
    for _ in range(200):
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    pid = proc.pid
print(json.dumps({"pid": pid, "port": port, "launcher": os.getpid()}), flush=True)
time.sleep(600)
"""


def _launch(
    mode: str, pdeath: bool, tmp_path: Path, registry: Path, timeout_s: float = 120
) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, REGISTRY_ENV: str(registry)}
    argv = [sys.executable, "-c", LAUNCHER, mode, "1" if pdeath else "0", str(tmp_path / f"{mode}.log"), STANDIN]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, cwd=Path(__file__).resolve().parent.parent)
    ready, _, _ = select.select([launcher.stdout], [], [], timeout_s)
    if not ready:
        launcher.kill()
        pytest.fail(f"launcher did not start a {mode} server in {timeout_s} s")
    line = launcher.stdout.readline()
    assert line, f"launcher exited with {launcher.wait()}"
    return launcher, json.loads(line)


def _group(pgid: int) -> list[int]:
    """Processes in process group ``pgid`` with a thread that is not a zombie, as ``ps -L`` reports them
    (a killed multi-threaded process shows a zombie leader while its other threads still exit)."""
    out = subprocess.run(
        ["ps", "-e", "-L", "-o", "pid=,pgid=,stat="], capture_output=True, text=True, check=True
    ).stdout
    return sorted(
        {
            int(pid)
            for pid, group, stat in (line.split() for line in out.splitlines())
            if int(group) == pgid and not stat.startswith("Z")
        }
    )


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _kill9(launcher: subprocess.Popen) -> None:
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=10)
    launcher.stdout.close()


def _kill_group(pgid: int) -> None:
    """Test cleanup: whatever a failed assertion left running."""
    if _group(pgid):
        os.killpg(pgid, signal.SIGKILL)


def _start_time(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[19])  # field 22 of proc(5)


def test_parent_death_signal_stops_transformers_serve(tmp_path):
    registry = tmp_path / "registry"
    launcher, info = _launch("transformers", True, tmp_path, registry)
    pid, port = info["pid"], info["port"]
    (pidfile,) = registry.glob("*.json")
    entry = json.loads(pidfile.read_text())
    assert (entry["pid"], entry["pgid"], entry["port"], entry["owner_pid"]) == (pid, pid, port, info["launcher"])
    assert entry["start_time"] == _start_time(pid) and entry["label"] == "transformers serve"
    assert _group(pid) == [pid] and _port_open(port)  # one process (no workers to outlive it)

    try:
        _kill9(launcher)
        assert _wait_until(lambda: not _group(pid), 10.0), f"still running: {_group(pid)}"
        assert not _port_open(port)
        # the pidfile stays (nobody cleaned up); the reaper finds nothing alive, stops nothing, drops the file
        assert pidfile.exists()
        assert reap_orphaned_servers(registry) == []
        assert not pidfile.exists()
    finally:
        _kill_group(pid)


def test_reaper_stops_orphans_only(tmp_path):
    registry = tmp_path / "registry"
    launcher, info = _launch("standin", False, tmp_path, registry)
    pid, port = info["pid"], info["port"]
    assert len(_group(pid)) == 2  # the server and its child

    # a server whose launcher (this test) lives
    live_port = free_port()
    live = start_process(
        [sys.executable, "-c", STANDIN, str(live_port)],
        dict(os.environ),
        tmp_path / "live.log",
        port=live_port,
        label="live",
        registry_dir=registry,
    )
    # a process holding a registered pid but started at another time (a recycled pid)
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    decoy_file = registry / "decoy.json"
    try:
        orphan_file = next(p for p in registry.glob("*.json") if json.loads(p.read_text())["pid"] == pid)
        decoy_entry = {
            **json.loads(orphan_file.read_text()),
            "pid": decoy.pid,
            "pgid": decoy.pid,
            "start_time": _start_time(decoy.pid) - 1,
            "port": None,
        }
        decoy_file.write_text(json.dumps(decoy_entry))

        _kill9(launcher)
        time.sleep(1.0)
        assert len(_group(pid)) == 2, "without the parent-death signal the server outlives its launcher"
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200

        stopped = reap_orphaned_servers(registry, grace_s=5.0)
        assert [(e["pid"], e["port"]) for e in stopped] == [(pid, port)]
        assert pid in stopped[0]["killed_pids"] and len(stopped[0]["killed_pids"]) == 2
        assert f"pid {pid}" in orphan_message(stopped[0]) and f"port {port}" in orphan_message(stopped[0])
        assert _group(pid) == []
        assert not orphan_file.exists()
        assert not _port_open(port)
        with socket.socket() as s:  # free to listen on again (REUSEADDR: our GET left a TIME_WAIT)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
        assert not decoy_file.exists() and decoy.poll() is None  # stale file dropped, process spared
        assert live.poll() is None and live.registry_file.exists()
        assert reap_orphaned_servers(registry) == []  # idempotent
    finally:
        _kill_group(pid)
        decoy.kill()
        decoy.wait()
        live_file = live.registry_file
        stop_process_group(live, grace_s=5.0)
    assert not live_file.exists() and _group(live.pid) == []


def test_server_started_from_a_worker_thread_outlives_the_thread(tmp_path):
    # PR_SET_PDEATHSIG fires when the forking *thread* exits; servers are forked from a process-long thread
    port = free_port()
    started = {}

    def start() -> None:
        started["proc"] = start_process(
            [sys.executable, "-c", STANDIN, str(port)],
            dict(os.environ),
            tmp_path / "thread.log",
            port=port,
            registry_dir=tmp_path / "registry",
        )

    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
    proc = started["proc"]
    pidfile = proc.registry_file
    try:
        assert _wait_until(lambda: _port_open(port), 10.0)
        time.sleep(0.5)
        assert proc.poll() is None
    finally:
        stop_process_group(proc, grace_s=5.0)
    assert proc.registry_file is None and not pidfile.exists()


def test_inference_resource_reaps_before_serving(tmp_path, monkeypatch):
    # a UI- or daemon-launched run stops what a killed run left before it starts its own servers
    from dflash_assets.stages.resources.inference import InferenceServerResource

    registry = tmp_path / "registry"
    launcher, info = _launch("standin", False, tmp_path, registry)
    pid = info["pid"]
    try:
        _kill9(launcher)
        assert _group(pid)
        monkeypatch.setenv(REGISTRY_ENV, str(registry))
        dead_url = f"http://127.0.0.1:{free_port()}/v1"
        resource = InferenceServerResource(
            mode="external", base_urls=[dead_url], served_model_name="m", startup_timeout_s=2
        )
        # the probe of a dead external URL is an error naming it (no server answers there)
        with pytest.raises(RuntimeError, match=dead_url.removesuffix("/v1")), resource.serve(tmp_path / "logs"):
            pass
        assert _group(pid) == [] and list(registry.glob("*.json")) == []
    finally:
        _kill_group(pid)


# ---------------------------------------------------------------- the drafter's torchrun (issue 27)

TREE = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a worker, as torchrun's
print(f"agent {os.getpid()} up, worker {child.pid}", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["SIGINT to this process", "the line handler fails"])
def test_an_interrupted_torchrun_launch_stops_its_whole_process_group(how):
    """The drafter's torchrun was started without its own process group and not stopped when the step was
    interrupted: it trained on beside the next run. run_streaming (what _run_torchrun uses) stops the
    launched process and its children whatever ends the wait."""
    from dflash_assets.generation.processes.proc_info import session_members
    from dflash_assets.generation.processes.sessions import run_streaming

    seen: list[str] = []

    def on_line(line: str) -> None:
        seen.append(line)
        if how == "the line handler fails":
            raise RuntimeError("step failed")
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C / Dagster's interrupt

    # Python's own Ctrl-C handler, whatever an earlier test in this process left installed (seen in the whole
    # suite: the SIGINT was swallowed and the launch ran to its end)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt if how.startswith("SIGINT") else RuntimeError):
            run_streaming([sys.executable, "-c", TREE], on_line, grace_s=5.0)
    finally:
        signal.signal(signal.SIGINT, previous)
    agent, worker = int(seen[0].split()[1]), int(seen[0].rsplit(" ", 1)[1])
    assert proc_gone(agent) and proc_gone(worker), f"agent {agent} or worker {worker} still runs"
    assert session_members(agent) == []  # nothing left in the launched session
    print(f"{how}: the launched tree was stopped {time.monotonic() - started:.2f} s after start")


def proc_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_run_streaming_returns_the_exit_code_and_every_line():
    from dflash_assets.generation.processes.sessions import run_streaming

    lines: list[str] = []
    code = run_streaming(
        [sys.executable, "-c", "import sys; print('a'); print('b', file=sys.stderr); sys.exit(3)"], lines.append
    )
    assert code == 3 and sorted(lines) == ["a", "b"]
