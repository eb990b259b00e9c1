"""A real Redis server for tests: Debian's ``redis-server`` on 127.0.0.1, a free port, no persistence, its own
process group and working directory (removed afterwards); never the system's service."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path


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
