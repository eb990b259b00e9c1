"""SIGINT and SIGTERM reach this process and the processes it starts, however it was started.

A shell without job control (a script's ``python -m dflash_assets run ... &``, ``nohup ... &`` from one) starts
its background jobs with SIGINT ignored. Dagster then copies SIGINT's disposition to SIGTERM (it maps SIGTERM to
SIGINT for Kubernetes, ``dagster._utils.interrupts.setup_interrupt_handlers``) each time a run ends, so the run
ignores ``kill PID`` too, and everything it starts inherits both signals ignored: its inference servers, and the
``tail`` each step's log capture starts, which Dagster then waits 30 s for at the step's end (60 s per step,
measured in the test suite). An ignored signal survives ``exec``; a handler is reset to the default there.
"""

from __future__ import annotations

import signal
import threading


def restore_stop_signals() -> None:
    """Give an ignored SIGINT Python's default handler (KeyboardInterrupt) and an ignored SIGTERM the default action.

    Only from the main thread (``signal.signal`` refuses any other); a no-op where neither is ignored, so a
    handler someone installed is kept.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
