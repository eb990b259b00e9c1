"""Which machine, boot and pid namespace a process runs in: what a recorded pid means, and where.

A pid names a process only within one pid namespace of one running kernel, and only with its start
time (proc(5)). The host name proves nothing: two nodes or containers may share one, and a shared
run storage or ``DAGSTER_HOME`` then holds pids of processes this machine cannot see. So a record of
a process carries (see :func:`identity`):

- ``machine``: ``etc:<hash>`` from ``/etc/machine-id`` (machine-id(5): set once per installation,
  kept across reboots; hashed with this project's name, as machine-id(5) asks of ids shown to others),
  else ``home:<random>`` from a file created once in ``DAGSTER_HOME`` (which several machines may
  share, so it proves less, see :func:`same_machine`);
- ``boot``: ``/proc/sys/kernel/random/boot_id`` (new at every boot);
- ``pid_ns``: the pid namespace (``/proc/self/ns/pid``, e.g. ``pid:[4026531836]``): containers on one
  kernel share the boot id and often the machine id, never the pid namespace.

No Dagster here.
"""

from __future__ import annotations

import hashlib
import os
import socket
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

from dflash_assets.generation.processes.proc_info import boot_id, is_running, proc_stat

MACHINE_ID_FILE = "/etc/machine-id"
HOME_ID_FILE = ".dflash_machine_id"  # in DAGSTER_HOME, when there is no /etc/machine-id

__all__ = [
    "Identity",
    "identity",
    "machine_id",
    "pid_namespace",
    "process_gone",
    "process_record",
    "same_machine",
]


class Identity(NamedTuple):
    """Where a process runs: ``machine`` (``etc:...`` or ``home:...``), ``boot`` and ``pid_ns`` (None
    where unknown)."""

    machine: str | None
    boot: str | None
    pid_ns: str | None


def pid_namespace() -> str | None:
    """This process's pid namespace (``pid:[inode]``), or None without ``/proc``."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _home_id(home: Path) -> str | None:
    path = home / HOME_ID_FILE
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        pass
    except OSError:
        return None
    try:  # first use: a random id; the first writer wins (O_EXCL), the others read its id
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return path.read_text().strip() or None
    except OSError:
        return None
    with os.fdopen(fd, "w") as f:
        f.write(uuid.uuid4().hex + "\n")
    return path.read_text().strip() or None


def machine_id(home: Path | str | None = None) -> str | None:
    """``etc:<32 hex>`` (SHA-256 of ``/etc/machine-id`` with this project's name) or, without one,
    ``home:<32 hex>`` (a random id kept in ``<home or DAGSTER_HOME>/.dflash_machine_id``); None when
    neither can be had."""
    try:
        raw = Path(MACHINE_ID_FILE).read_text().strip()
    except OSError:
        raw = ""
    if raw:
        return "etc:" + hashlib.sha256(f"dflash-assets:{raw}".encode()).hexdigest()[:32]
    if home is None:
        from dflash_assets.common.settings import dagster_home

        home = dagster_home()
    value = _home_id(Path(home))
    return f"home:{value}" if value else None


def identity() -> Identity:
    """This process's :class:`Identity`."""
    return Identity(machine_id(), boot_id(), pid_namespace())


def same_machine(recorded: Identity, here: Identity | None = None) -> Literal["same", "rebooted"] | None:
    """Whether a process recorded as ``recorded`` ran where this process runs (``here``, default
    :func:`identity`): ``"same"`` (same machine, boot and pid namespace: its pid can be looked up
    here), ``"rebooted"`` (same machine, an earlier boot: it is gone) or None (another machine, another
    pid namespace, or not provable: leave it alone).

    An earlier boot counts only with an ``etc:`` machine id: a ``home:`` id is shared by every machine
    that shares ``DAGSTER_HOME``, so a different boot id may just be another machine.
    """
    here = identity() if here is None else here
    if not recorded.machine or not here.machine or recorded.machine != here.machine:
        return None
    if not recorded.boot or not here.boot:
        return None
    if recorded.boot != here.boot:
        return "rebooted" if here.machine.startswith("etc:") else None
    if not recorded.pid_ns or not here.pid_ns or recorded.pid_ns != here.pid_ns:
        return None
    return "same"


def process_record(pid: int | None = None) -> dict[str, Any]:
    """A JSON-able record naming process ``pid`` (default: this one) where it runs: ``pid``, ``start_time``
    (clock ticks after boot), ``machine``, ``boot``, ``pid_ns`` (:func:`identity`) and ``host`` (for
    messages only). :func:`process_gone` reads it back."""
    pid = os.getpid() if pid is None else pid
    stat = proc_stat(pid)
    here = identity()
    return {
        "pid": pid,
        "start_time": stat.start_time if stat else None,
        "machine": here.machine,
        "boot": here.boot,
        "pid_ns": here.pid_ns,
        "host": socket.gethostname(),
    }


def process_gone(record: Mapping[str, Any]) -> str | None:
    """Why the process of a :func:`process_record` is provably not running (a phrase for messages), or None
    when it may be: only a record of this machine, boot and pid namespace (:func:`same_machine` ``"same"``)
    whose pid is gone or names a process started at another time counts; another machine or an unreadable
    record is never judged dead."""
    try:
        pid, start = int(record["pid"]), record.get("start_time")
        start = None if start is None else int(start)
    except (KeyError, TypeError, ValueError):
        return None
    recorded = Identity(record.get("machine"), record.get("boot"), record.get("pid_ns"))
    if pid <= 0 or start is None or same_machine(recorded) != "same":
        return None
    if is_running(pid, start):
        return None
    return f"pid {pid} (this machine, this boot) is not running"
