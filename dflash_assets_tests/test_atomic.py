"""dflash_assets.storage.atomic: old content survives a failing writer and a kill -9 mid-write; fsync order;
concurrent writers never share a temp file."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from dflash_assets.storage import atomic
from dflash_assets.storage.atomic import atomic_write_bytes, fsync_dir

ROOT = Path(__file__).resolve().parent.parent


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_bytes_and_writer_forms_replace_the_file_and_create_parents(tmp_path):
    path = tmp_path / "a" / "b" / "out.bin"
    atomic_write_bytes(path, b"first")
    assert path.read_bytes() == b"first"
    atomic_write_bytes(str(path), lambda f: (f.write(b"sec"), f.write(memoryview(b"ond"))))
    assert path.read_bytes() == b"second"
    atomic_write_bytes(path, bytearray(b""))
    assert path.read_bytes() == b""
    assert leftovers(path.parent) == []


def test_failing_writer_leaves_old_content_and_no_temp_file(tmp_path):
    path = tmp_path / "data.json"
    path.write_bytes(b'{"old": true}')

    def writer(f):
        f.write(b'{"new": ')  # half a file, then the producer fails
        raise RuntimeError("producer failed")

    with pytest.raises(RuntimeError, match="producer failed"):
        atomic_write_bytes(path, writer)
    assert path.read_bytes() == b'{"old": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.json"]


def test_file_is_fsynced_before_rename_and_directory_after(tmp_path, monkeypatch):
    path = tmp_path / "out.bin"
    path.write_bytes(b"old")
    calls: list[tuple[bool, bytes]] = []
    real_fsync = os.fsync

    def spy(fd):
        calls.append((stat.S_ISDIR(os.fstat(fd).st_mode), path.read_bytes()))
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", spy)
    atomic_write_bytes(path, b"new")
    # file fsync while the destination still holds the old bytes, then the directory after the rename
    assert calls == [(False, b"old"), (True, b"new")]


def test_fsync_dir_is_best_effort(tmp_path):
    fsync_dir(tmp_path)
    fsync_dir(tmp_path / "missing")  # cannot be opened: skipped, no error


def test_concurrent_writers_do_not_collide(tmp_path):
    path = tmp_path / "shared.bin"
    payloads = [bytes([k]) * (64 * 1024 + k) for k in range(6)]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for _ in range(15):
                atomic_write_bytes(path, payloads[k])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # With one temp name per process, two threads would write into the same temp file (mixed bytes)
    # or rename it away from under each other (FileNotFoundError).
    assert errors == []
    assert path.read_bytes() in payloads
    assert leftovers(tmp_path) == []


CHILD = textwrap.dedent(
    """
    import sys, time
    from dflash_assets.storage.atomic import atomic_write_bytes

    def writer(f):
        chunk = b"N" * (1 << 20)
        for _ in range(8):
            f.write(chunk)
        f.flush()
        print("WRITING", flush=True)
        for _ in range(2000):  # keeps writing until killed
            f.write(chunk)
            time.sleep(0.01)

    atomic_write_bytes(sys.argv[1], writer)
    print("DONE", flush=True)
    """
)


def test_kill_9_mid_write_keeps_old_content(tmp_path):
    path = tmp_path / "big.bin"
    old = os.urandom(1 << 20)
    path.write_bytes(old)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        line = child.stdout.readline()
        assert line.strip() == "WRITING", line + child.stderr.read()
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert path.read_bytes() == old
    # The killed writer's temp file is the only trace: named after its pid, partly written, never read.
    (tmp,) = leftovers(tmp_path)
    assert tmp.startswith(f".big.bin.{child.pid}.")
    assert (tmp_path / tmp).stat().st_size >= 8 << 20
