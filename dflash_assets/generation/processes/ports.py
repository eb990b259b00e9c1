"""Ports of the servers started here: free before launch, and a listener trusted only once it is provably
the server's own (``/proc/net/tcp`` socket inode -> ``/proc/<pid>/fd`` of a process of its session)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import time
from pathlib import Path
from typing import NamedTuple

from dflash_assets.generation.processes.proc_info import session_members, socket_inodes


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


def _describe_holder(inode: int) -> str:
    """``pid N (program)`` of the process holding socket ``inode``, when this user can see it: the program
    name only (``/proc/<pid>/comm``), never its arguments, which may hold another process's secrets."""
    for name in os.listdir("/proc"):
        if name.isdigit() and inode in socket_inodes(int(name)):
            try:
                program = Path(f"/proc/{name}/comm").read_text(errors="replace").strip() or "?"
            except OSError:
                program = "?"
            return f"pid {name} ({program})"
    return "a process this user cannot inspect (another user's)"


def _port_message(host: str, port: int, holder: str, what: str) -> str:
    return (
        f"port {port} on {host} is held by {holder}, not {what}; nothing was sent to it (no request, no API "
        f"key). Stop that process or choose another port (inference.sglang.port_base or inference.vllm.port_base)"
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


#: Where drawn port blocks are claimed on this machine (one file per port), so two processes drawing at once (two
#: pipelines on one node, two test workers) never get the same free-looking block while a server still loads.
CLAIMS_DIR_NAME = "dflash_port_claims"
#: Seconds a claim holds: long enough for a server drawn for to load and bind, then the port is free to draw again.
CLAIM_TTL_S = 900.0


def _claims_dir() -> Path:
    """``/tmp/dflash_port_claims_<uid>``: the machine's, whatever ``$TMPDIR`` a process has (processes that draw
    with different ones must still see each other's claims)."""
    import tempfile

    root = Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())
    return root / f"{CLAIMS_DIR_NAME}_{os.getuid()}"


def claim_ports(ports: range, ttl_s: float = CLAIM_TTL_S) -> bool:
    """Claim ``ports`` for this process for ``ttl_s`` seconds (a file per port, created exclusively, so of two
    processes claiming at once one wins); a claim older than ``ttl_s`` is taken over. Returns False, having claimed
    nothing, when a port is claimed already."""
    folder = _claims_dir()
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
    except OSError:  # no shared place to claim in: the bind test alone decides, as before claims
        return True
    now = time.time()
    for old in folder.iterdir():  # claims of servers long started (or never): a few hundred files at most
        try:
            if now - old.stat().st_mtime > ttl_s:
                old.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
    made: list[Path] = []
    for port in ports:  # stale claims are gone (above): an existing file is a live claim
        path = folder / str(port)
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            for done in made:
                done.unlink(missing_ok=True)
            return False
        made.append(path)
    return True


def free_port_block(count: int, host: str = "127.0.0.1", low: int = 20000, high: int = 32000) -> int:
    """First port of ``count`` consecutive TCP ports all free on ``host`` now, for servers that listen on
    ``port_base + i``. Drawn below Linux's ephemeral range (32768-60999 by default), so the outgoing
    connections of clients never hold one of them: a block picked with port 0 + i can collide with
    one (seen: EADDRINUSE on ``port_base + 1``). The block is claimed on this machine for :data:`CLAIM_TTL_S`
    seconds (:func:`claim_ports`): a free port is free only until its server binds it, minutes later for a loading
    engine, and another process drawing meanwhile took it (seen in CI: ``PortTakenError ... held by pid A
    (python), not SGLang server 0 (pid B)``, A a server of another test process).

    Raises:
        RuntimeError: no free block found in 200 tries.
    """
    import random

    # drawn from the OS, never from the global generator: training seeds that one (random.seed(0)), and two
    # processes seeded alike drew the same block and started servers on each other's port (PortTakenError)
    draw = random.SystemRandom()
    for _ in range(200):
        base = draw.randrange(low, high - count)
        try:
            for port in range(base, base + count):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((host, port))
        except OSError:
            continue
        if claim_ports(range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports in {low}-{high} on {host}")
