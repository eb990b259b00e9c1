"""Server processes: start in their own session, stop by process group, inspect through ``/proc``.

A server we start is trusted only once the socket listening on its port is provably its own: a port
is checked free before launch (:func:`check_port_free`) and, while the server loads (SGLang binds only
after loading the model, minutes later), every health probe first checks that the listener belongs to a
process of the server's session (:func:`listener_is_ours`: ``/proc/net/tcp`` socket inode ->
``/proc/<pid>/fd``), so nothing (no request, no API key) goes to whatever took the port first.

Servers outlive a killed launcher unless something stops them. Each server started here gets
:data:`PARENT_DEATH_SIGNAL` when the thread that started it dies (``PR_SET_PDEATHSIG``, prctl(2); see
:func:`spawn_in_new_session`); the pidfile registry (:mod:`dflash_assets.generation.server_registry`)
stops what survives. Linux facts used here come from proc(5).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import ipaddress
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple


class PortTakenError(RuntimeError):
    """A server's port is held by a process that is not the server started for it."""


class Listener(NamedTuple):
    """A TCP socket in state LISTEN (``/proc/net/tcp``, ``/proc/net/tcp6``): local ``address`` (text;
    IPv4-mapped IPv6 as IPv4), ``port`` and socket ``inode``."""

    address: str
    port: int
    inode: int


_WILDCARDS = {"0.0.0.0", "::", ""}
_TCP_LISTEN = "0A"  # include/net/tcp_states.h: TCP_LISTEN = 10


def _proc_net_address(hex_address: str) -> str:
    """Text form of a ``/proc/net/tcp*`` address: 32-bit words in host byte order (proc(5))."""
    raw = b"".join(struct.pack("=I", int(hex_address[i : i + 8], 16)) for i in range(0, len(hex_address), 8))
    ip = ipaddress.ip_address(raw)
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def tcp_listeners(port: int) -> list[Listener] | None:
    """Sockets listening on TCP ``port`` in this network namespace; None where ``/proc/net/tcp`` is missing
    (not Linux: nothing can be checked)."""
    found, seen = [], False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        seen = True
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _TCP_LISTEN:
                continue
            address, _, hex_port = fields[1].partition(":")
            if int(hex_port, 16) == port:
                found.append(Listener(_proc_net_address(address), port, int(fields[9])))
    return found if seen else None


def _host_addresses(host: str) -> set[str] | None:
    """Addresses a client of ``http://host:port`` may connect to; None for a wildcard host (any local one)."""
    if host in _WILDCARDS:
        return None
    try:
        return {str(ipaddress.ip_address(info[4][0].split("%")[0])) for info in socket.getaddrinfo(host, None)}
    except (OSError, ValueError):
        return {host}


def _relevant(listener: Listener, addresses: set[str] | None) -> bool:
    return addresses is None or listener.address in _WILDCARDS or listener.address in addresses


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` holds (``/proc/<pid>/fd`` links ``socket:[N]``; empty for a
    process of another user, whose fds cannot be read)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{int(pid)}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{int(pid)}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def session_members(sid: int) -> list[int]:
    """Processes of session ``sid`` not yet exited (a server started by :func:`spawn_in_new_session` leads
    its own session; SGLang's workers may change process group but stay in it)."""
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_stat(int(name))
            if stat and stat.session == sid and not exited(int(name)):
                members.append(int(name))
    return members


def _describe_holder(inode: int) -> str:
    """``pid N (command)`` of the process holding socket ``inode``, when this user can see it."""
    for name in os.listdir("/proc"):
        if name.isdigit() and inode in socket_inodes(int(name)):
            try:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            cmd = cmd.strip()
            return f"pid {name} ({cmd[:120]})"
    return "a process this user cannot inspect (another user's)"


def _port_message(host: str, port: int, holder: str, what: str) -> str:
    return (
        f"port {port} on {host} is held by {holder}, not {what}; nothing was sent to it (no request, no API "
        f"key). Stop that process or choose another port (inference.port_base in sglang mode)"
    )


def check_port_free(host: str, port: int, what: str = "a server started here", wait_s: float = 0.0) -> None:
    """Raise :class:`PortTakenError` unless nothing listens on ``host:port`` (any socket that would take
    connections for ``host``: its address or a wildcard one). ``wait_s``: keep looking that long for it to
    be freed (a server just stopped). Without ``/proc/net/tcp`` a trial bind decides.

    Raises:
        PortTakenError: the message names the port, the holder (pid and command when visible) and the fix.
    """
    deadline = time.monotonic() + wait_s
    addresses = _host_addresses(host)
    while True:
        listeners = tcp_listeners(port)
        if listeners is None:
            try:
                with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT is no holder
                    s.bind((host, port))
                return
            except OSError:
                taken = "another process"
        else:
            held = [listener for listener in listeners if _relevant(listener, addresses)]
            if not held:
                return
            taken = _describe_holder(held[0].inode)
        if time.monotonic() >= deadline:
            raise PortTakenError(_port_message(host, port, taken, what))
        time.sleep(0.2)


def listener_is_ours(host: str, port: int, leader_pid: int, what: str = "the server started here") -> bool:
    """Whether the socket listening on ``host:port`` belongs to the session led by ``leader_pid`` (the
    server we started): False while nothing listens yet (still loading), True once every listener that
    takes connections for ``host`` is held by one of the session's processes. Without ``/proc/net/tcp``
    (not Linux) nothing can be checked and True is returned once anything listens.

    Raises:
        PortTakenError: a listener for ``host:port`` belongs to another process (message as
            :func:`check_port_free`).
    """
    listeners = tcp_listeners(port)
    if listeners is None:
        try:
            with socket.create_connection((host if host not in _WILDCARDS else "127.0.0.1", port), timeout=2):
                return True
        except OSError:
            return False
    held = [listener for listener in listeners if _relevant(listener, _host_addresses(host))]
    if not held:
        return False
    ours: set[int] = set()
    for pid in session_members(leader_pid):
        ours |= socket_inodes(pid)
    for listener in held:
        if listener.inode not in ours:
            holder = _describe_holder(listener.inode)
            raise PortTakenError(_port_message(host, port, holder, f"{what} (pid {leader_pid})"))
    return True


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
) -> int:
    """Run ``argv`` in a new session (its own process group), passing each line of its stdout+stderr to
    ``on_line``; returns its exit code. Whatever interrupts the wait (Ctrl-C, Dagster's step interrupt,
    an exception from ``on_line``) stops the whole process group (SIGTERM, SIGKILL after ``grace_s``:
    :func:`stop_process_group`) before it propagates, so no child (``torchrun`` and its workers) is left
    running. With ``parent_death_signal`` (Linux) the leader also gets :data:`PARENT_DEATH_SIGNAL` when
    this process dies."""
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
