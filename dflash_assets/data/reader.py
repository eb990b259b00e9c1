"""Prompt files read as a stream of records, in bounded memory (no Dagster imports).

A file is never read whole: JSONL is split on ``\\n`` as its (gunzipped) bytes arrive, a JSON array is cut
into its elements by a scanner that follows strings and brackets (so each element is decoded alone, and
one bad element costs one row), and Parquet is read a batch of rows at a time. Memory is about one record
plus one read chunk (Parquet: a row group's compressed bytes and one batch), whatever the file's size.

Two bounds (:class:`ReadLimits`) refuse what is not a prompt file, naming the file, the bound and the fix:
a record (JSONL line, JSON-array element) longer than ``max_record_bytes`` (a gzip of zeros, a file with
no newlines), and more than ``max_file_bytes`` of content in one file (after gunzip; Parquet: the
uncompressed size its footer declares). A file that cannot be read to its end (corrupt or truncated gzip,
a damaged Parquet file) fails naming the file and the byte where reading stopped.

Each record comes out as a :class:`RawRecord`: the decoded value, or the reason it could not be decoded
(bad UTF-8, bad JSON, nested too deep) with a preview of its text: a bad record never raises.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import re
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import fsspec
import pyarrow.parquet as pq

MiB = 1 << 20
GiB = 1 << 30
CHUNK_BYTES = 1 * MiB  # one read from the (gunzipped) file
PARQUET_BATCH_ROWS = 1024
PREVIEW_CHARS = 300
JSON_WHITESPACE = re.compile(rb"[ \t\r\n]*")
_WHITESPACE = frozenset(b" \t\r\n")
_STRUCTURE = re.compile(rb'[\[\]{}"]')
_SCALAR_END = re.compile(rb"[,\]\s]")
BOM = b"\xef\xbb\xbf"


class FileError(ValueError):
    """A prompt file cannot be read at all (missing, damaged, over a bound, not of a known type)."""


@dataclass(frozen=True)
class ReadLimits:
    """Bounds on one prompt file. ``setting``: where a user raises them (named in the errors).

    Attributes:
        max_record_bytes: longest JSONL line / JSON-array element, bytes (default 16 MiB: ~4M tokens,
            far past any context length).
        max_file_bytes: most content bytes one file may hold after gunzip (Parquet: uncompressed size
            from its footer), bytes (default 64 GiB).
    """

    max_record_bytes: int = 16 * MiB
    max_file_bytes: int = 64 * GiB
    setting: str = "ops.prompt_corpus.config"

    def record_bound(self) -> str:
        return f"{_size(self.max_record_bytes)} ({self.setting}.max_record_mb)"

    def file_bound(self) -> str:
        return f"{_size(self.max_file_bytes)} ({self.setting}.max_file_gb)"


@dataclass(frozen=True)
class RawRecord:
    """One record of a file. ``line``: 1-based JSONL line, JSON-array element or Parquet row number.
    ``value``: the decoded record (None when ``error`` is set); ``error``: why it could not be decoded;
    ``preview``: up to 300 characters of its source text (valid UTF-8; None for Parquet rows)."""

    line: int
    value: Any
    error: str | None
    preview: str | None


def _size(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:g} GiB"
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n:,} bytes"


def _kind(exc: BaseException) -> str:
    """``zlib.error`` rather than a bare ``error``."""
    module = type(exc).__module__
    return type(exc).__name__ if module in ("builtins", "gzip") else f"{module}.{type(exc).__name__}"


def preview(raw: bytes | str) -> str:
    """The first 300 characters of ``raw`` as valid UTF-8 (bad bytes and lone surrogates escaped)."""
    if isinstance(raw, bytes):
        raw = raw[: PREVIEW_CHARS * 4].decode("utf-8", "backslashreplace")
    return raw.encode("utf-8", "backslashreplace").decode("utf-8")[:PREVIEW_CHARS]


def decode_json(raw: bytes) -> tuple[Any, str | None]:
    """``(value, None)``, or ``(None, reason)`` for bytes that are not UTF-8 or not one JSON value."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8: byte {exc.start + 1} of the record is not UTF-8"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON: {json_error_text(exc)}"
    except RecursionError:
        return None, "too deeply nested: the record nests more levels than the JSON reader allows"
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits
        return None, f"invalid JSON: {exc}"


def json_error_text(exc: json.JSONDecodeError) -> str:
    """``"<message> at column N"``: json's messages such as "Unterminated string starting at" already end
    with "at", which is not repeated ("Unterminated string starting at column 7", "Expecting value at column 1")."""
    msg = exc.msg.removesuffix(" at")
    return f"{msg} at column {exc.colno}"


class _Stream:
    """A file's content as a growing buffer: ``buf[pos:]`` is read but not consumed; :meth:`fill` reads the
    next chunk (and drops the consumed part), False at the end of the file."""

    def __init__(self, path: str, f: IO[bytes], limits: ReadLimits) -> None:
        self.path, self._f, self.limits = path, f, limits
        self.buf = bytearray()
        self.pos = 0
        self.consumed = 0  # content bytes before buf[0]
        self.eof = False

    @property
    def offset(self) -> int:
        """Content byte offset of ``buf[pos]`` (0-based)."""
        return self.consumed + self.pos

    def fill(self) -> bool:
        if self.eof:
            return False
        try:
            chunk = self._f.read(CHUNK_BYTES)
        except (OSError, EOFError, zlib.error) as exc:  # corrupt or truncated gzip, I/O error
            raise FileError(
                f"{self.path}: cannot read the file past byte {self.consumed + len(self.buf):,} of its content "
                f"({_kind(exc)}: {exc}); the file is damaged or cut short: fix or fetch it again, or "
                "remove it from the sources"
            ) from None
        if not chunk:
            self.eof = True
            return False
        if self.pos:
            del self.buf[: self.pos]
            self.consumed += self.pos
            self.pos = 0
        self.buf += chunk
        if self.consumed + len(self.buf) > self.limits.max_file_bytes:
            raise FileError(
                f"{self.path}: more than {self.limits.file_bound()} of content; a prompt file this large "
                "is damaged or a decompression bomb: split it into several files (a directory or glob is "
                f"one source), or raise {self.limits.setting}.max_file_gb"
            )
        return True

    def skip_whitespace(self) -> int:
        """Move past JSON whitespace (across chunks); returns the newlines passed. At the end of the file
        ``pos == len(buf)`` afterwards."""
        newlines = 0
        while True:
            if self.pos < len(self.buf) and self.buf[self.pos] not in _WHITESPACE:
                return newlines  # the usual case: a record starts here
            if self.pos == 0 and not self.buf.strip(b" \t\r\n"):  # a chunk of blank lines: C speed
                newlines += self.buf.count(b"\n")
                self.pos = len(self.buf)
                if self.fill():
                    continue
                return newlines
            end = JSON_WHITESPACE.match(self.buf, self.pos).end()
            newlines += self.buf.count(b"\n", self.pos, end)
            self.pos = end
            if self.pos < len(self.buf) or not self.fill():
                return newlines

    def too_long(self, what: str) -> FileError:
        return FileError(
            f"{self.path}: {what} is longer than {self.limits.record_bound()}; no prompt record is this long: "
            "the file is damaged, is not one record per line (JSONL) or per array element, or is a decompression "
            f"bomb. Fix the file, or raise {self.limits.setting}.max_record_mb if the record is real"
        )


def _jsonl(stream: _Stream) -> Iterator[RawRecord]:
    """Records of a JSONL stream: split on ``\\n`` only (U+2028, U+2029 and U+0085 are legal inside JSON
    strings), a ``\\r`` before it dropped; blank lines skipped however many there are."""
    line = 1
    while True:
        line += stream.skip_whitespace()
        if stream.pos >= len(stream.buf):
            return
        scan = stream.pos
        while (end := stream.buf.find(b"\n", scan)) < 0:
            if len(stream.buf) - stream.pos > stream.limits.max_record_bytes:
                raise stream.too_long(f"line {line}")
            scan = len(stream.buf) - stream.pos
            if not stream.fill():
                end = len(stream.buf)
                break
            scan += stream.pos
        if end - stream.pos > stream.limits.max_record_bytes:
            raise stream.too_long(f"line {line}")
        raw = bytes(stream.buf[stream.pos : end]).rstrip(b"\r")
        stream.pos = min(end + 1, len(stream.buf))
        value, error = decode_json(raw)
        yield RawRecord(line, value, error, preview(raw))
        line += 1


def _json_array(stream: _Stream) -> Iterator[RawRecord]:
    """Records of a JSON array, element by element (``stream`` is at its ``[``).

    Raises:
        FileError: the array's structure is broken (a missing comma or bracket, text after it), an
            element never ends, or an element is longer than the record bound.
    """
    stream.pos += 1  # the "["
    element = 0
    while True:
        stream.skip_whitespace()
        if stream.pos >= len(stream.buf):
            raise _bad_array(stream, "the array is not closed by ']'")
        if element == 0 and stream.buf[stream.pos] == ord("]"):
            stream.pos += 1
            break
        element += 1
        raw = _element(stream, element)
        value, error = decode_json(raw)
        yield RawRecord(element, value, error, preview(raw))
        stream.skip_whitespace()
        if stream.pos >= len(stream.buf):
            raise _bad_array(stream, "the array is not closed by ']'")
        sep = stream.buf[stream.pos]
        stream.pos += 1
        if sep == ord("]"):
            break
        if sep != ord(","):
            raise _bad_array(stream, f"expected ',' or ']' after element {element}, found {chr(sep)!r}")
    stream.skip_whitespace()
    if stream.pos < len(stream.buf):
        raise _bad_array(stream, "text after the array's closing ']'")


def _bad_array(stream: _Stream, what: str) -> FileError:
    return FileError(
        f"{stream.path}: not a valid JSON array ({what}, at byte {stream.offset:,}); "
        "use JSONL to keep good lines of a damaged file"
    )


def _element(stream: _Stream, number: int) -> bytes:
    """Bytes of the array element at ``stream.pos`` (consumed): an object or array followed to its closing
    bracket through strings (escapes included), or a scalar up to the next ``,`` / ``]``. Nesting is only
    counted here, never recursed into, so a record nested 100,000 deep is one bad row, not a crash."""
    buf_start = stream.pos
    first = stream.buf[buf_start]

    def more(scan: int) -> int:
        """Read on; returns ``scan`` re-based on the buffer after a fill. Raises at the end or the bound."""
        if len(stream.buf) - stream.pos > stream.limits.max_record_bytes:
            raise stream.too_long(f"element {number} of the JSON array")
        rel = scan - stream.pos
        if not stream.fill():
            raise _bad_array(stream, f"element {number} never ends")
        return stream.pos + rel

    if first not in b'{["':
        scan = stream.pos
        while (m := _SCALAR_END.search(stream.buf, scan)) is None:
            if stream.eof:
                raise _bad_array(stream, f"element {number} never ends")
            scan = more(len(stream.buf))
        raw = bytes(stream.buf[stream.pos : m.start()])
        stream.pos = m.start()
        return raw
    depth, scan = 0, stream.pos
    while True:
        m = _STRUCTURE.search(stream.buf, scan)
        if m is None:
            scan = more(len(stream.buf))
            continue
        at = m.start()
        if stream.buf[at] == ord('"'):
            scan = at + 1
            while True:  # the closing quote: one not preceded by an odd number of backslashes
                q = stream.buf.find(b'"', scan)
                if q < 0:
                    scan = more(len(stream.buf))
                    continue
                k = q
                while k > stream.pos and stream.buf[k - 1] == 0x5C:
                    k -= 1
                if (q - k) % 2 == 0:
                    break
                scan = q + 1
            scan = q + 1
            if depth == 0:  # a top-level string element
                break
            continue
        depth += 1 if stream.buf[at] in b"[{" else -1
        scan = at + 1
        if depth <= 0:
            break
        if scan - stream.pos > stream.limits.max_record_bytes:
            raise stream.too_long(f"element {number} of the JSON array")
    if scan - stream.pos > stream.limits.max_record_bytes:
        raise stream.too_long(f"element {number} of the JSON array")
    raw = bytes(stream.buf[stream.pos : scan])
    stream.pos = scan
    return raw


class PromptFile:
    """The records of one prompt file (``.jsonl``, ``.json``, ``.parquet``, each optionally ``.gz``), read
    as a stream. Iterate it once for :class:`RawRecord` s in file order.

    A ``.json`` file whose content starts with ``[`` is one JSON array; any other ``.json`` file is read
    as JSONL. A UTF-8 byte-order mark at the start is dropped.

    Attributes (set while iterating): ``columns``: a Parquet file's column names (None otherwise).

    Raises (while iterating):
        FileError: the file cannot be opened, read to its end or parsed as a whole, is empty, is over a
            :class:`ReadLimits` bound, or is not of a known type.
    """

    def __init__(self, path: str, storage_options: dict | None = None, limits: ReadLimits | None = None) -> None:
        self.path = path
        self.options = storage_options or {}
        self.limits = limits or ReadLimits()
        self.columns: list[str] | None = None
        self.name = path[:-3] if path.endswith(".gz") else path
        if not self.name.endswith((".jsonl", ".json", ".parquet")):
            raise FileError(f"{path}: unknown file type; expected .jsonl, .json or .parquet (optionally .gz)")

    @contextlib.contextmanager
    def _open(self) -> Iterator[IO[bytes]]:
        try:
            with fsspec.open(self.path, "rb", **self.options) as raw:
                if self.path.endswith(".gz"):
                    with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                        yield f
                else:
                    yield raw
        except FileError:
            raise
        except OSError as exc:
            raise FileError(f"{self.path}: cannot read the file ({exc})") from None

    def __iter__(self) -> Iterator[RawRecord]:
        if self.name.endswith(".parquet"):
            yield from self._parquet()
            return
        with self._open() as f:
            stream = _Stream(self.path, f, self.limits)
            stream.fill()
            if stream.buf.startswith(BOM):
                stream.pos = len(BOM)  # a UTF-8 BOM is no content
            newlines = stream.skip_whitespace()
            if stream.pos >= len(stream.buf):
                size = stream.consumed + len(stream.buf)
                raise FileError(
                    f"{self.path}: the file is empty ({size} bytes{', only whitespace' if size else ''}); "
                    "no prompt to read"
                )
            if self.name.endswith(".json") and stream.buf[stream.pos] == ord("["):
                empty = True
                for record in _json_array(stream):
                    empty = False
                    yield record
                if empty:
                    raise FileError(f"{self.path}: the file is empty (an empty JSON array); no prompt to read")
                return
            for record in _jsonl(stream):
                yield RawRecord(record.line + newlines, record.value, record.error, record.preview)

    def _parquet(self) -> Iterator[RawRecord]:
        with self._open() as f, contextlib.ExitStack() as stack:
            source: IO[bytes] = f
            if self.path.endswith(".gz"):  # Parquet needs random access: gunzip to a temporary file first
                source = stack.enter_context(tempfile.TemporaryFile())
                stream = _Stream(self.path, f, self.limits)
                while stream.fill():
                    source.write(stream.buf)
                    stream.pos = len(stream.buf)
                source.seek(0)
            try:
                parquet = pq.ParquetFile(source)
            except Exception as exc:
                raise FileError(f"{self.path}: not a readable Parquet file ({exc})") from None
            meta = parquet.metadata
            self.columns = parquet.schema_arrow.names
            if meta.num_rows == 0:
                raise FileError(
                    f"{self.path}: the file is empty (a Parquet table with 0 rows; columns "
                    f"{self.columns}); no prompt to read"
                )
            declared = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
            if declared > self.limits.max_file_bytes:
                raise FileError(
                    f"{self.path}: its footer declares {_size(declared)} of uncompressed data, over "
                    f"{self.limits.file_bound()}: split it into several files, or raise "
                    f"{self.limits.setting}.max_file_gb"
                )
            row = 0
            try:
                for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                    try:
                        rows = [(r, None) for r in batch.to_pylist()]
                    except Exception:
                        rows = [_parquet_row(batch, k) for k in range(batch.num_rows)]
                    for value, error in rows:
                        row += 1
                        yield RawRecord(row, value, error, None)
            except FileError:
                raise
            except Exception as exc:
                raise FileError(
                    f"{self.path}: cannot read the Parquet file past row {row:,} ({type(exc).__name__}: "
                    f"{exc}); the file is damaged: fix or fetch it again, or remove it from the "
                    "sources"
                ) from None


def _parquet_row(batch: Any, k: int) -> tuple[Any, str | None]:
    try:
        return batch.slice(k, 1).to_pylist()[0], None
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8: a string value holds bytes that are not UTF-8 ({exc.reason})"
    except Exception as exc:
        return None, f"unreadable row: {type(exc).__name__}: {exc}"
