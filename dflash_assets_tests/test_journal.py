"""Row journal: durable appends, torn-line tolerance, later-lines-win, and a kill -9 mid-append loop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dflash_assets.generation.rows.journal import RowJournal

ROOT = Path(__file__).resolve().parent.parent


def row(i: int, **extra) -> dict:
    return {"index": i, "content": f"answer {i}", "finish_reason": "stop", **extra}


def test_append_is_fsynced_and_readable_by_a_fresh_reader(tmp_path, monkeypatch):
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])

    path = tmp_path / "deep" / "dir" / "p0.journal"
    journal = RowJournal(path)
    for i in range(3):
        journal.append(row(i))
        # Durable before append returns: a new reader (another process after a crash) sees it.
        assert RowJournal(path).load().keys() == set(range(i + 1))
    file_fsyncs = [fd for fd in synced if fd == journal._fd]
    assert len(file_fsyncs) == 3  # one fsync per append
    journal.close()

    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and [json.loads(x) for x in lines[:-1]] == [row(0), row(1), row(2)]


def test_later_lines_win_and_done_indices(tmp_path):
    journal = RowJournal(tmp_path / "j.jsonl")
    journal.append(row(5, finish_reason="length", completion_tokens=4096))
    journal.append(row(7, error="HTTP 503"))
    journal.append(row(5, finish_reason="stop", completion_tokens=5000))  # redone after a cap change
    rows = journal.load()
    assert rows[5]["finish_reason"] == "stop" and rows[5]["completion_tokens"] == 5000
    assert journal.done_indices() == {5, 7}
    assert journal.done_indices(lambda r: r.get("error") is None) == {5}
    assert journal.skipped_lines == 0


def test_append_many_writes_all_rows_with_one_fsync(tmp_path, monkeypatch):
    journal = RowJournal(tmp_path / "j.jsonl")
    journal.append(row(0))  # opens the file
    calls: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd))[1])
    assert journal.append_many([row(i) for i in range(1, 6)]) == 5
    assert len(calls) == 1
    assert sorted(journal.load()) == [0, 1, 2, 3, 4, 5]


def test_torn_last_line_is_skipped_and_next_append_starts_clean(tmp_path):
    path = tmp_path / "j.jsonl"
    journal = RowJournal(path)
    journal.append(row(0))
    journal.append(row(1))
    journal.close()
    with open(path, "ab") as fh:  # a crash in the middle of writing row 2
        fh.write(b'{"index":2,"content":"ans')

    reopened = RowJournal(path)
    assert sorted(reopened.load()) == [0, 1]
    assert reopened.skipped_lines == 1

    reopened.append(row(3))
    rows = reopened.load()
    assert sorted(rows) == [0, 1, 3] and rows[3] == row(3)  # not glued onto the torn line
    assert reopened.skipped_lines == 1


def test_undecodable_lines_are_counted_not_fatal(tmp_path):
    path = tmp_path / "j.jsonl"
    good = [json.dumps(row(i)).encode() for i in range(3)]
    bad = [
        b"\xff\xfe not utf-8",
        b"{not json}",
        b"[1, 2, 3]",
        b'{"no_index": 1}',
        b'{"index": "4"}',
        b'{"index": true}',
    ]
    path.write_bytes(b"\n".join([good[0], bad[0], bad[1], good[1], bad[2], bad[3], bad[4], bad[5], good[2]]) + b"\n\n")
    journal = RowJournal(path)
    assert sorted(journal.load()) == [0, 1, 2]
    assert journal.skipped_lines == len(bad)


def test_missing_file_is_empty_and_bad_rows_rejected(tmp_path):
    journal = RowJournal(tmp_path / "nothing.jsonl")
    assert journal.load() == {} and journal.done_indices() == set() and journal.size_bytes() == 0
    with pytest.raises(ValueError):
        journal.append({"content": "no index"})
    with pytest.raises(ValueError):
        journal.append({"index": "3"})
    with pytest.raises(TypeError):
        journal.append({"index": 3, "bad": object()})
    assert not journal.path.exists()  # nothing written by the rejected rows


def test_concurrent_appends_from_threads(tmp_path):
    journal = RowJournal(tmp_path / "j.jsonl")
    n_threads, per_thread = 6, 60

    def work(t: int) -> None:
        for k in range(per_thread):
            journal.append(row(t * per_thread + k, text="x" * (k * 37 % 3000)))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    rows = journal.load()
    assert sorted(rows) == list(range(n_threads * per_thread))
    assert journal.skipped_lines == 0
    assert len(journal.path.read_bytes().splitlines()) == n_threads * per_thread


CHILD = r"""
import sys
sys.path.insert(0, sys.argv[2])
from dflash_assets.generation.rows.journal import RowJournal
journal = RowJournal(sys.argv[1])
i = 0
while True:
    journal.append({"index": i, "text": "y" * (i * 7919 % 20000)})
    print(i, flush=True)  # acknowledged: append returned, the row is durable
    i += 1
"""


def test_kill_9_mid_append_loop_leaves_every_acknowledged_row(tmp_path):
    path = tmp_path / "killed.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(ROOT)], stdout=subprocess.PIPE, text=True)
    acknowledged = -1
    try:
        assert proc.stdout is not None
        while acknowledged < 150:
            line = proc.stdout.readline()
            assert line, "child died early"
            acknowledged = int(line)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    journal = RowJournal(path)
    rows = journal.load()
    # Every acknowledged row is there, intact; rows are appended in order, so no gaps either.
    assert set(range(acknowledged + 1)) <= set(rows)
    assert sorted(rows) == list(range(len(rows)))
    assert all(rows[i]["text"] == "y" * (i * 7919 % 20000) for i in rows)
    assert journal.skipped_lines <= 1  # at most the line being written when killed
    complete_lines = path.read_bytes().count(b"\n")
    assert len(rows) == complete_lines

    journal.append({"index": 10**6, "text": "after restart"})  # a resumed run appends cleanly
    assert journal.load()[10**6]["text"] == "after restart"


class FullDisk:
    """A journal module's ``os`` whose ``write`` number ``fail_at`` (1-based) lands half its bytes, then raises
    ENOSPC; ``ftruncate`` raises too when ``truncate_fails``."""

    def __init__(self, fail_at: int, truncate_fails: bool = False) -> None:
        self.fail_at, self.truncate_fails, self.writes = fail_at, truncate_fails, 0

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data):
        self.writes += 1
        if self.writes == self.fail_at:
            os.write(fd, bytes(data[: len(data) // 2]))
            raise OSError(28, "No space left on device")
        return os.write(fd, data)

    def ftruncate(self, fd, size):
        if self.truncate_fails:
            raise OSError(5, "Input/output error")
        return os.ftruncate(fd, size)


def test_a_failed_append_cuts_its_partial_line_and_stops_the_journal(tmp_path, monkeypatch):
    """Issue 27: after a partial write and a full disk, later appends returned while their rows were glued to
    the partial line and lost."""
    import dflash_assets.generation.rows.journal as journal_module
    from dflash_assets.generation.rows.journal import JournalError

    path = tmp_path / "j.jsonl"
    journal = RowJournal(path)
    journal.append_many([row(0), row(1)])
    before = path.read_bytes()
    monkeypatch.setattr(journal_module, "os", FullDisk(fail_at=1))
    with pytest.raises(JournalError, match=rf"appending to journal {path} failed \(\[Errno 28\] No space left"):
        journal.append_many([row(2), row(3)])
    assert path.read_bytes() == before  # the partial line was cut off
    monkeypatch.setattr(journal_module, "os", os)  # the disk has room again: still no append
    with pytest.raises(JournalError, match="takes no more rows: an earlier append failed"):
        journal.append(row(4))
    assert path.read_bytes() == before and sorted(RowJournal(path).load()) == [0, 1]


def test_a_partial_line_that_cannot_be_cut_off_is_never_read_as_a_row(tmp_path, monkeypatch):
    import dflash_assets.generation.rows.journal as journal_module
    from dflash_assets.generation.rows.journal import JournalError

    path = tmp_path / "j.jsonl"
    journal = RowJournal(path)
    journal.append(row(0))
    monkeypatch.setattr(journal_module, "os", FullDisk(fail_at=1, truncate_fails=True))
    with pytest.raises(JournalError, match="failed"):
        journal.append(row(1, content="x" * 100))
    monkeypatch.setattr(journal_module, "os", os)
    with pytest.raises(JournalError, match=r"the partial line could not be cut off \(\[Errno 5\]"):
        journal.append(row(2))
    journal.close()
    rerun = RowJournal(path)  # the next run: the torn line ends, its rows start clean
    rerun.append(row(3))
    assert sorted(rerun.load()) == [0, 3] and rerun.skipped_lines == 1


def test_the_journal_is_owner_only_also_when_rebuilt_from_storage(tmp_path):
    """Issue 27: the journal (prompts and generated text) was created world-readable (0644)."""
    from dflash_assets.generation.rows.journal_sync import SyncedRowJournal
    from dflash_assets.storage.store import Storage

    old = tmp_path / "old.jsonl"
    old.write_bytes(json.dumps(row(0)).encode() + b"\n")
    old.chmod(0o644)  # made by an earlier version
    journal = RowJournal(old)
    journal.append(row(1))
    fresh = RowJournal(tmp_path / "new.jsonl")
    fresh.append(row(0))
    remote = Storage(str(tmp_path / "remote"))
    synced = SyncedRowJournal(tmp_path / "scratch" / "a.jsonl", remote, ("completions", "a.jsonl"))
    synced.append_many([row(0), row(1)])
    synced.close()
    rebuilt = SyncedRowJournal(tmp_path / "empty_disk" / "a.jsonl", remote, ("completions", "a.jsonl"))
    assert sorted(rebuilt.load()) == [0, 1]  # rebuilt from the segments (atomic write of a temp file)
    for path in (old, fresh.path, synced.path, rebuilt.path):
        assert oct(path.stat().st_mode & 0o777) == "0o600", path
