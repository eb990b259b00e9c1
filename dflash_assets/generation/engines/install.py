"""How an engine environment is installed (:mod:`~dflash_assets.generation.engines.environments`): its file lock, each
install step in a session of its own, and stopping them.

* :func:`held_lock`: the environment's ``flock`` (released when this process dies, never inherited by a step),
  recording its holder; a waiter first says whom it waits for.
* :func:`run_step`: one step (venv, ``pip install``, ``pip uninstall``) in a new session whose leader dies with this
  process (``PR_SET_PDEATHSIG``), its output appended to the install log with secrets as ``***``, its group
  recorded while it runs (the next use stops what a kill left of it); Ctrl-C in the calling thread stops the group.
* :func:`stop_installs` / :func:`wait_for_installs`: what ``run`` does with background installs on its way out.

No Dagster here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dflash_assets.generation.processes.machine import process_record
from dflash_assets.generation.processes.sessions import spawn_in_new_session, stop_process_group
from dflash_assets.storage.atomic import atomic_write_bytes

_RUNNING: set[subprocess.Popen] = set()  # install steps running now, for stop_installs
_RUNNING_LOCK = threading.Lock()
_STOPPING = threading.Event()


def own_environment() -> dict[str, str]:
    """This process's variables without ``PYTHONPATH`` / ``PYTHONHOME``: an install step or import check sees
    the environment's own packages only (pip would take a package found on ``PYTHONPATH`` as installed)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


class InstallStopped(RuntimeError):
    """The install was stopped (:func:`stop_installs`, Ctrl-C); the half-made environment is resumed next time."""


@contextlib.contextmanager
def held_lock(lock_path: Path, what: str, log: Callable[[str], None]):
    """Hold ``lock_path`` (flock, released when this process dies), recording this process in it; a waiter
    first says whom it waits for. Each hold rewrites the file: its time is the environment's last use."""
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            if holder.startswith(f"pid {os.getpid()} on {process_record()['host']} "):
                # a background thread of this run holds it (``run`` starts the install before the stages)
                holder = f"this run's own background install ({holder})"
            log(f"{what}: waiting for {holder}, which is making or checking it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        record = process_record()
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {record['pid']} on {record['host']} since {time.strftime('%H:%M:%S')}\n")
        lock.flush()
        yield


def run_step(argv: Sequence[str], log_path: Path, record_path: Path, secrets: Sequence[str]) -> int:
    """Run one install step in a session of its own, output appended to ``log_path`` (``secrets`` as ``***``),
    its group recorded in ``record_path`` while it runs; returns its exit code.

    Raises:
        InstallStopped: :func:`stop_installs` was called (before or during the step).
    """
    if _STOPPING.is_set():
        raise InstallStopped("the install was stopped; the next use resumes it")
    proc = spawn_in_new_session(list(argv), own_environment(), log_path, secrets=secrets)
    atomic_write_bytes(record_path, json.dumps(process_record(proc.pid)).encode())
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
    try:
        rc = proc.wait()
    except BaseException:  # Ctrl-C in this thread: the step stops with it
        stop_process_group(proc, grace_s=5)
        raise
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)
    stop_process_group(proc, grace_s=0)  # whatever the step left in its group (pip's build subprocesses)
    record_path.unlink(missing_ok=True)
    if _STOPPING.is_set():
        raise InstallStopped("the install was stopped; the next use resumes it")
    return rc


def stop_installs() -> int:
    """Stop every install step running in this process (its whole process group) and any later step; the
    half-made environments are resumed by their next use. Returns how many steps were running."""
    _STOPPING.set()
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for proc in running:
        stop_process_group(proc, grace_s=5)
    return len(running)


def wait_for_installs(threads: Sequence[threading.Thread | None], log: Callable[[str], None] = print) -> None:
    """Wait for the :func:`make_in_background` threads still running, with a line saying so; Ctrl-C stops their
    installs (:func:`stop_installs`: the next run resumes them) instead of waiting."""
    alive = [t for t in threads if t is not None and t.is_alive()]
    if not alive:
        return
    if all(getattr(t, "proving_only", False) for t in alive):
        log("waiting for the engine environment's import check to finish (it is made; seconds)")
    else:
        log(
            "waiting for the engine environment's install to finish (first use only; Ctrl-C stops it, "
            "the next run resumes it)"
        )
    try:
        for thread in alive:
            thread.join()
    except KeyboardInterrupt:
        stop_installs()
        for thread in alive:
            thread.join(10)
        raise


__all__ = ["InstallStopped", "held_lock", "own_environment", "run_step", "stop_installs", "wait_for_installs"]
