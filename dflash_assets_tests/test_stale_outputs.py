"""Issue 32 finding 8: the output files of a partition key that no longer exists (every prompt of its range
removed from the prompt files) are removed by the next corpus build, and nothing else: not a current
key's, not a user's file, not an output changed recently (another host may be writing it), and nothing at
all while another run is in progress."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import dagster as dg

from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.resources.storage import StorageResource

try:
    from dflash_assets_tests.s3_fixtures import moto_server, s3_env, s3_target
    from dflash_assets_tests.test_shared_store import s3_storage
except ImportError:
    from s3_fixtures import moto_server, s3_env, s3_target  # type: ignore[no-redef]  # noqa: F401
    from test_shared_store import s3_storage  # type: ignore[no-redef]

KEPT, GONE = "0000000-0000004", "0000005-0000009"


def prompts(path: Path, n: int) -> str:
    path.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(n)))
    return str(path)


def outputs_of(root: Path, pk: str, age_s: float = 7200) -> list[Path]:
    """The files the stages write for ``pk`` (contents are stand-ins), last changed ``age_s`` ago."""
    files = [
        root / "completions" / f"{pk}.parquet",
        root / "completions" / f"{pk}.journal.jsonl",
        root / "tokenized_sequences" / f"{pk}.parquet",
        root / "tokenized_sequences" / f"{pk}.set_aside.parquet",
        root / "hidden_states" / pk / "index.json",
        root / "hidden_states" / pk / "shard-00000.safetensors",
    ]
    for f in files:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"stand-in")
        os.utime(f, (time.time() - age_s, time.time() - age_s))
    return files


def build(instance, root: Path, source: str):
    return dg.materialize(
        [prompt_corpus],
        instance=instance,
        resources={"storage": StorageResource(root=str(root))},
        run_config={"ops": {"prompt_corpus": {"config": {"sources": [source], "partition_size": 5}}}},
    )


def test_outputs_of_a_key_gone_from_the_corpus_are_removed_and_nothing_else(tmp_path):
    root = tmp_path / "root"
    with dg.instance_for_test() as instance:
        assert build(instance, root, prompts(tmp_path / "p.jsonl", 10)).success
        assert instance.get_dynamic_partitions(prompt_ranges.name) == [KEPT, GONE]
        current = outputs_of(root, KEPT)
        gone = outputs_of(root, GONE)
        fresh = outputs_of(root, "0000010-0000014", age_s=5)  # not a key here, but written seconds ago
        user_file = root / "completions" / "notes.txt"
        user_file.write_text("mine")
        result = build(instance, root, prompts(tmp_path / "p.jsonl", 5))  # prompts 5..9 removed
        assert result.success
        assert instance.get_dynamic_partitions(prompt_ranges.name) == [KEPT]
        assert [f for f in gone if f.exists()] == [] and not (root / "hidden_states" / GONE).exists()
        assert all(f.exists() for f in current + fresh) and user_file.read_text() == "mine"
        meta = result.asset_materializations_for_node("prompt_corpus")[0].metadata
        assert meta["stale_outputs_removed"].value == len(gone) - 1  # hidden_states/<pk>/ is one output


def test_nothing_is_removed_while_another_run_is_in_progress(tmp_path):
    from dflash_assets.storage.stale_outputs import remove_stale_outputs
    from dflash_assets.storage.store import Storage

    root = tmp_path / "root"
    gone = outputs_of(root, GONE)
    tidied = remove_stale_outputs(Storage(str(root)), [KEPT], busy_runs=["run-in-flight"])
    assert all(f.exists() for f in gone) and tidied.removed == []
    assert len(tidied.kept) == 5 and "run-in-flight" in tidied.message()


def test_on_s3_recent_outputs_are_kept_and_older_ones_removed(s3_target, tmp_path):
    from dflash_assets.storage.stale_outputs import remove_stale_outputs

    store = s3_storage(s3_target, tmp_path / "scratch").open()
    for key in (
        f"completions/{GONE}.parquet",
        f"completions/{GONE}.journal/seg-000001-host-1-ab.jsonl",
        f"hidden_states/{GONE}/index.json",
        f"completions/{KEPT}.parquet",
    ):
        store.write_bytes(b"x", *key.split("/"))
    recent = remove_stale_outputs(store, [KEPT], busy_runs=[], grace_s=3600)
    assert recent.removed == [] and len(recent.kept) == 3 and "another host" in recent.message()
    older = remove_stale_outputs(store, [KEPT], busy_runs=[], grace_s=0)
    assert len(older.removed) == 3
    assert s3_target.keys() == [f"completions/{KEPT}.parquet"]
