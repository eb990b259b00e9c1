"""Two machines on one S3 root (a real moto_server endpoint): a local scratch shard is used only when its
SHA-256 is the one the stored index records, journal segments of two writers never overwrite each other,
and two prompt_corpus builds take turns."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import dagster as dg
import pytest

from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.shard_access import complete_shards

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
    from dflash_assets.stages.shard_access import fetch_shards

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
