"""Ctrl-C / SIGTERM stop a generation that is waiting on the server (found by a new-user trial: under
Dagster, `python -m dflash_assets run` ignored both during completions, because the interrupt Dagster's
signal handler raises was dropped inside uvloop's signal callback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import signal, sys, threading, time
    sys.path.insert(0, {tests!r})
    from dflash_simulators.behaviours import Hang
    from dflash_simulators.stand_in_server import FakeServer
    from dflash_assets.generation.client.completion_client import CompletionClient

    class Interrupted(Exception):  # what Dagster's handler raises (DagsterExecutionInterruptedError)
        pass

    def raise_interrupt(signum, frame):
        raise Interrupted(f"signal {{signum}}")

    if {install_handler!r}:
        signal.signal(signal.SIGINT, raise_interrupt)
        signal.signal(signal.SIGTERM, raise_interrupt)
    with FakeServer(Hang()) as server:
        def announce():
            while server.requests_received < 2:
                time.sleep(0.05)
            print("IN_FLIGHT", flush=True)
        threading.Thread(target=announce, daemon=True).start()
        client = CompletionClient([server.url], concurrency=2)
        body = {{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 8}}
        try:
            client.generate_blocking(((i, dict(body)) for i in range(4)), lambda r: None)
        except Interrupted as exc:
            print("INTERRUPTED", exc, flush=True)
            sys.exit(3)
        print("FINISHED", flush=True)
""")


def _start(tmp_path: Path, install_handler: bool) -> subprocess.Popen:
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), install_handler=install_handler))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    line = ""
    while "IN_FLIGHT" not in line:
        assert time.monotonic() < deadline and proc.poll() is None, "requests never reached the server"
        line = proc.stdout.readline()
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_raising_signal_handler_interrupts_generation(tmp_path, sig):
    proc = _start(tmp_path, install_handler=True)
    os.kill(proc.pid, sig)
    try:
        out, _ = proc.communicate(timeout=20)  # before the fix: hung until the 1-hour Hang ended
    finally:
        proc.kill()  # never leave the child behind when the assertion fails
    assert proc.returncode == 3, out
    assert f"INTERRUPTED signal {int(sig)}" in out


def test_sigterm_with_the_default_handler_terminates(tmp_path):
    proc = _start(tmp_path, install_handler=False)
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM


def test_run_loop_stops_on_an_interrupted_run_but_not_on_a_failed_one():
    """`run` went on to the next partition after Ctrl-C: the interrupted run was just another failed run."""
    import dagster as dg
    from dagster._core.errors import DagsterExecutionInterruptedError

    from dflash_assets.app.main_job import was_interrupted

    @dg.asset
    def interrupted_asset():
        raise DagsterExecutionInterruptedError()

    @dg.asset
    def failing_asset():
        raise ValueError("bad row")

    with dg.instance_for_test() as instance:
        assert was_interrupted(dg.materialize([interrupted_asset], instance=instance, raise_on_error=False))
        assert not was_interrupted(dg.materialize([failing_asset], instance=instance, raise_on_error=False))
