"""Server processes: start in their own session, stop by process group, inspect through ``/proc``.

Servers outlive a killed launcher unless something stops them. Each server started here gets
:data:`PARENT_DEATH_SIGNAL` when the thread that started it dies (``PR_SET_PDEATHSIG``, prctl(2); see
:func:`spawn_in_new_session`); the pidfile registry (:mod:`dflash_assets.generation.server_registry`)
stops what survives. Linux facts used here come from proc(5).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` now (another process may still take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_block(count: int, host: str = "127.0.0.1", low: int = 20000, high: int = 32000) -> int:
    """First port of ``count`` consecutive TCP ports all free on ``host`` now, for servers that listen on
    ``port_base + i``. Drawn below Linux's ephemeral range (32768-60999 by default), so the outgoing
    connections of clients never hold one of them: a block picked with port 0 + i can collide with
    one (seen: EADDRINUSE on ``port_base + 1``).

    Raises:
        RuntimeError: no free block found in 200 tries.
    """
    import random

    for _ in range(200):
        base = random.randrange(low, high - count)
        try:
            for port in range(base, base + count):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((host, port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports in {low}-{high} on {host}")


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


class ProcStat(NamedTuple):
    """Fields of ``/proc/<pid>/stat`` (proc(5)): ``state`` (``"Z"`` = zombie), ``ppid``, ``pgrp``,
    ``session`` and ``start_time`` (clock ticks after boot; with the pid it names one process)."""

    state: str
    ppid: int
    pgrp: int
    session: int
    start_time: int


def proc_stat(pid: int) -> ProcStat | None:
    """:class:`ProcStat` of ``pid``; None when there is no such process (or no ``/proc``: not Linux)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # comm may hold spaces and ')': split after the last one
    # fields[0] is field 3 (state); field k is fields[k - 3]
    return ProcStat(fields[0], int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))


def boot_id() -> str | None:
    """This boot's id: pids and start times from another boot mean nothing."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def exited(pid: int) -> bool:
    """No thread of process ``pid`` is left but zombies. A killed multi-threaded process shows its
    leader as a zombie while the other threads still tear down (and hold its sockets and memory)."""
    try:
        tids = os.listdir(f"/proc/{int(pid)}/task")
    except OSError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{int(pid)}/task/{tid}/stat", "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            continue
        if text[text.rindex(")") + 2 :].split()[0] not in ("Z", "X"):
            return False
    return True


def is_running(pid: int, start_time: int | None) -> bool:
    """``pid`` exists, has not exited (:func:`exited`) and (when ``start_time`` is known) started at
    ``start_time``."""
    if pid <= 0:
        return False
    stat = proc_stat(pid)
    if stat is None:
        if os.path.isdir("/proc"):
            return False
        try:  # no /proc (not Linux): existence only
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return (start_time is None or stat.start_time == start_time) and not exited(pid)


def group_members(pgid: int, leader_start_time: int) -> list[int]:
    """Processes of process group ``pgid`` not yet exited (:func:`exited`) started no earlier than its leader.

    Empty when a process with pid ``pgid`` exists but started at another time: the pid was recycled,
    which the kernel allows only once no process is left in the old group.
    """
    leader = proc_stat(pgid)
    if leader is not None and leader.start_time != leader_start_time:
        return []
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_stat(int(name))
            if stat and stat.pgrp == pgid and stat.start_time >= leader_start_time and not exited(int(name)):
                members.append(int(name))
    return members


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
    argv: Sequence[str], env: Mapping[str, str], log_path: Path, *, parent_death_signal: bool = True,
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
                list(argv), stdout=subprocess.PIPE if hidden else log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                # preexec only calls the pre-resolved prctl and getppid: nothing that takes a lock another
                # thread could hold at fork time (the reason preexec_fn is flagged unsafe with threads)
                env=dict(env), start_new_session=True, preexec_fn=preexec,  # noqa: PLW1509
            )

    proc = _on_long_lived_thread(spawn) if preexec is not None else spawn()
    if hidden:
        copier = threading.Thread(target=_copy_redacted, args=(proc.stdout, log_path, hidden),
                                  name=f"log-redactor-{proc.pid}", daemon=True)
        copier.start()
        proc.log_copier = copier  # type: ignore[attr-defined]
    return proc


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
