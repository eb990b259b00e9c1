"""Running the client's event loop so that SIGINT / SIGTERM stop it cleanly, even on uvloop."""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Any

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_interruptibly(runner: asyncio.Runner, coro: Any) -> Any:
    """``runner.run(coro)``, stopped by SIGINT / SIGTERM even on uvloop, then the signal handed on.

    A Python signal handler that raises (Dagster turns SIGINT/SIGTERM into
    ``DagsterExecutionInterruptedError``) runs inside uvloop's signal callback, which logs the exception
    and drops it: Ctrl-C did not stop a run during generation. So, on the main thread, the loop's own
    signal handling cancels the coroutine (its ``finally`` blocks run: requests cancelled, journaled
    rows kept); the previous handlers are put back and the signal is raised again for them, so the
    caller sees what it would have seen (Dagster's interrupt, KeyboardInterrupt, or the default
    termination). Signals whose handler is SIG_IGN stay ignored.

    Raises:
        whatever ``coro`` raises; after a signal, what the previous handler raises, else KeyboardInterrupt.
    """
    if threading.current_thread() is not threading.main_thread():
        return runner.run(coro)
    loop = runner.get_loop()
    previous = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
    received: list[int] = []
    main_task: list[asyncio.Task] = []

    async def main() -> Any:
        main_task.append(asyncio.current_task())
        return await coro

    def on_signal(sig: int) -> None:
        received.append(sig)
        for task in main_task:
            task.cancel()

    for sig in previous:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return runner.run(main())
    except (asyncio.CancelledError, KeyboardInterrupt):
        if not received:
            raise
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    signal.raise_signal(received[0])  # the previous handler raises (Dagster, Python's SIGINT) or terminates
    raise KeyboardInterrupt(f"generation stopped by signal {received[0]}")
