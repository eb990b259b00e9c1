"""Row-level checkpoint: an append-only JSON-lines file keyed by prompt ``index``.

Every finished row is appended as one line and made durable at once (``write`` + ``flush`` +
``os.fsync``), so a kill at any moment loses no row whose :meth:`RowJournal.append` returned, and the
worst a crash mid-write leaves is one torn last line, which :meth:`RowJournal.load` skips (and
counts). Resuming is by index, never by counting lines (rows finish out of order) nor by prompt
text (duplicate prompts are distinct rows): later lines win for the same index, so a row redone
after a cap change simply supersedes the old one.

An append that fails (disk full, I/O error) stops the journal: the partial line is cut off again
(``ftruncate`` to the size before the append) and every later append raises :class:`JournalError`, so a
full disk can never leave later rows glued to a partial line and lost while their appends returned. A
partial line that could not be cut off is never read as a row (a strict prefix of a JSON object is not
JSON). The file is created ``0600``: it holds generated text and prompts.

The file stays local (``path``); a wrapper can sync it to S3 between appends.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dflash_assets.storage.atomic import fsync_dir

__all__ = ["JournalError", "RowJournal"]

FILE_MODE = 0o600  # owner only: in-flight rows are the run's data, not every local user's


class JournalError(OSError):
    """An append failed, or the journal stopped after an earlier one failed; the message names the file,
    the cause and the fix. Rows whose append returned before are durable; the failed batch is not."""


class RowJournal:
    """Append-only, fsync'd JSON-lines journal of rows, each a JSON object with an integer ``"index"``.

    Appends are thread-safe within one process (a lock); one process should own a journal file at a
    time (the asset run that holds the partition).

    Args:
        path: the journal file (created, with its parent directories, on first append).

    Attributes:
        path: the journal file.
        skipped_lines: lines the last :meth:`load` could not use (torn last line after a crash,
            undecodable JSON, or objects without an integer ``index``).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.skipped_lines = 0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._failed: str | None = None  # why appends stopped (set by a failed append)

    def __repr__(self) -> str:
        return f"RowJournal({str(self.path)!r})"

    # -- writing --------------------------------------------------------------------------------

    def _open(self) -> int:
        """Open for appending; if a crash left a torn last line, end it so the next row starts clean."""
        if self._fd is not None:
            return self._fd
        self.path.parent.mkdir(parents=True, exist_ok=True)
        existed = self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # a journal an older version created world-readable
            size = os.fstat(fd).st_size
            if size:
                with open(self.path, "rb") as fh:
                    fh.seek(size - 1)
                    if fh.read(1) != b"\n":
                        # Without this the next row would be glued onto the torn line and lost with it.
                        os.write(fd, b"\n")
                        os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        if not existed:  # the new file's directory entry must survive a crash too
            fsync_dir(self.path.parent)
        self._fd = fd
        return fd

    @staticmethod
    def _encode(row: dict[str, Any]) -> bytes:
        index = row.get("index") if isinstance(row, dict) else None
        if not isinstance(index, int) or isinstance(index, bool):
            raise ValueError(f"journal rows need an integer 'index', got {index!r}")
        line = json.dumps(row, ensure_ascii=False, separators=(",", ":"))
        return line.encode("utf-8") + b"\n"

    def append(self, row: dict[str, Any]) -> None:
        """Write ``row`` as one line and fsync it: durable when this returns.

        Raises:
            ValueError: ``row`` has no integer ``"index"``.
            TypeError: ``row`` holds a value JSON cannot encode.
            UnicodeEncodeError: ``row`` holds a lone surrogate (nothing is written; the journal goes on).
            JournalError: the write or fsync failed (e.g. disk full): the row is not durable and the journal
                takes no more rows; or it had stopped already after such a failure.
        """
        self.append_many([row])

    def append_many(self, rows: Iterable[dict[str, Any]]) -> int:
        """Write several rows with one write + fsync (cheaper than one fsync per row).

        Returns:
            number of rows written.

        Raises:
            the same as :meth:`append`; nothing is written when any row fails to encode.
        """
        data = b"".join(self._encode(row) for row in rows)
        if not data:
            return 0
        with self._lock:
            if self._failed is not None:
                raise JournalError(
                    f"journal {self.path} takes no more rows: an earlier append failed "
                    f"({self._failed}); fix that and rerun (rows appended before it are kept)"
                )
            fd = self._open()
            start = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:  # os.write may write less than asked (signals, huge buffers)
                    written = os.write(fd, view)
                    view = view[written:]
                os.fsync(fd)
            except OSError as exc:
                self._failed = f"{type(exc).__name__}: {exc}"
                self._cut_back(fd, start)
                raise JournalError(
                    exc.errno,
                    f"appending to journal {self.path} failed ({exc}); it takes no "
                    "more rows. Free space on (or fix) the disk it is on and rerun: rows appended "
                    "before this batch are durable, this batch is not",
                ) from exc
        return data.count(b"\n")

    def _cut_back(self, fd: int, size: int) -> None:
        """After a failed append, remove what it wrote (a partial line must not be glued to a later row).
        Best effort: if even this fails, the torn line stays and :meth:`load` skips it (never a row)."""
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        except OSError as exc:
            self._failed += f"; the partial line could not be cut off ({exc})"

    def close(self) -> None:
        """Close the file handle (appending again reopens it)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def discard(self) -> None:
        """Close and delete the journal (its rows are now in the finished partition table)."""
        self.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> RowJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading --------------------------------------------------------------------------------

    def load(self) -> dict[int, dict[str, Any]]:
        """All rows by index; for an index written several times the last line wins.

        A missing file is an empty journal. Lines that are torn (a crash mid-append), not valid JSON,
        or not objects with an integer ``index`` are skipped and counted in :attr:`skipped_lines`.
        """
        rows: dict[int, dict[str, Any]] = {}
        skipped = 0
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            self.skipped_lines = 0
            return rows
        for line in data.split(b"\n"):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, a line nested too deep
                skipped += 1
                continue
            index = row.get("index") if isinstance(row, dict) else None
            if not isinstance(index, int) or isinstance(index, bool):
                skipped += 1
                continue
            rows[index] = row
        self.skipped_lines = skipped
        return rows

    def done_indices(self, predicate: Callable[[dict[str, Any]], bool] | None = None) -> set[int]:
        """Indices whose latest row satisfies ``predicate`` (default: every row present).

        Example: ``journal.done_indices(lambda r: r.get("error") is None)`` leaves failed rows to redo.
        """
        rows = self.load()
        if predicate is None:
            return set(rows)
        return {index for index, row in rows.items() if predicate(row)}

    def size_bytes(self) -> int:
        """Current file size in bytes (0 when the file does not exist)."""
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0
