"""Several nodes on one machine, for tests and benches: a real Redis broker and real Celery node workers.

:func:`running_redis`: Debian's ``redis-server`` on 127.0.0.1, a free port, no persistence, its own process group
and working directory (removed afterwards); never the system's service. :class:`NodeWorker`: one node's Celery
worker (``celery -A dflash_assets.orchestration.cluster worker``) with that node's environment (its
``DFLASH_CONFIG``: its own simulated servers), as ``docs/scale.md`` starts one on each node. :func:`start_daemon`
and :func:`start_schedule`: the launching node's ``dagster-daemon run`` and ``dagster schedule start``, the
commands a user types. :func:`stop_tree` / :func:`kill_tree`: end a process and everything below it (a node's
worker with its pool process and the servers its step started, in sessions of their own). Used by
``dflash_assets_tests/test_cluster_celery.py``, ``dflash_assets_tests/test_cluster_daemon.py`` and
``bench/bench_cluster.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from dflash_assets.orchestration.cluster import CELERY_QUEUE

BIN = Path(sys.executable).parent


def redis_missing() -> str | None:
    """Why no server can start here (a skip reason), or None."""
    if not shutil.which("redis-server"):
        return "Redis is not installed (Debian: apt-get install redis-server; .ci/run installs it)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def running_redis(timeout_s: float = 30.0) -> Iterator[str]:
    """Start ``redis-server`` and yield its URL (``redis://127.0.0.1:PORT/0``); stop it (SIGTERM, then SIGKILL
    of its process group) and remove its directory when the block ends.

    Raises:
        RuntimeError: the server exited or did not answer PING within ``timeout_s`` (its log in the message).
    """
    directory = Path(tempfile.mkdtemp(prefix="dflash-redis-", dir="/tmp"))
    port = _free_port()
    log = directory / "redis.log"
    argv = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1"]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(directory), "--logfile", str(log), "--daemonize", "no"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not _answers_ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                text = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server did not start on port {port} (exit {proc.poll()}): {text}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        shutil.rmtree(directory, ignore_errors=True)


def launch_completions(name: str, partitions: list[str], env: dict[str, str], folder: Path) -> subprocess.Popen:
    """``dagster asset materialize`` of completions (``partitions``: ``--partition PK`` or ``--partition-range
    A...B``) from a launching node's shell (``env``), in its own process group, run in ``folder``; its output in
    ``folder/launch-<name>.log``."""
    argv = [str(BIN / "dagster"), "asset", "materialize", "-m", "dflash_assets.definitions", "--select", "completions"]
    with open(folder / f"launch-{name}.log", "wb") as log:
        return subprocess.Popen(
            [*argv, *partitions], env=env, cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def kill_group(proc: subprocess.Popen | None) -> None:
    """kill -9 of a process's group if it is still running (nothing for None), then reap it."""
    if proc is not None and proc.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def start_daemon(env: dict[str, str], folder: Path) -> subprocess.Popen:
    """``dagster-daemon run -m dflash_assets.definitions`` (scheduler, run queue, run monitoring, ...) with the
    launching node's environment ``env`` (its ``DAGSTER_HOME``: the shared instance), in its own process group, run
    in ``folder``; its output in ``folder/daemon.log``. Stop it with :func:`stop_tree` (its code server and the run
    processes it launched are below it)."""
    argv = [str(BIN / "dagster-daemon"), "run", "-m", "dflash_assets.definitions"]
    with open(folder / "daemon.log", "wb") as log:
        return subprocess.Popen(argv, env=env, cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_schedule(name: str, env: dict[str, str], folder: Path, timeout_s: float = 300.0) -> None:
    """``dagster schedule start NAME -m dflash_assets.definitions``: turn schedule ``name`` on in the instance of
    ``env``'s ``DAGSTER_HOME`` (the daemon then ticks it), run in ``folder``.

    Raises:
        RuntimeError: the command failed (its output in the message).
        subprocess.TimeoutExpired: it ran over ``timeout_s``.
    """
    argv = [str(BIN / "dagster"), "schedule", "start", name, "-m", "dflash_assets.definitions"]
    out = subprocess.run(argv, env=env, cwd=folder, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(
            f"dagster schedule start {name} failed ({out.returncode}): {out.stdout[-2000:]}{out.stderr[-3000:]}"
        )


def stop_tree(proc: subprocess.Popen | None, grace_s: float = 20.0) -> None:
    """SIGTERM to a process's group (nothing for None or an ended process), SIGKILL after ``grace_s`` to the group
    and to every process that was below it (children in sessions of their own included), then reap it."""
    if proc is None:
        return
    below = descendants(proc.pid) if proc.poll() is None else []
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in below:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(10)


def kill_tree(proc: subprocess.Popen) -> None:
    """kill -9 of a process and everything below it at once (a node lost: its worker, the worker's pool process,
    the servers a step started), then reap it."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(10)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first found first."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


class NodeWorker:
    """One node's Celery worker (``celery -A dflash_assets.orchestration.cluster worker -Q dagster -c 1``), named
    ``node``, in its own process group, its output in ``log``; :meth:`stop` ends it and everything below it.

    ``env``: the node's environment (``DFLASH_CELERY_BROKER``, ``DAGSTER_HOME``, ``DFLASH_CONFIG``, ...);
    ``cwd``: its working directory (default: the current one).
    """

    def __init__(self, node: str, env: dict[str, str], log: Path, cwd: Path | None = None) -> None:
        self.node, self.log = node, log
        argv = [str(BIN / "celery"), "-A", "dflash_assets.orchestration.cluster", "worker", "-Q", CELERY_QUEUE]
        argv += ["-c", "1", "--prefetch-multiplier=1", "-n", f"{node}@%h", "-l", "INFO"]
        argv += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        """Wait until the worker logs `` ready.``.

        Raises:
            RuntimeError: it exited or was not ready within ``timeout_s`` (the end of its log in the message).
        """
        deadline = time.monotonic() + timeout_s
        while " ready." not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.node} not ready (exit {self.proc.poll()}): {self.tail()}")
            time.sleep(0.2)

    def tail(self, n: int = 3000) -> str:
        """The last ``n`` characters of the worker's log."""
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        """SIGTERM to the worker's group (Celery's warm shutdown), SIGKILL after 20 s to the group and to every
        process that was below the worker (servers a step started run in sessions of their own): :func:`stop_tree`."""
        stop_tree(self.proc)

    def kill(self) -> None:
        """kill -9 of the worker and everything under it (its node lost): :func:`kill_tree`."""
        kill_tree(self.proc)
