"""Exclusive access to one storage object among machines that share a storage root but not a Dagster
instance (two hosts, each with its own ``DAGSTER_HOME``, on one ``s3://`` root).

* :func:`writer_identity`: ``<host>-<pid>-<random>``, unique per process, for names of objects that two
  writers could otherwise share (journal segments).
* :class:`StoreLock`: a lock object created only if absent (S3 ``PutObject`` with ``If-None-Match: *``;
  a local file written whole, then hard-linked into place, which fails when one exists), holding its
  owner, lease expiry and (when the caller gives one) a record of its process. A second writer waits for
  it, saying who holds it and until when; a lease that expired (its holder was killed), or a holder the
  caller's ``holder_gone`` proves dead (same host and boot, pid not running), is taken over as a
  compare-and-swap of exactly the lock version that was read: S3 ``If-Match`` on the ETag read with it;
  locally a claim file named after that version's inode and mtime (created only if absent, so one taker
  per version) and a rename over the lock only while it is still that version. Two waiters on one
  expired lock: exactly one wins.

No Dagster here.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from dflash_assets.storage.atomic import atomic_write_bytes, fsync_dir, temp_path
from dflash_assets.storage.store import Storage, s3_error_code

__all__ = ["LockBusyError", "StoreLock", "writer_identity"]

_IDENTITY = None
_REFUSED = ("PreconditionFailed", "ConditionalRequestConflict")  # S3 codes: another writer got there first
#: a take-over claim older than this was left by a taker that died between claiming and renaming (seconds)
STALE_CLAIM_S = 30.0
#: seconds between the wait's progress lines
WAIT_LOG_S = 60.0
log = logging.getLogger(__name__)


def writer_identity() -> str:
    """``<host>-<pid>-<hex8>`` for this process (host cut to 40 safe characters): the random part keeps
    two hosts of one name, or a reused pid, apart."""
    global _IDENTITY
    if _IDENTITY is None or _IDENTITY[0] != os.getpid():  # a forked child is another writer
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:40] or "host"
        _IDENTITY = (os.getpid(), f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return _IDENTITY[1]


class LockBusyError(RuntimeError):
    """Another writer held the lock for longer than the wait; the message names the lock, its holder
    and the fix."""


def _when(t: object) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(t)))  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return "?"


class StoreLock:
    """Context manager holding the lock object ``parts`` under ``store``'s root.

    Args:
        store: the shared storage (local directory or S3).
        parts: the lock object's path, e.g. ``("prompt_corpus", ".lock")``.
        lease_s: how long a holder may keep it before another writer may take it over (seconds).
        wait_s: how long to wait for a held lock before giving up (seconds).
        poll_s: seconds between tries while waiting.
        holder: a record of this process written into the lock (e.g. pid, start time, machine, boot), for
            ``holder_gone`` of later writers and for messages.
        holder_gone: given a holder's record, why it is provably dead (a string), or None when it may be
            alive: such a holder's lock is taken over at once, whatever its lease.
        log: receives the wait's lines (who holds the lock, until when) and take-overs; default: this
            module's logger, at WARNING.

    Raises:
        LockBusyError: still held by another writer (lease not expired) after ``wait_s``.
    """

    def __init__(
        self,
        store: Storage,
        parts: tuple[str, ...],
        lease_s: float = 900,
        wait_s: float = 900,
        poll_s=1.0,
        holder: Mapping[str, Any] | None = None,
        holder_gone: Callable[[Mapping[str, Any]], str | None] | None = None,
        log: Callable[[str], None] | None = None,
    ):
        self.store, self.parts = store, tuple(parts)
        self.lease_s, self.wait_s, self.poll_s = lease_s, wait_s, poll_s
        self.owner = f"{writer_identity()}-{uuid.uuid4().hex[:6]}"
        self.holder, self.holder_gone = dict(holder or {}), holder_gone
        self.log = log or log_warning

    def _body(self) -> bytes:
        now = time.time()
        record = {"owner": self.owner, "acquired": now, "expires": now + self.lease_s}
        if self.holder:
            record["process"] = self.holder
        return json.dumps(record).encode()

    def _create(self, if_match: str | None = None) -> bool:
        """Create the lock object if absent (or replace the one with ETag ``if_match``); False if refused."""
        path = self.store.path(*self.parts)
        if self.store.is_local:
            # written whole under a temporary name, then linked: a reader never sees an empty lock
            tmp = temp_path(path)
            atomic_write_bytes(tmp, self._body())
            try:
                os.link(tmp, path)  # fails if the lock exists: create-if-absent
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            fsync_dir(os.path.dirname(path))
            return True
        extra = {"IfMatch": if_match} if if_match else {"IfNoneMatch": "*"}
        try:
            self.store.call("lock", self.parts, lambda: self.store.fs.pipe_file(path, self._body(), **extra))
        except FileExistsError:  # 412 on If-None-Match: another writer holds it
            return False
        except OSError as exc:  # 412 on If-Match (s3fs: EINVAL), or 409: another writer changed it first
            if exc.errno == errno.EINVAL or s3_error_code(exc.__cause__ or exc) in _REFUSED:
                return False
            raise
        return True

    def _holder(self) -> tuple[dict[str, Any], Any]:
        """The current lock's content and its version: ``(inode, mtime_ns)`` of the very file read (local), or
        the ETag the object had before and after the read (S3); ``({}, None)`` when it is gone, a version of
        None when the object changed while read (try again). A damaged lock reads as expired."""
        path = self.store.path(*self.parts)
        try:
            if self.store.is_local:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    raw, version = f.read(), (st.st_ino, st.st_mtime_ns)
            else:

                def etag() -> str | None:
                    self.store.fs.invalidate_cache(path)  # another host wrote it: never a cached answer
                    return self.store.call("head", self.parts, lambda: self.store.fs.info(path)).get("ETag")

                before = etag()
                raw = self.store.read_bytes(*self.parts)
                version = before if etag() == before else None
        except FileNotFoundError:
            return {}, None
        try:
            held = json.loads(raw)
        except ValueError:  # a damaged lock file: treat as expired
            held = None
        return (held if isinstance(held, dict) else {"owner": "?", "expires": 0}), version

    def _take_over(self, version: Any) -> bool:
        """Replace the lock if it is still ``version`` (:meth:`_holder`): True for exactly one taker."""
        if version is None:
            return False
        if not self.store.is_local:
            return self._create(if_match=version)
        path = self.store.path(*self.parts)
        base = f"{path}.takeover-{version[0]}-{version[1]}"
        for n in range(10):  # a claim whose taker died before renaming is passed over after STALE_CLAIM_S
            claim = base if n == 0 else f"{base}.{n}"
            try:
                os.close(os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            except FileExistsError:
                try:
                    if time.time() - os.stat(claim).st_mtime < STALE_CLAIM_S:
                        return False  # another waiter is taking this version over now
                except FileNotFoundError:
                    return False  # it just finished: the lock is another version now
                continue
            try:
                st = os.stat(path)
                if (st.st_ino, st.st_mtime_ns) != tuple(version):
                    return False  # taken over (or released and taken) since it was read
                tmp = temp_path(path)
                atomic_write_bytes(tmp, self._body())
                os.replace(tmp, path)  # only the one claim of this version gets here
                fsync_dir(os.path.dirname(path))
                return True
            except FileNotFoundError:
                return False
            finally:
                os.unlink(claim)
        return False

    def _describe(self, held: Mapping[str, Any]) -> str:
        process = held.get("process") if isinstance(held.get("process"), Mapping) else {}
        where = f" (pid {process.get('pid')} on {process.get('host', '?')})" if process.get("pid") else ""
        return f"{held.get('owner', '?')}{where} until {_when(held.get('expires', 0))}"

    def acquire(self) -> None:
        """Take the lock, waiting up to ``wait_s`` for a live holder (a line on ``log`` when the wait starts
        and every :data:`WAIT_LOG_S` seconds, naming the holder and its lease's end)."""
        started = time.monotonic()
        deadline, next_line = started + self.wait_s, started
        held: dict[str, Any] = {}
        while True:
            if self._create():
                return
            held, version = self._holder()
            if held:
                expired = float(held.get("expires") or 0) < time.time()
                process = held.get("process")
                gone = (
                    self.holder_gone(process)
                    if not expired and self.holder_gone is not None and isinstance(process, Mapping)
                    else None
                )
                if (expired or gone) and self._take_over(version):
                    why = f"its holder is gone: {gone}" if gone else "its lease expired"
                    self.log(f"{self.store.uri(*self.parts)}: taken over from {self._describe(held)} ({why})")
                    return
            if time.monotonic() >= deadline:
                raise LockBusyError(
                    f"{self.store.uri(*self.parts)} is held by {self._describe(held)} (another build on this "
                    "storage root); run again once it has finished, or delete that object if no build is running"
                )
            if held and time.monotonic() >= next_line:
                self.log(
                    f"{self.store.uri(*self.parts)} is held by {self._describe(held)}; waiting up to "
                    f"{max(0.0, deadline - time.monotonic()):.0f} s more for it"
                )
                next_line = time.monotonic() + WAIT_LOG_S
            time.sleep(self.poll_s)

    def release(self) -> None:
        """Remove the lock if it is still this holder's (a taken-over lease is left to its new holder)."""
        held, _ = self._holder()
        if held.get("owner") == self.owner:
            self.store.remove(*self.parts)

    def __enter__(self) -> StoreLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def log_warning(line: str) -> None:
    """The default ``log`` of :class:`StoreLock`: this module's logger at WARNING."""
    log.warning("%s", line)
