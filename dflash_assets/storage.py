"""One storage layer for every stage: a local directory or ``s3://bucket/prefix`` through fsspec.

Every write is atomic from a reader's view: local files are written to a temporary name in the same
directory, fsynced and renamed; S3 objects are uploaded whole (a PUT is never visible half-written).
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import tempfile
import uuid
from typing import Any

import fsspec
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq


class Storage:
    """Paths under one root, with atomic writes.

    Args:
        root: local directory or ``s3://bucket/prefix``.
        storage_options: fsspec options (for S3: ``key``, ``secret``, ``client_kwargs`` ...).
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None):
        self.root = root.rstrip("/")
        self.fs, self._root_path = fsspec.core.url_to_fs(self.root, **(storage_options or {}))
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.is_local = "file" in protocols

    def __repr__(self) -> str:
        return f"Storage({self.root!r})"

    def path(self, *parts: str) -> str:
        """Filesystem path (no protocol) of ``parts`` under the root."""
        return posixpath.join(self._root_path, *parts) if not self.is_local else os.path.join(self._root_path, *parts)

    def uri(self, *parts: str) -> str:
        """Full URI of ``parts`` under the root, for metadata and messages."""
        return posixpath.join(self.root, *parts) if not self.is_local else self.path(*parts)

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.path(*parts))

    def listdir(self, *parts: str) -> list[str]:
        """Base names directly under ``parts`` (empty when the folder does not exist)."""
        p = self.path(*parts)
        if not self.fs.exists(p):
            return []
        return sorted(posixpath.basename(x.rstrip("/")) for x in self.fs.ls(p, detail=False))

    def remove(self, *parts: str, recursive: bool = False) -> None:
        p = self.path(*parts)
        if self.fs.exists(p):
            self.fs.rm(p, recursive=recursive)

    def read_bytes(self, *parts: str) -> bytes:
        with self.fs.open(self.path(*parts), "rb") as f:
            return f.read()

    def write_bytes(self, data: bytes, *parts: str) -> str:
        """Write ``data`` atomically; returns the URI."""
        p = self.path(*parts)
        if self.is_local:
            atomic_write_local(p, data)
        else:
            self.fs.pipe_file(p, data)
        return self.uri(*parts)

    def read_json(self, *parts: str) -> Any:
        return json.loads(self.read_bytes(*parts))

    def write_json(self, obj: Any, *parts: str) -> str:
        return self.write_bytes(json.dumps(obj, indent=2, sort_keys=True, default=str).encode(), *parts)

    def read_parquet(self, *parts: str) -> pl.DataFrame:
        return pl.from_arrow(pq.read_table(io.BytesIO(self.read_bytes(*parts))))

    def write_parquet(self, df: pl.DataFrame | pa.Table, *parts: str) -> str:
        """Write a table as Parquet, atomically and deterministically (same table -> same bytes)."""
        table = df.to_arrow() if isinstance(df, pl.DataFrame) else df
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd", write_statistics=True)
        return self.write_bytes(buf.getvalue(), *parts)


def atomic_write_local(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a fsynced temp file in the same directory and ``os.replace``."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=f".{uuid.uuid4().hex[:6]}.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
