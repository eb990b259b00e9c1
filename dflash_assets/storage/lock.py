"""Exclusive access to one storage object among machines that share a storage root but not a Dagster
instance (two hosts, each with its own ``DAGSTER_HOME``, on one ``s3://`` root).

* :func:`writer_identity`: ``<host>-<pid>-<random>``, unique per process, for names of objects that two
  writers could otherwise share (journal segments).
* :class:`StoreLock`: a lock object created only if absent (S3 ``PutObject`` with ``If-None-Match: *``;
  a local file written whole, then hard-linked into place, which fails when one exists), holding its
  owner and lease expiry. A second writer waits for it; a lease that expired (its holder was killed) is
  taken over atomically (S3 ``If-Match`` on the expired object's ETag; locally, a rename that only one
  taker wins), so a killed build never blocks for ever.

No Dagster here.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import time
import uuid
from typing import Any

from dflash_assets.storage.atomic import atomic_write_bytes, fsync_dir, temp_path
from dflash_assets.storage.store import Storage, _error_code

__all__ = ["LockBusyError", "StoreLock", "writer_identity"]

_IDENTITY = None
_REFUSED = ("PreconditionFailed", "ConditionalRequestConflict")  # S3 codes: another writer got there first


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


class StoreLock:
    """Context manager holding the lock object ``parts`` under ``store``'s root.

    Args:
        store: the shared storage (local directory or S3).
        parts: the lock object's path, e.g. ``("prompt_corpus", ".lock")``.
        lease_s: how long a holder may keep it before another writer may take it over (seconds).
        wait_s: how long to wait for a held lock before giving up (seconds).
        poll_s: seconds between tries while waiting.

    Raises:
        LockBusyError: still held by another writer (lease not expired) after ``wait_s``.
    """

    def __init__(self, store: Storage, parts: tuple[str, ...], lease_s: float = 900, wait_s: float = 900, poll_s=1.0):
        self.store, self.parts = store, tuple(parts)
        self.lease_s, self.wait_s, self.poll_s = lease_s, wait_s, poll_s
        self.owner = f"{writer_identity()}-{uuid.uuid4().hex[:6]}"

    def _body(self) -> bytes:
        now = time.time()
        return json.dumps({"owner": self.owner, "acquired": now, "expires": now + self.lease_s}).encode()

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
            if exc.errno == errno.EINVAL or _error_code(exc.__cause__ or exc) in _REFUSED:
                return False
            raise
        return True

    def _holder(self) -> tuple[dict[str, Any], str | None]:
        """The current lock's content and ETag (S3; None locally); ``{}`` when it is gone or unreadable."""
        etag = None
        try:
            if not self.store.is_local:
                path = self.store.path(*self.parts)
                etag = self.store.call("head", self.parts, lambda: self.store.fs.info(path)).get("ETag")
            held = json.loads(self.store.read_bytes(*self.parts))
            return (held if isinstance(held, dict) else {"owner": "?", "expires": 0}), etag
        except FileNotFoundError:
            return {}, None
        except ValueError:  # a damaged lock file: treat as expired
            return {"owner": "?", "expires": 0}, etag

    def _take_over(self, etag: str | None) -> bool:
        if not self.store.is_local:
            return etag is not None and self._create(if_match=etag)
        path = self.store.path(*self.parts)
        aside = f"{path}.expired-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, aside)  # only one taker wins the rename
        except FileNotFoundError:
            return False
        os.unlink(aside)
        return self._create()

    def acquire(self) -> None:
        deadline = time.monotonic() + self.wait_s
        while True:
            if self._create():
                return
            held, etag = self._holder()
            if held and float(held.get("expires") or 0) < time.time() and self._take_over(etag):
                return
            if time.monotonic() >= deadline:
                raise LockBusyError(
                    f"{self.store.uri(*self.parts)} is held by {held.get('owner', '?')} (another build on this "
                    f"storage root) until {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(held.get('expires', 0)))} "
                    "UTC; run again once it has finished, or delete that object if no build is running"
                )
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
