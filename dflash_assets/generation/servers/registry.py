"""The pidfile registry of running inference servers, and the reaper of servers whose launcher died.

Each server started through :func:`start_process` writes a pidfile into :func:`server_registry_dir`;
:func:`reap_orphaned_servers` (called by ``run`` and by the inference resource before starting
servers) stops the servers whose launching process is gone. A pid names a process only with its start
time, in one boot and pid namespace of one machine (proc(5); :mod:`dflash_assets.generation.processes.machine`), so all
of them are recorded, and a pidfile of another machine or namespace is never acted on, whatever its host name.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dflash_assets.common.settings import dagster_home
from dflash_assets.generation.processes.machine import Identity, identity, same_machine
from dflash_assets.generation.processes.proc_info import group_members, is_running, proc_stat
from dflash_assets.generation.processes.sessions import spawn_in_new_session
from dflash_assets.storage.atomic import atomic_write_bytes, temp_name_parts

logger = logging.getLogger(__name__)

#: Environment variable that overrides :func:`server_registry_dir` (tests, several instances per host).
REGISTRY_ENV = "DFLASH_SERVER_REGISTRY"


def server_registry_dir() -> Path:
    """Directory of the running-server pidfiles: ``$DFLASH_SERVER_REGISTRY``, else
    ``<DAGSTER_HOME>/storage/dflash_servers`` (next to the run storage that ``run`` reaps; git-ignored)."""
    return Path(os.environ.get(REGISTRY_ENV) or dagster_home() / "storage" / "dflash_servers")


def register_server(
    proc: subprocess.Popen,
    argv: Sequence[str],
    port: int | None,
    label: str = "",
    registry_dir: Path | str | None = None,
) -> Path | None:
    """Write the pidfile of a server started in its own session; returns its path (None if it failed).

    JSON fields: ``pid`` (= ``pgid``, the session leader), ``start_time`` (``/proc/<pid>/stat`` field 22,
    clock ticks after boot: a recycled pid never matches), ``machine_id``, ``boot_id``, ``pid_ns``
    (:func:`~dflash_assets.generation.processes.machine.identity`), ``host`` (for messages), ``argv0``, ``label``,
    ``port``, ``owner_pid``/``owner_start_time`` (this process) and ``created_at`` (Unix seconds).
    Written atomically (temporary file + rename). A failure is logged, not raised: the server runs
    unprotected rather than not at all.
    """
    stat = proc_stat(proc.pid)
    owner = proc_stat(os.getpid())
    here = identity()
    entry = {
        "pid": proc.pid,
        "pgid": proc.pid,
        "start_time": stat.start_time if stat else None,
        "machine_id": here.machine,
        "boot_id": here.boot,
        "pid_ns": here.pid_ns,
        "host": socket.gethostname(),
        "argv0": str(argv[0]) if argv else "",
        "label": label,
        "port": port,
        "owner_pid": os.getpid(),
        "owner_start_time": owner.start_time if owner else None,
        "created_at": time.time(),
    }
    directory = Path(registry_dir) if registry_dir else server_registry_dir()
    path = directory / f"{entry['host']}_{proc.pid}_{entry['start_time']}.json"
    try:
        atomic_write_bytes(path, json.dumps(entry).encode())
    except OSError as exc:
        logger.warning("could not register server pid %s in %s: %s", proc.pid, directory, exc)
        return None
    return path


KEY_DIR_PREFIX = "dflash-sglang-keys-"  # the only directories the reaper ever removes


def register_key_dir(key_dir: Path | str, registry_dir: Path | str | None = None) -> Path | None:
    """Record the directory of API-key files a launcher created (``<registry>/<host>_<pid>_<hex>.keydir``,
    JSON: ``key_dir``, owner pid and start time, machine, boot and pid namespace), so that
    :func:`reap_orphaned_servers` removes it once the launcher is gone (a ``kill -9`` skips its ``stop``).
    Returns the record's path, or None when it could not be written (logged: the key dir is still
    removed by a clean stop)."""
    owner, here = proc_stat(os.getpid()), identity()
    entry = {
        "key_dir": str(key_dir),
        "owner_pid": os.getpid(),
        "owner_start_time": owner.start_time if owner else None,
        "machine_id": here.machine,
        "boot_id": here.boot,
        "pid_ns": here.pid_ns,
    }
    directory = Path(registry_dir) if registry_dir else server_registry_dir()
    path = directory / f"{socket.gethostname()}_{os.getpid()}_{os.urandom(4).hex()}.keydir"
    try:
        atomic_write_bytes(path, json.dumps(entry).encode(), mode=0o600)
    except OSError as exc:
        logger.warning("could not record key directory in %s: %s", directory, exc)
        return None
    return path


def _reap_key_dirs(directory: Path, here: Identity) -> None:
    """Remove the key directories (and records) of launchers of this machine that are no longer running."""
    for path in sorted(directory.glob("*.keydir")):
        try:
            entry = json.loads(path.read_text())
            key_dir = Path(entry["key_dir"])
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("unreadable key-directory record %s: %s", path, exc)
            continue
        where = same_machine(Identity(entry.get("machine_id"), entry.get("boot_id"), entry.get("pid_ns")), here)
        if where not in ("same", "rebooted"):
            continue  # another machine or pid namespace: its pids mean nothing here
        if where == "same" and is_running(int(entry.get("owner_pid") or 0), entry.get("owner_start_time")):
            continue
        if key_dir.name.startswith(KEY_DIR_PREFIX):  # never anything else a damaged record could name
            shutil.rmtree(key_dir, ignore_errors=True)
            logger.info("removed API-key files %s left by a killed launcher (pid %s)", key_dir, entry.get("owner_pid"))
        path.unlink(missing_ok=True)


#: A registry temporary file this old (seconds) is abandoned whatever wrote it: a record is written in milliseconds.
ABANDONED_TEMP_S = 60.0


def _finish_abandoned_writes(directory: Path, here: Identity) -> None:
    """Put in place the records whose writer was killed between writing and renaming them.

    A ``kill -9`` of a launcher while it registers a server leaves the record under its temporary name
    (:func:`~dflash_assets.storage.atomic.temp_path`: ``.<name>.<pid>.<hex8>.tmp``), where no reaper would read it, and
    the server unrecorded. A whole record of this machine whose writer is gone is renamed to its name, so the
    reaper acts on it; one that does not read is removed once :data:`ABANDONED_TEMP_S` old.
    """
    for tmp in directory.glob(".*.tmp"):
        parts = temp_name_parts(tmp.name)
        if parts is None or not parts[0].endswith((".json", ".keydir")):
            continue
        name, writer_pid = parts
        try:
            entry = json.loads(tmp.read_text())
            where = same_machine(Identity(entry.get("machine_id"), entry.get("boot_id"), entry.get("pid_ns")), here)
        except FileNotFoundError:
            continue  # its writer renamed it after all
        except (OSError, ValueError, AttributeError):
            try:
                if time.time() - tmp.stat().st_mtime > ABANDONED_TEMP_S:
                    tmp.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
            continue
        if where == "rebooted" or (where == "same" and not is_running(writer_pid, None)):
            try:
                os.replace(tmp, directory / name)
            except FileNotFoundError:
                pass


def reap_orphaned_servers(registry_dir: Path | str | None = None, grace_s: float = 10.0) -> list[dict[str, Any]]:
    """Stop every registered server of this machine whose launching process is gone, and drop stale pidfiles.

    A server is stopped when its owner (``owner_pid`` with ``owner_start_time``) is no longer running and
    its process group still holds live processes started no earlier than the recorded leader (a leader
    pid now held by a process with another start time is left alone): ``SIGTERM`` to the group, up to
    ``grace_s`` seconds to exit, then ``SIGKILL``. Pidfiles of dead servers, or from an earlier boot of
    this machine, are removed; those of servers whose owner runs, or of another machine or pid namespace
    (a shared DAGSTER_HOME; :func:`~dflash_assets.generation.processes.machine.same_machine`), are kept. The API-key
    directories of launchers of this machine that are gone (:func:`register_key_dir`) are removed too, and a
    record a killed launcher left under its temporary name is read as well (:func:`_finish_abandoned_writes`).

    Args:
        registry_dir: pidfile directory; None = :func:`server_registry_dir`.
        grace_s: seconds between SIGTERM and SIGKILL.

    Returns:
        The pidfile entries (dicts, see :func:`register_server`) of the servers stopped, each with
        ``killed_pids`` added. Use :func:`orphan_message` to report them.
    """
    directory = Path(registry_dir) if registry_dir else server_registry_dir()
    if not directory.is_dir():
        return []
    here = identity()
    _finish_abandoned_writes(directory, here)
    _reap_key_dirs(directory, here)
    stopped = []
    for path in sorted(directory.glob("*.json")):
        try:
            entry = json.loads(path.read_text())
        except FileNotFoundError:
            continue  # stopped cleanly, or another reaper got it
        except (OSError, ValueError) as exc:
            logger.warning("unreadable server pidfile %s: %s", path, exc)
            continue
        where = same_machine(Identity(entry.get("machine_id"), entry.get("boot_id"), entry.get("pid_ns")), here)
        if where == "rebooted":
            path.unlink(missing_ok=True)
            continue
        if where != "same":
            continue  # another machine or pid namespace: its pids mean nothing here
        if is_running(int(entry.get("owner_pid") or 0), entry.get("owner_start_time")):
            continue
        pgid, start_time = int(entry["pgid"]), entry.get("start_time")
        if start_time is None:  # unverifiable (no /proc at launch): never kill on a pid alone
            continue
        members = group_members(pgid, start_time)
        if members:
            try:
                os.killpg(pgid, signal.SIGTERM)
                deadline = time.monotonic() + grace_s
                while group_members(pgid, start_time) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if group_members(pgid, start_time):
                    os.killpg(pgid, signal.SIGKILL)
                    deadline = time.monotonic() + 5.0
                    while group_members(pgid, start_time) and time.monotonic() < deadline:
                        time.sleep(0.1)
            except ProcessLookupError:
                pass
            except PermissionError as exc:
                logger.warning("cannot stop orphaned server pid %s: %s", pgid, exc)
                continue
            if group_members(pgid, start_time):
                continue  # still dying (uninterruptible sleep): keep the pidfile for the next reaper
            stopped.append({**entry, "killed_pids": members})
        path.unlink(missing_ok=True)
    return stopped


def orphan_message(entry: Mapping[str, Any]) -> str:
    """One line for a server :func:`reap_orphaned_servers` stopped."""
    label = f" ({entry['label']})" if entry.get("label") else ""
    return (
        f"stopped orphaned inference server pid {entry['pid']}{label} on port {entry.get('port')} "
        f"left by a killed run (launcher pid {entry.get('owner_pid')})"
    )


def start_process(
    argv: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    *,
    port: int | None = None,
    label: str = "",
    parent_death_signal: bool = True,
    registry_dir: Path | str | None = None,
    secrets: Sequence[str] = (),
) -> subprocess.Popen:
    """Start a server (:func:`~dflash_assets.generation.processes.sessions.spawn_in_new_session`) and register it
    (:func:`register_server`; the pidfile path is kept as ``proc.registry_file``, removed by
    :func:`~dflash_assets.generation.processes.sessions.stop_process_group` once the leader is reaped).
    ``secrets`` never reach the log (see :func:`~dflash_assets.generation.processes.sessions.spawn_in_new_session`)."""
    proc = spawn_in_new_session(argv, env, log_path, parent_death_signal=parent_death_signal, secrets=secrets)
    proc.registry_file = register_server(proc, argv, port, label, registry_dir)  # type: ignore[attr-defined]
    return proc
