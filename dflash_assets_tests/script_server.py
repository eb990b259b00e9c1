"""A stand-in HTTP server written as a Python script, run in its own process on a free loopback port."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from dflash_assets.generation.processes.ports import free_port


@contextmanager
def script_server(source: str, timeout_s: float = 30.0) -> Iterator[str]:
    """Run ``source`` (a script serving HTTP on the port given as its first argument) and yield its base URL
    once ``GET /health`` answers; killed on exit.

    Raises:
        httpx.TransportError: no answer within ``timeout_s`` seconds.
    """
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", source, str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait()
