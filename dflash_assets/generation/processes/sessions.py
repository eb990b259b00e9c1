"""Server processes: start in their own session, stop by process group (ports:
:mod:`~dflash_assets.generation.processes.ports`; ``/proc``: :mod:`~dflash_assets.generation.processes.proc_info`).

A server we start is trusted only once the socket listening on its port is provably its own: a port
is checked free before launch (:func:`check_port_free`) and, while the server loads (SGLang binds only
after loading the model, minutes later), every health probe first checks that the listener belongs to a
process of the server's session (:func:`listener_is_ours`: ``/proc/net/tcp`` socket inode ->
``/proc/<pid>/fd``), so nothing (no request, no API key) goes to whatever took the port first.

Servers outlive a killed launcher unless something stops them. Each server started here gets
:data:`PARENT_DEATH_SIGNAL` when the thread that started it dies (``PR_SET_PDEATHSIG``, prctl(2); see
:func:`spawn_in_new_session`); the pidfile registry (:mod:`dflash_assets.generation.servers.registry`)
stops what survives. Linux facts used here come from proc(5).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# what lived here before the split, imported from here by servers, tests and benches


def log_tail(path: Path | str | None, max_bytes: int = 4000) -> str:
    """The last ``max_bytes`` bytes of a log file as text ('' when missing)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

#: Signal a server's leader gets when its launcher dies. SIGKILL, not SIGTERM: on SIGTERM the uvicorn
#: server of ``transformers serve`` shuts down gracefully, first finishing in-flight generations for a
#: client that is dead (measured: 60 s for 16 rows of 128 tokens with SmolLM2; as long as the longest
#: row in general). SGLang's HTTP server is uvicorn too.
PARENT_DEATH_SIGNAL = signal.SIGKILL


@functools.lru_cache(maxsize=1)
def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (Linux), resolved in the parent so the forked child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def _parent_death_preexec(sig: int = PARENT_DEATH_SIGNAL) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``sig`` when the thread that forked it exits
    (``prctl(PR_SET_PDEATHSIG)``, prctl(2)); None where that does not exist (not Linux)."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl: no signal will come
            os._exit(1)

    return preexec


_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _on_long_lived_thread(fn: Callable[[], subprocess.Popen]) -> subprocess.Popen:
    """Run ``fn`` on the main thread or, from any other thread, on one spawner thread kept for the
    process's life: PR_SET_PDEATHSIG fires when the *forking thread* exits, so a server forked by a
    short-lived worker thread would be killed when that thread ended, not when the process did."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-server-spawner")
    return _spawner.submit(fn).result()


def spawn_in_new_session(
    argv: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    *,
    parent_death_signal: bool = True,
    secrets: Sequence[str] = (),
) -> subprocess.Popen:
    """Start ``argv`` in a new session (own process group) with stdout+stderr appended to ``log_path``.

    With ``parent_death_signal`` (Linux) the leader gets :data:`PARENT_DEATH_SIGNAL` when this process
    dies, even by SIGKILL. It reaches the leader only: its children must exit with it (``transformers
    serve`` is one process; SGLang's scheduler/detokenizer set their own PR_SET_PDEATHSIG on the
    launcher). Non-main callers are forked from a process-long spawner thread (:func:`_on_long_lived_thread`).

    With ``secrets`` the output goes through a pipe and a copier thread that writes each line to
    ``log_path`` with every secret replaced by ``***``: SGLang logs its whole ``ServerArgs``, API key
    included, at start-up (``logger.info(f"{server_args=}")`` in its engine's launch code).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    preexec = _parent_death_preexec() if parent_death_signal else None
    hidden = [secret.encode() for secret in secrets if secret]

    def spawn() -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                list(argv),
                stdout=subprocess.PIPE if hidden else log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # preexec only calls the pre-resolved prctl and getppid: nothing that takes a lock another
                # thread could hold at fork time (the reason preexec_fn is flagged unsafe with threads)
                env=dict(env),
                start_new_session=True,
                preexec_fn=preexec,
            )

    proc = _on_long_lived_thread(spawn) if preexec is not None else spawn()
    if hidden:
        copier = threading.Thread(
            target=_copy_redacted, args=(proc.stdout, log_path, hidden), name=f"log-redactor-{proc.pid}", daemon=True
        )
        copier.start()
        proc.log_copier = copier  # type: ignore[attr-defined]
    return proc


def run_streaming(
    argv: Sequence[str],
    on_line: Callable[[str], None],
    *,
    env: Mapping[str, str] | None = None,
    grace_s: float = 30.0,
    parent_death_signal: bool = True,
    on_start: Callable[[subprocess.Popen], None] | None = None,
) -> int:
    """Run ``argv`` in a new session (its own process group), passing each line of its stdout+stderr to
    ``on_line``; returns its exit code. Whatever interrupts the wait (Ctrl-C, Dagster's step interrupt,
    an exception from ``on_line``) stops the whole process group (SIGTERM, SIGKILL after ``grace_s``:
    :func:`stop_process_group`) before it propagates, so no child (``torchrun`` and its workers) is left
    running. With ``parent_death_signal`` (Linux) the leader also gets :data:`PARENT_DEATH_SIGNAL` when
    this process dies. ``on_start(proc)`` is called once the process runs (e.g. to hand it to a watcher that
    may stop its group with :func:`stop_process_group`)."""
    preexec = _parent_death_preexec() if parent_death_signal else None

    def spawn() -> subprocess.Popen:
        return subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=None if env is None else dict(env),
            start_new_session=True,
            preexec_fn=preexec,
        )

    proc = _on_long_lived_thread(spawn) if preexec is not None else spawn()
    try:
        if on_start is not None:
            on_start(proc)
        assert proc.stdout is not None
        for line in proc.stdout:
            on_line(line.rstrip("\n"))
        return proc.wait()
    except BaseException:
        stop_process_group(proc, grace_s=grace_s)
        raise
    finally:
        if proc.stdout is not None:
            proc.stdout.close()


def _copy_redacted(source, log_path: Path, secrets: Sequence[bytes]) -> None:
    """Copy ``source`` line by line to ``log_path`` (appending, flushed per line) with each secret as
    ``***``, until the process closes its end. A line is split at 64 KiB, so a secret is only missed if
    a longer line cuts through it."""
    with source, open(log_path, "ab") as log:
        for line in iter(lambda: source.readline(65536), b""):
            for secret in secrets:
                line = line.replace(secret, b"***")
            log.write(line)
            log.flush()


def drain_log(proc: subprocess.Popen, timeout_s: float = 2.0) -> None:
    """Wait up to ``timeout_s`` seconds for the redacting copier of ``proc`` (if any) to write the last
    of its output: call it after the process exited and before reading the log's tail."""
    copier = getattr(proc, "log_copier", None)
    if copier is not None:
        copier.join(timeout_s)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
    """SIGTERM the process group of ``proc``, wait up to ``grace_s`` seconds, then SIGKILL it.

    The group is signalled even when the leader has already exited, so orphaned workers (SGLang's
    scheduler/detokenizer processes) die too. Removes the pidfile once the leader is reaped.
    Returns the leader's exit code (None if unknown).
    """
    pgid = proc.pid  # start_new_session=True makes the leader's pid the group id
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)  # leftovers in the group, or a leader that ignored SIGTERM
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    drain_log(proc)
    registry_file = getattr(proc, "registry_file", None)
    if registry_file is not None and proc.returncode is not None:
        Path(registry_file).unlink(missing_ok=True)
        proc.registry_file = None  # type: ignore[attr-defined]
    return proc.returncode


__all__ = [
    "PARENT_DEATH_SIGNAL",
    "drain_log",
    "log_tail",
    "run_streaming",
    "spawn_in_new_session",
    "stop_process_group",
]
