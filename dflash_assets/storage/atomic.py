"""Crash-safe local file writes (no Dagster, no torch: usable from every subpackage).

:func:`atomic_write_bytes` writes to a temporary file in the destination's directory, fsyncs it,
renames it over the destination with ``os.replace`` (atomic on POSIX within one filesystem) and
fsyncs the directory so the rename itself survives a power loss. A reader, or a process killed at
any moment (even ``kill -9``), sees the old file or the new one, never a part. The temporary name is
``.<name>.<pid>.<random>.tmp``: it holds the pid and a random part, so concurrent writers (processes
or threads) never share one, and it is removed when the write fails. Only ``kill -9`` or a power loss
can leave one behind; it starts with a dot, ends with ``.tmp`` and is never read as the file.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import IO

__all__ = ["atomic_write_bytes", "fsync_dir", "fsync_file", "temp_name_parts", "temp_path"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync ``directory`` so a file created or renamed in it stays after a crash (POSIX).

    Best effort: a platform or filesystem that cannot open or fsync directories (an ``OSError``) is
    skipped silently, since the data itself is already written.
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync the file at ``path`` (written by another writer: a library's ``save_file``, a download) so
    that its bytes are on disk before it is renamed into place.

    Raises:
        OSError: the file cannot be opened or fsynced (e.g. it is gone).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: str | os.PathLike[str]) -> str:
    """The temporary name :func:`atomic_write_bytes` uses for ``path``: ``<dir>/.<name>.<pid>.<hex8>.tmp``."""
    directory, name = os.path.split(os.fspath(path))
    return os.path.join(directory, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def temp_name_parts(temp_name: str) -> tuple[str, int] | None:
    """The destination's file name and the writer's pid of a :func:`temp_path` file name; None for another name."""
    if not (temp_name.startswith(".") and temp_name.endswith(".tmp")):
        return None
    parts = temp_name[1 : -len(".tmp")].rsplit(".", 2)
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def atomic_write_bytes(
    path: str | os.PathLike[str],
    data: bytes | bytearray | memoryview | Callable[[IO[bytes]], object],
    mode: int | None = None,
) -> None:
    """Replace ``path`` atomically with ``data``, or with what ``data(f)`` writes to a binary file ``f``.

    Steps: create the parent directories; write a temp file in the same directory (see
    :func:`temp_path`); flush and ``os.fsync`` it; ``os.replace`` it over ``path``; :func:`fsync_dir`
    the directory. The writer form streams large outputs (a multi-GB shard, ``torch.save``) without
    building them in memory; its return value is ignored. ``mode``: the file's permissions from its
    creation on (e.g. ``0o600``: never readable by others, not even as the temp file); None: the default
    (``0o666`` less the umask).

    Raises:
        OSError: creating, writing, fsyncing or renaming failed (e.g. disk full); ``path`` is unchanged
            and the temp file is removed.
        Exception: whatever the writer raises, after the same clean-up.
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        with open(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)
