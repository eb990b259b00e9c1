"""Two machines on one S3 root (a real moto_server endpoint): a local scratch shard is used only when its
SHA-256 is the one the stored index records, journal segments of two writers never overwrite each other,
and two prompt_corpus builds take turns."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import dagster as dg

from dflash_assets.resources.storage import StorageResource
from dflash_assets.shard_access import complete_shards

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
    from dflash_assets.shard_access import fetch_shards

    storage = s3_storage(s3_target, tmp_path / "scratch")
    store_partition(s3_target, "0-9", b"x" * 1000)
    index = json.loads(s3_target.get("hidden_states/0-9/index.json"))
    assert fetch_shards(storage, "0-9", index)[1] == ["shard-00000.safetensors"]
    assert fetch_shards(storage, "0-9", index)[1] == []  # same file, same hash: kept
