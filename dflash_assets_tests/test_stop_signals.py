"""Started with SIGINT ignored (a script's background job), the pipeline's processes and the test suite still stop on
SIGINT / SIGTERM and hand both on to what they start (dflash_assets/common/stop_signals.py).

The input that showed it (2026-12-07): the suite run as ``nohup pytest ... &`` failed two tests whose child ignored
the SIGTERM (killed with -9 after the grace) or the Ctrl-C the test sent, and test_status took 125 s instead of 8:
Dagster copies SIGINT's disposition to SIGTERM after each run, so each step's log-capture ``tail`` ignored Dagster's
SIGTERM and was waited for 30 s twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

STOPS = """
    import signal, subprocess, sys

    def stops_on_both():
        sleeper = subprocess.Popen(["sleep", "60"])
        sleeper.send_signal(signal.SIGTERM)
        try:
            assert sleeper.wait(timeout=10) == -signal.SIGTERM
        finally:
            sleeper.kill()
        python = subprocess.run(
            [sys.executable, "-c", "import os, signal, time; os.kill(os.getpid(), signal.SIGINT); time.sleep(10)"],
            capture_output=True, text=True, timeout=30,
        )
        assert python.returncode == -signal.SIGINT and "KeyboardInterrupt" in python.stderr, python
"""


def _ignore_sigint() -> None:
    """What a shell without job control gives a background job."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _ignore_both() -> None:
    """The background job's SIGINT, and the SIGTERM Dagster copies from it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def test_a_suite_started_with_stop_signals_ignored_still_delivers_them_to_its_children(tmp_path):
    (tmp_path / "test_inner.py").write_text(
        textwrap.dedent(STOPS) + "\n\ndef test_a_child_gets_the_stop_signals_its_test_sends():\n    stops_on_both()\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    inner = ["-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "dflash_assets_tests.conftest", *inner],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=ENV,
        preexec_fn=_ignore_both,
    )
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr


def test_a_process_loading_the_pipeline_stops_and_hands_on_both_signals_after_a_run():
    """A Dagster run in a process started with SIGINT ignored left SIGTERM ignored too (``kill PID`` did nothing);
    loading the definitions restores both, and they stay restored after a run."""
    code = textwrap.dedent(STOPS) + textwrap.dedent("""
        import dagster as dg
        import dflash_assets.definitions  # noqa: F401

        @dg.asset
        def one():
            return 1

        with dg.instance_for_test() as instance:
            assert dg.materialize([one], instance=instance).success
        # Dagster maps SIGTERM to SIGINT's handler after the run: now Python's KeyboardInterrupt, not "ignored"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler
        stops_on_both()
        print("STOPS")
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=ENV, preexec_fn=_ignore_sigint
    )
    assert out.returncode == 0 and "STOPS" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_the_command_line_restores_them_before_anything_else():
    code = textwrap.dedent("""
        import signal
        from dflash_assets.app.cli import main
        try:
            main(["no-such-command"])
        except SystemExit:
            pass
        sigint, sigterm = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        print(sigint is signal.default_int_handler, sigterm is signal.SIG_DFL)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV, preexec_fn=_ignore_both
    )
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr[-2000:]
