"""Processes as ``/proc`` shows them (Linux; proc(5)): their stat fields, sessions, process groups, sockets,
and the boot they belong to."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple


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
