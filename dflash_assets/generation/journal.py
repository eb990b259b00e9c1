"""Row-level checkpoint: an append-only JSON-lines file keyed by prompt ``index``.

Every finished row is appended as one line and made durable at once (``write`` + ``flush`` +
``os.fsync``), so a kill at any moment loses no row whose :meth:`RowJournal.append` returned, and the
worst a crash mid-write leaves is one torn last line, which :meth:`RowJournal.load` skips (and
counts). Resuming is by index, never by counting lines (rows finish out of order) nor by prompt
text (duplicate prompts are distinct rows): later lines win for the same index, so a row redone
after a cap change simply supersedes the old one.

The file stays local (``path``); a wrapper can sync it to S3 between appends.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dflash_assets.atomic import fsync_dir

__all__ = ["RowJournal"]


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

    def __repr__(self) -> str:
        return f"RowJournal({str(self.path)!r})"

    # -- writing --------------------------------------------------------------------------------

    def _open(self) -> int:
        """Open for appending; if a crash left a torn last line, end it so the next row starts clean."""
        if self._fd is not None:
            return self._fd
        self.path.parent.mkdir(parents=True, exist_ok=True)
        existed = self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
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
            OSError: the write or fsync failed (e.g. disk full); the row is then not durable.
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
            fd = self._open()
            view = memoryview(data)
            while view:  # os.write may write less than asked (signals, huge buffers)
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        return data.count(b"\n")

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
            except ValueError:  # JSONDecodeError and UnicodeDecodeError
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
