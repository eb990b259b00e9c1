"""A real PostgreSQL server for tests: Debian's ``postgresql`` package, started in a temp directory.

PostgreSQL refuses to run as root, so under root (CI) ``initdb`` and ``pg_ctl`` run as the package's
``postgres`` user (``runuser``), else as the current user. Trust authentication on 127.0.0.1 only; the server
listens on a free port and its socket lives in the data directory, so tests never meet a system cluster.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def postgres_missing() -> str | None:
    """Why no server can start here (a skip reason), or None."""
    if not (_binary("initdb") and _binary("pg_ctl")):
        return "PostgreSQL is not installed (Debian: apt-get install postgresql; .ci/run installs it)"
    if os.geteuid() == 0 and not shutil.which("runuser"):
        return "running as root without runuser: PostgreSQL cannot run as root"
    return None


def _as_server_user(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_postgres(database: str = "dagster") -> Iterator[str]:
    """Start a server with its data in a new directory under /tmp (not pytest's, which only root may enter),
    removed afterwards; yields a ``postgresql+psycopg2://`` URL of ``database``.

    Raises:
        subprocess.CalledProcessError: initdb, the start or createdb failed (their output in the exception).
    """
    directory = Path(tempfile.mkdtemp(prefix="dflash-pg-", dir="/tmp"))
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres", "postgres")
    data = directory / "pgdata"
    port = _free_port()
    run = {"check": True, "capture_output": True, "text": True, "timeout": 120}
    try:
        subprocess.run(_as_server_user([_binary("initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"]), **run)
        options = f"-p {port} -k {data} -c listen_addresses=127.0.0.1 -c fsync=off"
        start = [_binary("pg_ctl"), "-D", str(data), "-l", str(directory / "server.log"), "-o", options, "-w", "start"]
        subprocess.run(_as_server_user(start), **run)
        try:
            createdb = [_binary("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", database]
            subprocess.run(_as_server_user(createdb), **run)
            yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/{database}"
        finally:
            stop = [_binary("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]
            subprocess.run(_as_server_user(stop), capture_output=True, timeout=120)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
