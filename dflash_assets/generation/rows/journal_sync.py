"""A :class:`RowJournal` on local scratch whose rows are copied to (S3) storage as they accumulate.

Remote layout: the journal at ``parts = (..., "<name>.jsonl")`` is stored as numbered segment objects
``(..., "<name>", "seg-000001-<writer>.jsonl")``, ``seg-000002-<writer>.jsonl``... where ``<writer>`` is
:func:`~dflash_assets.storage.lock.writer_identity` (host, pid, random): two machines on one storage root
(each with its own Dagster instance, so no shared partition lock) never write the same object, and a
reader merges every writer's segments. Each sync uploads only the lines appended since the previous
sync, as one whole-object PUT, so:

* a reader (a resuming machine) never sees a half-written segment, and every segment holds whole lines;
* nothing synced is ever overwritten or lost: segments are only added (until :meth:`discard`, once the
  partition table holds the rows, or a compaction that uploads the union before deleting its parts);
* the bytes uploaded per partition grow linearly with its rows (re-uploading the whole journal at
  every sync would grow quadratically: ~1000 rows of 8K-token reasoning are tens of MB).

Concatenating the segments in (number, writer) order gives a valid journal: later lines win for the
same ``index``, as in the local file. Names without a writer (``seg-000001.jsonl``, older versions)
are read too.

A sync happens every ``sync_rows`` appended rows or ``sync_s`` seconds (whichever comes first, only
when rows are pending) from a background thread, so appends never wait on the network, and
synchronously on :meth:`close` (a clean stop), which raises :class:`~dflash_assets.storage.store.StorageError`
if storage stays unreachable through the retries. A failed background sync is logged and retried at
the next trigger; its rows stay in the local journal.

When the local file is missing (a fresh machine, a wiped scratch disk), it is rebuilt from the
segments before the run reads it, so a run resumes from storage.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import threading
import time
from typing import Any

from dflash_assets.generation.rows.journal import FILE_MODE, RowJournal
from dflash_assets.storage.atomic import atomic_write_bytes
from dflash_assets.storage.lock import writer_identity
from dflash_assets.storage.store import Storage, StorageError

__all__ = ["SyncedRowJournal", "segment_dir"]

log = logging.getLogger(__name__)
_SEGMENT = re.compile(r"^seg-(\d{6,})(?:-([A-Za-z0-9_.-]+))?\.jsonl$")
COMPACT_ABOVE = 64  # segments: above this, a fresh run uploads their union as one and deletes them


def segment_dir(parts: tuple[str, ...]) -> tuple[str, ...]:
    """Remote folder of the journal ``parts``: the file name without ``.jsonl``."""
    *head, name = parts
    return (*head, name.removesuffix(".jsonl"))


def _rows_from_bytes(data: bytes) -> dict[int, dict[str, Any]]:
    """Rows by index from journal bytes (same rules as :meth:`RowJournal.load`: last line wins, bad lines skipped)."""
    rows: dict[int, dict[str, Any]] = {}
    for line in data.split(b"\n"):
        try:
            row = json.loads(line) if line.strip() else None
        except (ValueError, RecursionError):
            continue
        index = row.get("index") if isinstance(row, dict) else None
        if isinstance(index, int) and not isinstance(index, bool):
            rows[index] = row
    return rows


def _segment_name(seq: int) -> str:
    return f"seg-{seq:06d}-{writer_identity()}.jsonl"


class SyncedRowJournal(RowJournal):
    """Row journal at ``path`` (local), synced to ``storage`` under :func:`segment_dir` of ``parts``.

    Same interface as :class:`RowJournal` (``append``, ``append_many``, ``load``, ``done_indices``,
    ``close``, ``discard``); rows are durable locally when ``append`` returns, and on storage after
    the next sync.

    Args:
        path: local journal file (scratch disk).
        storage: where the segments go (any :class:`Storage`; S3 in practice).
        parts: the journal's path under the storage root, e.g. ``("completions", "<pk>.journal.jsonl")``.
        sync_rows: sync after this many appended rows (>= 1).
        sync_s: sync at least this often while rows are pending, seconds (> 0).

    Attributes:
        syncs: segments uploaded by this object.
        synced_bytes: bytes of the local file known to be on storage.
        last_sync_error: the last background sync error (``None`` after a successful sync).

    Raises:
        StorageError: storage unreachable through the retries while seeding the local file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        storage: Storage,
        parts: tuple[str, ...],
        sync_rows: int = 100,
        sync_s: float = 30.0,
    ) -> None:
        super().__init__(path)
        if sync_rows < 1 or sync_s <= 0:
            raise ValueError(f"sync_rows must be >= 1 and sync_s > 0, got {sync_rows}, {sync_s}")
        self.storage = storage
        self.remote_dir = segment_dir(tuple(parts))
        self.sync_rows, self.sync_s = sync_rows, sync_s
        self.syncs = 0
        self.synced_bytes = 0
        self.last_sync_error: BaseException | None = None
        self._next_seq = 1
        self._pending_rows = 0
        self._last_sync = time.monotonic()
        self._retry_after = 0.0  # after a failed background sync: no new try before this (monotonic s)
        self._sync_lock = threading.Lock()  # one upload at a time; keeps segment numbers in order
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._seed()

    def __repr__(self) -> str:
        return f"SyncedRowJournal({str(self.path)!r} -> {self.storage.uri(*self.remote_dir)!r})"

    # -- remote segments ------------------------------------------------------------------------

    def _segments(self) -> list[tuple[int, str]]:
        """Every writer's segments as ``(number, name)``, by number then writer."""
        names = self.storage.listdir(*self.remote_dir)
        found = [(int(m.group(1)), m.group(2) or "", n) for n in names if (m := _SEGMENT.match(n))]
        return [(seq, name) for seq, _, name in sorted(found)]

    def remote_bytes(self) -> bytes:
        """The synced journal: every segment concatenated in order (b"" when none)."""
        chunks = []
        for _, name in self._segments():
            data = self.storage.read_bytes(*self.remote_dir, name)
            chunks.append(data if not data or data.endswith(b"\n") else data + b"\n")
        return b"".join(chunks)

    def _seed(self) -> None:
        """Reconcile the local file with the segments (rebuild it on an empty disk)."""
        segments = self._segments()
        self._next_seq = segments[-1][0] + 1 if segments else 1
        if not segments:
            return  # anything local is unsynced; the first sync uploads it
        remote = self.remote_bytes()
        local = self.path.read_bytes() if self.path.exists() else None
        if local is None:
            atomic_write_bytes(self.path, remote, mode=FILE_MODE)
            self.synced_bytes = len(remote)
            if len(segments) > COMPACT_ABOVE:
                self._compact(segments, remote)
            return
        if local.startswith(remote):
            self.synced_bytes = len(remote)  # the usual case: this machine's own earlier run
            return
        if remote.startswith(local):  # another machine carried on from this one's rows
            atomic_write_bytes(self.path, remote, mode=FILE_MODE)
            self.synced_bytes = len(remote)
            return
        # Local and remote diverged (another machine ran the partition meanwhile): keep the union,
        # local rows winning for indices both hold, and replace the segments with it.
        local_rows = self.load()
        extra = [row for index, row in _rows_from_bytes(remote).items() if index not in local_rows]
        if extra:
            self.append_many_local(extra)
        self._compact(segments, self.path.read_bytes())

    def _compact(self, old: list[tuple[int, str]], data: bytes) -> None:
        """Upload ``data`` (whole lines) as one new segment, then delete ``old`` (union first: no loss)."""
        name = _segment_name(self._next_seq)
        self.storage.write_bytes(data, *self.remote_dir, name)
        self._next_seq += 1
        self.synced_bytes = len(data)
        for _, old_name in old:
            self.storage.remove(*self.remote_dir, old_name)

    # -- writing --------------------------------------------------------------------------------

    def append_many_local(self, rows: list[dict[str, Any]]) -> int:
        """Append to the local file only (no sync trigger)."""
        return super().append_many(rows)

    def append_many(self, rows) -> int:
        """Append rows locally (fsync'd, durable on return) and schedule a sync. See :class:`RowJournal`."""
        n = super().append_many(rows)
        if n:
            with self._wake:
                self._pending_rows += n
                if self._thread is None:
                    self._stop = False
                    # a stop that unwinds the process without reaching close() still syncs (SIGTERM
                    # becomes an exception in Dagster's run worker, and the interpreter exits normally)
                    atexit.register(self._sync_at_exit)
                    self._thread = threading.Thread(
                        target=self._run, name=f"journal-sync:{self.path.name}", daemon=True
                    )
                    self._thread.start()
                if self._pending_rows >= self.sync_rows:
                    self._wake.notify_all()
        return n

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stop:
                    now = time.monotonic()
                    due = max(self._last_sync + self.sync_s, self._retry_after)
                    if now >= self._retry_after and (
                        self._pending_rows >= self.sync_rows or (self._pending_rows and now >= due)
                    ):
                        break
                    self._wake.wait(timeout=max(0.01, due - now) if self._pending_rows else self.sync_s)
                if self._stop:
                    return
            try:
                self.sync()
            except Exception as exc:  # retried at the next trigger; the rows are safe locally
                self.last_sync_error = exc
                with self._wake:
                    self._retry_after = time.monotonic() + self.sync_s  # a full interval before the next try
                log.warning(
                    "journal sync to %s failed (rows kept locally, will retry): %s",
                    self.storage.uri(*self.remote_dir),
                    exc,
                )

    def _unsynced_tail(self) -> bytes:
        """Local bytes after :attr:`synced_bytes`, cut after the last complete line."""
        with self._lock:  # no append is half-way through while we read
            try:
                with open(self.path, "rb") as f:
                    f.seek(self.synced_bytes)
                    data = f.read()
            except FileNotFoundError:
                return b""
        end = data.rfind(b"\n")
        return data[: end + 1] if end >= 0 else b""

    def sync(self) -> int:
        """Upload the lines appended since the last sync as the next segment; returns bytes uploaded.

        Raises:
            StorageError: storage still unreachable after the retries (nothing is lost: the rows stay
                local and the next sync uploads them).
        """
        with self._sync_lock:
            with self._wake:
                pending_before = self._pending_rows
            tail = self._unsynced_tail()
            if tail:
                self.storage.write_bytes(tail, *self.remote_dir, _segment_name(self._next_seq))
                self._next_seq += 1
                self.synced_bytes += len(tail)
                self.syncs += 1
            with self._wake:
                self._pending_rows = max(0, self._pending_rows - pending_before)
                self._last_sync = time.monotonic()
            self.last_sync_error = None
            return len(tail)

    def _sync_at_exit(self) -> None:
        try:
            self.close()
        except Exception as exc:
            log.warning(
                "final journal sync to %s failed at exit (rows kept locally): %s",
                self.storage.uri(*self.remote_dir),
                exc,
            )

    def _stop_thread(self) -> None:
        atexit.unregister(self._sync_at_exit)
        with self._wake:
            self._stop = True
            self._wake.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def close(self) -> None:
        """Stop the sync thread, upload what is pending and close the file (a clean stop).

        Raises:
            StorageError: the final sync failed after the retries; the rows stay in the local journal.
        """
        self._stop_thread()
        try:
            self.sync()
        finally:
            super().close()

    def discard(self) -> None:
        """Delete the local file and the remote segments (their rows are in the finished table).

        A remote delete that fails is logged, not raised: leftover segments hold the same rows as the
        table, so a later run that reads them changes nothing.
        """
        self._stop_thread()
        super().discard()
        try:
            self.storage.remove(*self.remote_dir, recursive=True)
        except (StorageError, OSError) as exc:
            log.warning("could not delete journal segments %s: %s", self.storage.uri(*self.remote_dir), exc)
        self.synced_bytes = 0
