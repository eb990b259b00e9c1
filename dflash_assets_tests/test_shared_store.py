"""Two machines on one S3 root (a real moto_server endpoint): a local scratch shard is used only when its
SHA-256 is the one the stored index records, journal segments of two writers never overwrite each other,
and two prompt_corpus builds take turns."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import dagster as dg
import pytest

from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.stored_inputs import complete_shards

try:
    from dflash_assets_tests.s3_fixtures import moto_server, s3_env, s3_target
except ImportError:
    from s3_fixtures import moto_server, s3_env, s3_target  # type: ignore[no-redef]  # noqa: F401


def s3_storage(target, scratch) -> StorageResource:
    """A resolved StorageResource on the test bucket with its own scratch disk (one per "machine")."""
    return StorageResource(
        root=target.root,
        scratch_dir=str(scratch),
        endpoint_url=target.endpoint_url,
        region="us-east-1",
        aws_access_key_id=dg.EnvVar("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=dg.EnvVar("AWS_SECRET_ACCESS_KEY"),
        retry_attempts=2,
        retry_backoff_s=0.05,
        journal_sync_rows=1000,
        journal_sync_s=60,
    ).process_config_and_initialize()


def put(target, key: str, body: bytes) -> None:
    target.client.put_object(Bucket=target.bucket, Key=f"{target.prefix}/{key}", Body=body)


def store_partition(target, pk: str, body: bytes) -> None:
    """hidden_states[pk] as another node's extraction leaves it: one shard and a complete index."""
    put(target, f"hidden_states/{pk}/shard-00000.safetensors", body)
    index = {
        "complete": True,
        "shards": [{"name": "shard-00000.safetensors", "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}],
    }
    put(target, f"hidden_states/{pk}/index.json", json.dumps(index).encode())


def test_scratch_shard_of_the_right_size_but_other_content_is_replaced(s3_target, tmp_path):
    storage = s3_storage(s3_target, tmp_path / "scratch")
    pk = "0-999"
    store_partition(s3_target, pk, b"A" * 4096)
    (paths, used, skipped) = complete_shards(storage, [pk])
    assert used == [pk] and skipped == [] and Path(paths[0]).read_bytes() == b"A" * 4096

    # re-extracted on another node: same shard name, same size, other features
    store_partition(s3_target, pk, b"B" * 4096)
    paths, _, _ = complete_shards(storage, [pk])
    assert Path(paths[0]).read_bytes() == b"B" * 4096  # not the stale local copy

    # a local copy changed after it was verified (same size) is not trusted either
    with open(paths[0], "r+b") as f:
        f.write(b"C")
    os.utime(paths[0], ns=(1, 1))
    paths, _, _ = complete_shards(storage, [pk])
    assert Path(paths[0]).read_bytes() == b"B" * 4096


def test_verified_scratch_shard_is_not_downloaded_again(s3_target, tmp_path):
    from dflash_assets.stages.stored_inputs import fetch_shards

    storage = s3_storage(s3_target, tmp_path / "scratch")
    store_partition(s3_target, "0-9", b"x" * 1000)
    index = json.loads(s3_target.get("hidden_states/0-9/index.json"))
    assert fetch_shards(storage, "0-9", index)[1] == ["shard-00000.safetensors"]
    assert fetch_shards(storage, "0-9", index)[1] == []  # same file, same hash: kept


def test_two_hosts_journal_segments_keep_both_writers_rows(s3_target, tmp_path, monkeypatch):
    """Two hosts (own scratch, own Dagster instance) run one partition on one root: both sync their
    first segment; the rows of both are on storage and a third machine resumes with all of them."""
    try:
        import dflash_assets.storage.lock as store_lock
    except ImportError:  # 8870c9f: no writer identity
        store_lock = None

    parts = ("completions", "0-9.journal.jsonl")
    journals = {}
    for host in ("host-a", "host-b"):  # both open before either syncs: both start at segment 1
        journals[host] = s3_storage(s3_target, tmp_path / host).open_journal(*parts)
    for host, journal in journals.items():
        if store_lock is not None:
            monkeypatch.setattr(store_lock, "_IDENTITY", None)  # each "host" is another writer process
            monkeypatch.setattr(store_lock.socket, "gethostname", lambda host=host: host)
        journal.append_many([{"index": i, "host": host} for i in ((0, 1) if host == "host-a" else (2, 3))])
        journal.sync()
    for journal in journals.values():
        journal.close()
    segments = s3_target.keys("completions/0-9.journal/")
    assert len(segments) == 2, segments
    assert any("host-a" in k for k in segments) and any("host-b" in k for k in segments)
    fresh = s3_storage(s3_target, tmp_path / "host-c").open_journal(*parts)
    rows = fresh.load()
    assert {i: r["host"] for i, r in rows.items()} == {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}
    fresh.close()


def prompts_file(path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return str(path)


def test_two_interleaved_corpus_builds_keep_the_first_builds_indices(s3_target, tmp_path, monkeypatch):
    """Build A (adds x1) pauses after reading the last build; build B (adds x2 and x1) starts meanwhile.
    B must wait for A, then keep A's index for x1: x1 -> 10, x2 -> 11, both in the final corpus."""
    import threading

    import dflash_assets.stages.prompts as stage
    from dflash_assets.data.reader import ReadLimits

    store = s3_storage(s3_target, tmp_path / "scratch").open()
    base = prompts_file(tmp_path / "base.jsonl", [f"base prompt {i}" for i in range(10)])
    only_x1 = prompts_file(tmp_path / "a.jsonl", ["new prompt x1"])
    x2_then_x1 = prompts_file(tmp_path / "b.jsonl", ["new prompt x2", "new prompt x1"])

    def build(sources: list[str]) -> None:
        stage.build_corpus_stage(store, sources, lambda spec: {}, ReadLimits(), 5, None)

    build([base])
    paused, resume = threading.Event(), threading.Event()
    real_stable_corpus = stage.stable_corpus

    def pausing_stable_corpus(*args, **kwargs):
        if threading.current_thread().name == "build-a":
            paused.set()
            resume.wait(20)
        return real_stable_corpus(*args, **kwargs)

    monkeypatch.setattr(stage, "stable_corpus", pausing_stable_corpus)
    errors = []

    def run(sources):
        try:
            build(sources)
        except Exception as exc:  # reported below: the assertion names it
            errors.append(exc)

    a = threading.Thread(target=run, args=([base, only_x1],), name="build-a")
    b = threading.Thread(target=run, args=([base, x2_then_x1],), name="build-b")
    a.start()
    assert paused.wait(20)
    b.start()
    b.join(3)
    b_finished_while_a_held_the_corpus = not b.is_alive()
    resume.set()
    a.join(30)
    b.join(30)
    assert errors == []
    corpus = store.read_parquet(*stage.CORPUS_FILE)
    by_text = {r["messages"][-1]["content"]: r["index"] for r in corpus.iter_rows(named=True)}
    assert by_text["new prompt x1"] == 10 and by_text["new prompt x2"] == 11, by_text
    assert not b_finished_while_a_held_the_corpus
    assert s3_target.keys("prompt_corpus/.build.lock") == []  # released


@pytest.mark.parametrize("where", ["local", "s3"])
def test_store_lock_refuses_a_second_writer_and_takes_over_an_expired_lease(where, s3_target, tmp_path):
    from dflash_assets.storage.lock import LockBusyError, StoreLock
    from dflash_assets.storage.store import Storage

    store = Storage(str(tmp_path / "root")) if where == "local" else s3_storage(s3_target, tmp_path / "s").open()
    parts = ("prompt_corpus", ".build.lock")
    first = StoreLock(store, parts, lease_s=60)
    first.acquire()
    with pytest.raises(LockBusyError) as busy:
        StoreLock(store, parts, wait_s=0.3, poll_s=0.1).acquire()
    assert store.uri(*parts) in str(busy.value) and first.owner in str(busy.value)
    assert "delete that object if no build is running" in str(busy.value)
    first.release()
    assert not store.exists(*parts)

    killed = StoreLock(store, parts, lease_s=0.2)  # a holder killed before release: its lease runs out
    killed.acquire()
    with StoreLock(store, parts, wait_s=5, poll_s=0.1) as taker:
        assert json.loads(store.read_bytes(*parts))["owner"] == taker.owner
        killed.release()  # too late: no longer its lock, left alone
        assert store.exists(*parts)
    assert not store.exists(*parts)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_two_waiters_on_one_expired_lock_exactly_one_wins(where, s3_target, tmp_path, monkeypatch):
    """Issue 40 finding 5: both waiters read the same expired lock before either takes it over. The take-over
    renamed whatever lock existed by then, not the expired one read, so locally the second waiter displaced
    the first one's fresh lock and both held it. Now exactly one wins; the other keeps waiting on the
    winner's lease and gives up naming it."""
    import threading

    from dflash_assets.storage.lock import LockBusyError, StoreLock
    from dflash_assets.storage.store import Storage

    store = Storage(str(tmp_path / "root")) if where == "local" else s3_storage(s3_target, tmp_path / "s").open()
    parts = ("prompt_corpus", ".build.lock")
    StoreLock(store, parts, lease_s=0.01).acquire()  # a holder killed before release
    time.sleep(0.05)  # its lease has run out
    both_read, first_done = threading.Barrier(2, timeout=20), threading.Event()
    real_holder = StoreLock._holder
    first_read: list[int] = []

    def holder_then_wait(self):  # both waiters read the expired lock; the second tries only once the first is done
        seen = real_holder(self)
        if id(self) not in first_read:
            first_read.append(id(self))
            assert seen[0] and float(seen[0]["expires"]) < time.time()
            both_read.wait()
            if first_read.index(id(self)) == 1:
                first_done.wait(20)
        return seen

    monkeypatch.setattr(StoreLock, "_holder", holder_then_wait)
    waiters = [StoreLock(store, parts, lease_s=60, wait_s=1.5, poll_s=0.1) for _ in range(2)]
    outcome: dict[int, str] = {}

    def wait(i: int) -> None:
        try:
            waiters[i].acquire()
            outcome[i] = "won"
        except LockBusyError as exc:
            outcome[i] = str(exc)
        finally:
            first_done.set()

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [i for i, o in outcome.items() if o == "won"]
    assert len(outcome) == 2 and len(winners) == 1, outcome
    winner, loser = waiters[winners[0]], waiters[1 - winners[0]]
    assert json.loads(store.read_bytes(*parts))["owner"] == winner.owner
    assert winner.owner in outcome[1 - winners[0]] and loser.owner not in store.read_bytes(*parts).decode()
    if where == "local":  # no take-over claim is left behind
        assert sorted(os.listdir(tmp_path / "root" / "prompt_corpus")) == [".build.lock"]
    winner.release()
    assert not store.exists(*parts)


def test_a_build_killed_on_this_host_is_taken_over_at_once(tmp_path, caplog):
    """Issue 40 finding 5: a build killed (kill -9) while holding ``prompt_corpus/.build.lock`` made the next
    build on the same host wait, silent, for the rest of its 15-minute lease. Its holder is provably dead
    (same machine and boot, pid not running): the next build takes the lock over at once, and says so."""
    import signal
    import subprocess
    import sys
    import textwrap

    import dflash_assets.stages.prompts as stage
    from dflash_assets.data.reader import ReadLimits
    from dflash_assets.storage.store import Storage

    root = tmp_path / "root"
    source = prompts_file(tmp_path / "p.jsonl", [f"prompt {i}" for i in range(10)])
    child = textwrap.dedent(
        f"""
        import sys, time
        import dflash_assets.stages.prompts as stage
        from dflash_assets.data.reader import ReadLimits
        from dflash_assets.storage.store import Storage

        def hold(*args, **kwargs):  # the build holds the lock from here to its writes
            print("holding", flush=True)
            time.sleep(600)

        stage.stable_corpus = hold
        stage.build_corpus_stage(Storage({str(root)!r}), [{source!r}], lambda spec: {{}}, ReadLimits(), 5, None)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ":".join(sys.path)},
    )
    try:
        assert proc.stdout.readline().strip() == "holding"
        held = json.loads((root / "prompt_corpus" / ".build.lock").read_text())
        assert held["expires"] - time.time() > 800  # a 15-minute lease, far from over
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="dflash_assets.storage.lock"):
        build = stage.build_corpus_stage(Storage(str(root)), [source], lambda spec: {}, ReadLimits(), 5, None, 20)
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash_assets.storage.lock"]
    assert time.monotonic() - started < 5 and build.uri.endswith("corpus.parquet")
    assert len(lines) == 1 and held["owner"] in lines[0]
    assert f"pid {proc.pid} (this machine, this boot) is not running" in lines[0]
    assert not (root / "prompt_corpus" / ".build.lock").exists()  # released after the build


def test_the_wait_says_who_holds_the_lock_and_until_when(tmp_path, caplog):
    """Issue 40 finding 5: the wait was silent for up to 15 minutes. A live holder is waited for with a line
    naming it and its lease's end (and its pid and host when it recorded its process); the give-up names
    the same."""
    from dflash_assets.storage.lock import LockBusyError, StoreLock
    from dflash_assets.storage.store import Storage

    store = Storage(str(tmp_path / "root"))
    parts = ("prompt_corpus", ".build.lock")
    first = StoreLock(store, parts, lease_s=600)
    first.acquire()
    with caplog.at_level("WARNING", logger="dflash_assets.storage.lock"), pytest.raises(LockBusyError) as busy:
        StoreLock(store, parts, wait_s=0.3, poll_s=0.1).acquire()
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash_assets.storage.lock"]
    until = time.strftime("%Y-%m-%d %H:%M", time.gmtime(json.loads(store.read_bytes(*parts))["expires"]))
    assert len(lines) == 1 and first.owner in lines[0], lines
    assert f"until {until}" in lines[0] and "waiting up to" in lines[0]
    assert f"until {until}" in str(busy.value) and first.owner in str(busy.value)
    first.release()

    from dflash_assets.generation.processes.machine import process_gone, process_record

    with StoreLock(store, parts, lease_s=600, holder=process_record(), holder_gone=process_gone):
        said: list[str] = []
        with pytest.raises(LockBusyError):  # this process is alive: never taken over, whatever holder_gone says
            StoreLock(store, parts, wait_s=0.3, poll_s=0.1, holder_gone=process_gone, log=said.append).acquire()
        assert len(said) == 1 and f"pid {os.getpid()} on " in said[0]


def test_status_reads_an_s3_root_with_credentials_from_the_environment(s3_target, tmp_path, monkeypatch):
    """Issue 41: ``status`` built its storage from EnvVar credential references without resolving them, so on an
    S3 root with AWS_* set every read raised ("Attempted to directly retrieve environment variable")."""
    import yaml

    from dflash_assets.app.status import current_settings_and_store

    config = {"resources": {"storage": {"root": s3_target.root, "endpoint_url": s3_target.endpoint_url}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("DFLASH_CONFIG", str(tmp_path / "config.yaml"))
    put(s3_target, "completions/0-9.parquet", b"stored bytes")
    settings, store, error = current_settings_and_store()
    assert error is None and settings is not None
    assert store.read_bytes("completions", "0-9.parquet") == b"stored bytes"
