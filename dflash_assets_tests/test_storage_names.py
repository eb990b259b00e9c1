"""Issue 27: names that come from storage are data. A shard name in a stored ``index.json`` became a
local path unchecked (``../`` or an absolute path wrote outside the scratch directory), and a download
was in place before its hash was checked. Real S3 protocol (moto server), real storage resource.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.stored_inputs import ShardIntegrityError, fetch_shards
from dflash_assets.storage.store import IntegrityError, UnsafeNameError, check_name

try:
    from dflash_assets_tests.s3_fixtures import moto_server, s3_env, s3_target
except ImportError:
    from s3_fixtures import moto_server, s3_env, s3_target  # type: ignore[no-redef]  # noqa: F401

PK = "0000000-0000011"
GOOD = b"shard bytes " * 100


def machine(target, scratch: Path) -> StorageResource:
    """The storage resource as a step sees it (used directly here: the credentials resolved)."""
    return StorageResource(
        root=target.root,
        scratch_dir=str(scratch),
        endpoint_url=target.endpoint_url,
        region="us-east-1",
        aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        retry_attempts=2,
        retry_backoff_s=0.1,
    )


def put(target, key: str, data: bytes) -> None:
    target.client.put_object(Bucket=target.bucket, Key=f"{target.prefix}/{key}", Body=data)


def entry(name, data: bytes = GOOD, **extra) -> dict:
    return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), **extra}


HOSTILE = [
    "../../../escaped.safetensors",
    "/tmp/i27-absolute.safetensors",
    "sub/dir.safetensors",
    "..",
    "",
    None,
    "..\\up.safetensors",
]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_shard_name_in_index_json_never_becomes_a_path(s3_target, tmp_path, name):
    storage = machine(s3_target, tmp_path / "scratch")
    put(s3_target, f"hidden_states/{PK}/shard-00000.safetensors", GOOD)
    if isinstance(name, str) and name:
        put(s3_target, f"hidden_states/{PK}/{name.lstrip('/')}", GOOD)  # an object there to download, if asked
    index = {"complete": True, "shards": [entry("shard-00000.safetensors"), entry(name)]}
    before = {p for p in tmp_path.rglob("*")}
    with pytest.raises(ShardIntegrityError) as err:  # the drafter: fails naming the partition and the name
        fetch_shards(storage, PK, index)
    assert f"hidden_states/{PK}/index.json shard: {name!r} is not a plain file name" in str(err.value)
    assert f"re-materialize hidden_states[{PK}]" in str(err.value)
    paths, fetched = fetch_shards(storage, PK, index, on_bad="drop")  # hidden_states: left out, recomputed
    assert fetched == ["shard-00000.safetensors"] and [Path(p).name for p in paths] == fetched
    written = {p for p in tmp_path.rglob("*")} - before
    scratch_dir = tmp_path / "scratch" / s3_target.bucket / s3_target.prefix / "hidden_states" / PK
    # the shard and its verification record (stored_inputs._stamp_path), nothing for the hostile name
    assert {p for p in written if p.is_file()} == {
        scratch_dir / "shard-00000.safetensors",
        scratch_dir / ".shard-00000.safetensors.verified.json",
    }
    assert not Path("/tmp/i27-absolute.safetensors").exists()


def test_a_download_is_put_in_place_only_once_its_size_and_hash_match(s3_target, tmp_path):
    """A local copy at the path (say an older shard) is left as it was when the download does not
    match; before issue 27 the copy was renamed over it first and checked after."""
    storage = machine(s3_target, tmp_path / "scratch")
    store = storage.open()
    put(s3_target, "hidden_states/p/shard.safetensors", GOOD)
    path = Path(storage.local_scratch("hidden_states", "p", "shard.safetensors"))
    path.write_bytes(b"older copy")
    with pytest.raises(IntegrityError, match="sha256 differs"):
        store.download(path, "hidden_states", "p", "shard.safetensors", sha256=hashlib.sha256(b"other").hexdigest())
    with pytest.raises(IntegrityError, match=f"downloaded {len(GOOD)} bytes, expected 7"):
        store.download(path, "hidden_states", "p", "shard.safetensors", size=7)
    assert path.read_bytes() == b"older copy" and sorted(p.name for p in path.parent.iterdir()) == ["shard.safetensors"]
    store.download(
        path, "hidden_states", "p", "shard.safetensors", size=len(GOOD), sha256=hashlib.sha256(GOOD).hexdigest()
    )
    assert path.read_bytes() == GOOD

    # through fetch_shards: a shard whose stored bytes differ from index.json is not put in place
    put(s3_target, f"hidden_states/{PK}/shard-00000.safetensors", b"tampered " + GOOD[9:])
    index = {"shards": [entry("shard-00000.safetensors")]}
    with pytest.raises(ShardIntegrityError, match="sha256 differs"):
        fetch_shards(storage, PK, index)
    assert not Path(storage.local_scratch("hidden_states", PK, "shard-00000.safetensors")).exists()


def test_local_paths_and_listings_take_one_plain_component_only(s3_target, tmp_path):
    storage = machine(s3_target, tmp_path / "scratch")
    for bad in ("..", "a/b", "/etc", ""):
        with pytest.raises(UnsafeNameError):
            storage.local_scratch("hidden_states", bad)
    assert check_name("00000000-00000999...00001000-00001999", "x")  # a range label holds dots, not '..'
    put(s3_target, "dflash_drafter/export/config.json", json.dumps({}).encode())
    put(s3_target, "dflash_drafter/export/..\\config.json", b"hostile")
    with pytest.raises(UnsafeNameError, match=r"export listing: '\.\.\\\\config\.json' is not a plain file name"):
        storage.ensure_local_dir("dflash_drafter", "export")
