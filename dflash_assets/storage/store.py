"""One storage layer for every stage: a local directory or ``s3://bucket/prefix`` through fsspec.

Every write is atomic from a reader's view: local files are written to a temporary name in the same
directory, fsynced and renamed; S3 objects are uploaded whole (a single PUT, or a multipart upload that
only becomes visible when it completes), so a reader sees the old object or the new one, never a part.

S3 calls that fail for a transient reason (endpoint unreachable, timeouts, throttling, 5xx) are
retried with exponential backoff and jitter (:class:`RetryPolicy`); when the attempts run out a
:class:`StorageError` names the operation and the object. Permanent errors (missing object, access
denied, no such bucket) are raised at once as the usual ``FileNotFoundError`` / ``PermissionError``.
Credentials live only inside the filesystem object; nothing here formats or logs them.

Names that come from storage (listings, a stored index's file names) are data: before one becomes part
of a local path it must be one plain path component (:func:`check_name`), and a download lands under a
temporary name and is moved into place only once its size and SHA-256 match what was expected.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import math
import os
import posixpath
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import tenacity

from dflash_assets.storage.atomic import atomic_write_bytes, fsync_dir, fsync_file, temp_path

__all__ = [
    "IntegrityError",
    "RetryPolicy",
    "Storage",
    "StorageError",
    "UnsafeNameError",
    "check_name",
    "is_transient",
    "parquet_bytes",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

# S3 error codes worth retrying: throttling and server-side trouble (AWS S3 error-code list).
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "OperationAborted",
    "500",
    "502",
    "503",
    "504",
    "429",
}
# What s3fs turns those codes into (s3fs.errors.ERROR_CODE_TO_EXCEPTION) when no botocore cause is kept.
_TRANSIENT_ERRNOS = {
    errno.EBUSY,
    errno.EREMOTEIO,
    errno.EAGAIN,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.EPIPE,
}


class StorageError(RuntimeError):
    """An S3 operation still failed after every retry. The message names the operation, the object URI,
    the attempts and seconds spent, and the last error (never credentials)."""


class UnsafeNameError(ValueError):
    """A storage key or a name read from storage that is not one plain path component."""


class IntegrityError(RuntimeError):
    """A downloaded object's size or SHA-256 differs from what was expected; nothing was put in place."""


def check_name(name: object, what: str) -> str:
    """``name`` when it is one plain path component: a non-empty string without ``/``, ``\\`` or NUL, not
    ``.`` or ``..`` (so not absolute either). ``what`` says where it came from, for the message.

    Raises:
        UnsafeNameError: naming ``what`` and the name (a stored index or key that could write outside the
            directory it belongs to).
    """
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0") or os.path.isabs(name):
        raise UnsafeNameError(
            f"{what}: {name!r} is not a plain file name (one path component: no '/', '\\', "
            "'..' or absolute path); it is not used. Re-materialize what wrote it"
        )
    return name


def file_sha256(path: str | os.PathLike[str], chunk: int = 8 * 2**20) -> str:
    """Hex SHA-256 of a file, read in ``chunk``-byte pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class RetryPolicy:
    """Retries for transient S3 errors: failed attempt ``k`` (1-based) is followed by a wait of
    ``min(max_wait_s, backoff_s * 2**(k-1) + U(0, backoff_s))`` seconds (exponential backoff with jitter).

    Attributes:
        attempts: total tries per operation (1 = no retry).
        backoff_s: first wait, seconds.
        max_wait_s: longest single wait, seconds.
    """

    attempts: int = 6
    backoff_s: float = 0.5
    max_wait_s: float = 30.0


def s3_error_code(exc: BaseException) -> str | None:
    """The S3 error code of a botocore ``ClientError`` (``"NoSuchKey"``, ``"PreconditionFailed"``), else its HTTP
    status as a string; None for an exception that carries no S3 response."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error") or {}
        code = err.get("Code")
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if code:
            return str(code)
        if status:
            return str(status)
    return None


def is_transient(exc: BaseException) -> bool:
    """True for errors a retry can cure: connection failures and timeouts, throttling, 5xx.

    Walks the ``__cause__`` chain because s3fs re-raises botocore errors as plain ``OSError``.
    ``FileNotFoundError``, ``PermissionError``, missing credentials and bad requests are permanent.
    """
    import botocore.exceptions as bex

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(
            current,
            (
                FileNotFoundError,
                PermissionError,
                FileExistsError,
                IsADirectoryError,
                NotADirectoryError,
                bex.NoCredentialsError,
                bex.PartialCredentialsError,
                bex.ParamValidationError,
            ),
        ):
            return False
        if isinstance(
            current,
            (
                TimeoutError,
                ConnectionError,
                bex.ConnectionError,
                bex.HTTPClientError,
                bex.ReadTimeoutError,
                bex.ResponseStreamingError,
            ),
        ):
            return True
        code = s3_error_code(current)
        if code is not None:
            return code in _TRANSIENT_CODES or code.startswith("5")
        if type(current).__module__.startswith("aiohttp") or type(current).__name__ == "FSTimeoutError":
            return True
        if isinstance(current, OSError) and current.errno in _TRANSIENT_ERRNOS:
            return True
        current = current.__cause__
    return False


class Storage:
    """Paths under one root, with atomic writes and (for S3) retried calls.

    Args:
        root: local directory or ``s3://bucket/prefix``.
        storage_options: fsspec options (for S3: ``key``, ``secret``, ``endpoint_url``,
            ``client_kwargs`` ...). Kept only inside the filesystem object, never logged.
        retry: retry policy for remote calls (local calls are not retried).
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None):
        self.root = root.rstrip("/")
        self.fs, self._root_path = fsspec.core.url_to_fs(self.root, **(storage_options or {}))
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.is_local = "file" in protocols
        self.retry = retry or RetryPolicy()

    def __repr__(self) -> str:
        return f"Storage({self.root!r})"

    def path(self, *parts: str) -> str:
        """Filesystem path (no protocol) of ``parts`` under the root."""
        return posixpath.join(self._root_path, *parts) if not self.is_local else os.path.join(self._root_path, *parts)

    def uri(self, *parts: str) -> str:
        """Full URI of ``parts`` under the root, for metadata and messages."""
        return posixpath.join(self.root, *parts) if not self.is_local else self.path(*parts)

    def call(self, op: str, parts: tuple[str, ...], fn: Callable[[], T]) -> T:
        """Run ``fn()``; on S3 retry transient errors per :attr:`retry`.

        Raises:
            StorageError: still failing after ``retry.attempts`` tries (names ``op`` and the object).
            Exception: a permanent error from ``fn`` as is (e.g. ``FileNotFoundError``).
        """
        if self.is_local:
            return fn()
        policy = self.retry
        started = time.monotonic()
        uri = self.uri(*parts)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "storage %s %s: %s; attempt %d/%d in %.1fs",
                op,
                uri,
                _describe(exc),
                state.attempt_number + 1,
                policy.attempts,
                state.upcoming_sleep,
            )

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(max(1, policy.attempts)),
            wait=tenacity.wait_exponential_jitter(
                multiplier=policy.backoff_s, max=policy.max_wait_s, jitter=policy.backoff_s
            ),
            retry=tenacity.retry_if_exception(is_transient),
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            return retrying(fn)
        except Exception as exc:
            if is_transient(exc):
                raise StorageError(
                    f"storage {op} {uri} failed after {policy.attempts} attempts over "
                    f"{time.monotonic() - started:.1f}s: {_describe(exc)}"
                ) from exc
            raise

    def exists(self, *parts: str) -> bool:
        return self.call("exists", parts, lambda: self.fs.exists(self.path(*parts)))

    def size(self, *parts: str) -> int:
        """Size in bytes. Raises FileNotFoundError when missing."""
        return int(self.call("size", parts, lambda: self.fs.size(self.path(*parts))))

    def listdir(self, *parts: str) -> list[str]:
        """Base names directly under ``parts`` (empty when the folder does not exist)."""
        p = self.path(*parts)

        def ls() -> list[str]:
            try:
                return sorted(posixpath.basename(x.rstrip("/")) for x in self.fs.ls(p, detail=False))
            except FileNotFoundError:
                return []

        if self.is_local and not os.path.isdir(p):
            return []
        return self.call("list", parts, ls)

    def remove(self, *parts: str, recursive: bool = False) -> None:
        """Delete a file (or a folder with ``recursive``); nothing happens when it does not exist."""
        p = self.path(*parts)

        def rm() -> None:
            try:
                self.fs.rm(p, recursive=recursive)
            except FileNotFoundError:
                pass

        if self.is_local and not os.path.lexists(p):
            return
        self.call("delete", parts, rm)

    def read_bytes(self, *parts: str) -> bytes:
        return self.call("get", parts, lambda: self.fs.cat_file(self.path(*parts)))

    def write_bytes(self, data: bytes, *parts: str) -> str:
        """Write ``data`` atomically (local rename / whole-object PUT); returns the URI."""
        p = self.path(*parts)
        if self.is_local:
            atomic_write_bytes(p, data)
        else:
            self.call("put", parts, lambda: self.fs.pipe_file(p, data))
        return self.uri(*parts)

    def upload(self, local_path: str | os.PathLike[str], *parts: str) -> str:
        """Copy a local file to ``parts`` without reading it into memory; atomic for readers (S3
        multipart uploads appear only on completion; local copies are renamed into place)."""
        p = self.path(*parts)
        if self.is_local:
            if os.path.abspath(local_path) != os.path.abspath(p):
                _atomic_copy_local(str(local_path), p)
        else:
            self.call("put", parts, lambda: self.fs.put_file(str(local_path), p))
        return self.uri(*parts)

    def download(
        self, local_path: str | os.PathLike[str], *parts: str, size: int | None = None, sha256: str | None = None
    ) -> str:
        """Copy ``parts`` to a local file: to a temporary name in its directory, checked against ``size``
        (bytes) and ``sha256`` (hex) when given, then renamed into place, so a crash or a mismatch leaves
        no file at ``local_path`` (an older copy there stays as it was).

        Raises:
            FileNotFoundError: the object is missing.
            IntegrityError: the copy's size or SHA-256 differs (naming the object and which).
        """
        local_path = str(local_path)
        directory = os.path.dirname(local_path) or "."
        os.makedirs(directory, exist_ok=True)
        tmp = temp_path(local_path)
        try:
            if self.is_local:
                if os.path.abspath(local_path) == os.path.abspath(self.path(*parts)):
                    return local_path
                with open(self.path(*parts), "rb") as inp, open(tmp, "xb") as out:
                    shutil.copyfileobj(inp, out, 1 << 20)
            else:
                self.call("get", parts, lambda: self.fs.get_file(self.path(*parts), tmp))
            fsync_file(tmp)  # the bytes are on disk before the name is: a crash leaves no empty file in place
            have = os.path.getsize(tmp)
            if size is not None and have != size:
                raise IntegrityError(f"{self.uri(*parts)}: downloaded {have} bytes, expected {size}; not put in place")
            if sha256 is not None and file_sha256(tmp) != sha256:
                raise IntegrityError(
                    f"{self.uri(*parts)}: downloaded copy's sha256 differs from the expected one; not put in place"
                )
            os.replace(tmp, local_path)
            fsync_dir(directory)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return local_path

    def read_json(self, *parts: str) -> Any:
        return json.loads(self.read_bytes(*parts))

    def write_json(self, obj: Any, *parts: str) -> str:
        """Write ``obj`` as strict JSON (RFC 8259: NaN and infinities become ``null``), atomically."""
        text = json.dumps(finite_json(obj), indent=2, sort_keys=True, default=str, allow_nan=False)
        return self.write_bytes(text.encode(), *parts)

    def read_parquet(
        self,
        *parts: str,
        columns: list[str] | tuple[str, ...] | None = None,
        index_ranges: list[tuple[int, int]] | None = None,
    ) -> pl.DataFrame:
        """A Parquet file under the root as a DataFrame, whole or in part.

        Args:
            columns: read only these column chunks (those the file has; the rest are skipped, not an
                error); None = every column.
            index_ranges: inclusive ``(first, last)`` ranges of the integer ``index`` column: only the
                row groups whose ``index`` statistics overlap one are read, then exactly the rows in a
                range are kept. None = every row.

        With either argument the file is opened through the filesystem and only the footer and the
        chunks wanted are fetched (on S3: ranged GETs), so a partition's 1,000 prompts cost one row
        group of the corpus, not the corpus (a 902K-prompt corpus is ~750 MB). Raises
        FileNotFoundError when the file is missing.
        """
        if columns is None and index_ranges is None:
            return pl.from_arrow(pq.read_table(io.BytesIO(self.read_bytes(*parts))))
        path = self.path(*parts)

        def read() -> pa.Table:
            # s3fs reads ahead in 50 MB blocks by default: a footer and a few chunks would fetch the file
            with self.fs.open(path, "rb", **({} if self.is_local else {"cache_type": "none"})) as f:
                parquet = pq.ParquetFile(f)
                names = parquet.schema_arrow.names
                wanted = names if columns is None else [c for c in columns if c in names]
                if index_ranges is None:
                    return parquet.read(columns=wanted)
                groups = row_groups_overlapping(parquet.metadata, "index", index_ranges)
                read_columns = wanted if "index" in wanted else ["index", *wanted]
                if not groups:
                    return parquet.schema_arrow.empty_table().select(read_columns)
                return parquet.read_row_groups(groups, columns=read_columns)

        frame = pl.from_arrow(self.call("get", parts, read))
        if index_ranges is not None:
            frame = frame.filter(pl.Series(in_ranges(frame["index"].to_numpy(), index_ranges)))
            if columns is not None and "index" not in columns:
                frame = frame.drop("index")
        return frame

    def write_parquet(self, df: pl.DataFrame | pa.Table, *parts: str, row_group_size: int | None = None) -> str:
        """Write a table as Parquet, atomically and deterministically (same table -> same bytes).
        ``row_group_size``: rows per row group (None: pyarrow's default, ~1M rows), so that
        :meth:`read_parquet` with ``index_ranges`` can read one group alone."""
        return self.write_bytes(parquet_bytes(df, row_group_size), *parts)


def merged_ranges(ranges: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Inclusive integer ``ranges`` merged where they overlap or touch, as sorted ``(firsts, lasts)``
    arrays: a run over every partition is one range, however many partitions it has."""
    firsts, lasts = [], []
    for first, last in sorted(ranges):
        if firsts and first <= lasts[-1] + 1:
            lasts[-1] = max(lasts[-1], last)
        else:
            firsts.append(first)
            lasts.append(last)
    return np.asarray(firsts, dtype=np.int64), np.asarray(lasts, dtype=np.int64)


def in_ranges(values: np.ndarray, ranges: list[tuple[int, int]]) -> np.ndarray:
    """Boolean mask of ``values`` inside one of the inclusive ``ranges`` (O(n log ranges))."""
    firsts, lasts = merged_ranges(ranges)
    if not len(firsts):
        return np.zeros(len(values), dtype=bool)
    at = np.searchsorted(firsts, values, side="right") - 1
    return (at >= 0) & (values <= lasts[np.maximum(at, 0)])


def row_groups_overlapping(metadata: pq.FileMetaData, column: str, ranges: list[tuple[int, int]]) -> list[int]:
    """Row groups of a Parquet file whose min/max statistics of integer ``column`` overlap one of the
    inclusive ``ranges``; a group without statistics is always included (it may hold such rows)."""
    # leaf columns, not arrow fields: a nested column before it (messages) takes several leaf positions
    position = next((j for j in range(metadata.num_columns) if metadata.schema.column(j).path == column), -1)
    firsts, lasts = merged_ranges(ranges)
    groups = []
    for g in range(metadata.num_row_groups):
        stats = metadata.row_group(g).column(position).statistics if position >= 0 else None
        if stats is None or not stats.has_min_max:
            groups.append(g)
            continue
        at = int(np.searchsorted(firsts, stats.max, side="right")) - 1  # the last range starting at or before max
        if at >= 0 and lasts[at] >= stats.min:
            groups.append(g)
    return groups


def parquet_bytes(df: pl.DataFrame | pa.Table, row_group_size: int | None = None) -> bytes:
    """The Parquet file :meth:`Storage.write_parquet` writes for ``df`` (zstd, statistics; deterministic)."""
    table = df.to_arrow() if isinstance(df, pl.DataFrame) else df
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", write_statistics=True, row_group_size=row_group_size)
    return buf.getvalue()


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, +-inf) replaced by None, in dicts, lists and tuples:
    Python's json writes them as bare ``NaN``/``Infinity``, which strict parsers (jq, JavaScript) reject."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def _describe(exc: BaseException | None) -> str:
    return "unknown error" if exc is None else f"{type(exc).__name__}: {exc}"


def _atomic_copy_local(src: str, dst: str) -> None:
    with open(src, "rb") as inp:
        atomic_write_bytes(dst, lambda out: shutil.copyfileobj(inp, out, 1 << 20))
