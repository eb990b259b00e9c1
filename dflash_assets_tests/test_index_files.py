"""Issue 32, finding 5: the corpus's index files, lost, damaged or edited under a build.

The inputs that showed it: ``partition_ranges.json`` deleted after two builds (the second one's range
started after a partial first range) renumbered every key after the partial range, so those partitions
would all be generated again; a prompt file edited while the corpus was read was never picked up (the
fingerprint was taken after the build); a damaged ``prompt_index.parquet`` or ``partition_ranges.json``
failed with a bare parser error naming neither the file nor the fix. Real prompt files, a real storage
root, the real ``prompt_corpus`` asset in a real Dagster instance.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest

from dflash_assets.assets.prompts import corpus_fingerprint, prompt_corpus
from dflash_assets.data.prompt_index import INDEX_FILE, RANGES_FILE, load_index, save_index, stable_corpus
from dflash_assets.data.shapes import build_corpus
from dflash_assets.orchestration import freshness
from dflash_assets.stages import prompts as prompt_corpus_stage
from dflash_assets.stages.prompts import PromptCorpusConfig
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.storage.store import Storage


def write(path: Path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def build(store: Storage, sources: list[str], size: int, previous=None):
    built = stable_corpus(store, build_corpus(sources).corpus, size, None, previous)
    save_index(store, built.table)
    return built


def two_builds(tmp_path: Path):
    """Build 1: 6 prompts in ranges of 4 (0-3, 4-5: partial); build 2 adds 5 (6-9, 10-10)."""
    store = Storage(str(tmp_path / "data"))
    first = build(store, [write(tmp_path / "a.jsonl", [f"a{i}" for i in range(6)])], 4)
    assert first.keys == ["0000000-0000003", "0000004-0000005"]
    sources = [str(tmp_path / "a.jsonl"), write(tmp_path / "b.jsonl", [f"b{i}" for i in range(5)])]
    second = build(store, sources, 4, first.corpus.select("index", "content_hash", "prompt_id"))
    assert second.keys == ["0000000-0000003", "0000004-0000005", "0000006-0000009", "0000010-0000010"]
    return store, sources, second


def test_lost_ranges_file_is_rebuilt_with_every_key_as_it_was(tmp_path):
    store, sources, second = two_builds(tmp_path)
    Path(store.path(*RANGES_FILE)).unlink()
    third = build(store, sources, 4, second.corpus.select("index", "content_hash", "prompt_id"))
    assert third.keys == second.keys
    assert third.versions == second.versions  # every completions partition stays up to date
    assert store.read_json(*RANGES_FILE) == {"partition_size": 4, "ranges": [[0, 3], [4, 5], [6, 9], [10, 10]]}


def test_lost_ranges_file_with_a_table_that_does_not_record_ranges_is_an_error_naming_both(tmp_path):
    store, _sources, _second = two_builds(tmp_path)
    Path(store.path(*RANGES_FILE)).unlink()
    old = store.read_parquet(*INDEX_FILE).select("content_hash", "index", "prompt_id")  # as 8870c9f wrote it
    store.write_parquet(old, *INDEX_FILE)
    with pytest.raises(ValueError) as caught:
        load_index(store)
    message = str(caught.value)
    assert store.uri(*RANGES_FILE) in message and store.uri(*INDEX_FILE) in message
    assert "Restore partition_ranges.json" in message and "delete prompt_index.parquet too" in message


@pytest.mark.parametrize(
    ("damaged", "content", "fix"),
    [
        (INDEX_FILE, b"PAR1 not parquet at all", "Restore it from a backup, or delete it"),
        (RANGES_FILE, b'{"partition_size": 4, "ranges": [[0, 3], [4', "Delete it: the next build rebuilds the ranges"),
        (RANGES_FILE, b'{"partition_size": 4, "ranges": [[4, 5], [0, 3]]}', "Delete it"),
    ],
    ids=["index_not_parquet", "ranges_cut_off", "ranges_out_of_order"],
)
def test_a_damaged_index_file_is_an_error_naming_it_and_the_fix(tmp_path, damaged, content, fix):
    store, sources, _ = two_builds(tmp_path)
    store.write_bytes(content, *damaged)
    with pytest.raises(ValueError) as caught:
        stable_corpus(store, build_corpus(sources).corpus, 4, None, None)
    assert str(caught.value).startswith(store.uri(*damaged) + ": ") and fix in str(caught.value)


def test_a_prompt_file_edited_during_the_build_is_picked_up_by_the_next_run(tmp_path, monkeypatch):
    source = write(tmp_path / "prompts.jsonl", ["p0", "p1"])
    config = {"sources": [source], "partition_size": 4}
    storage = StorageResource(root=str(tmp_path / "data"))
    real_build = prompt_corpus_stage.build_corpus

    def build_then_edit(*args, **kwargs):
        result = real_build(*args, **kwargs)  # the files are read; another process edits one now
        with open(source, "a") as f:
            f.write(json.dumps({"prompt": "p2"}) + "\n")
        return result

    monkeypatch.setattr(prompt_corpus_stage, "build_corpus", build_then_edit)
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources={"storage": storage},
            run_config={"ops": {"prompt_corpus": {"config": config}}},
        )
        assert result.success
        meta = {
            k: v.value
            for k, v in instance.get_latest_materialization_event(
                dg.AssetKey("prompt_corpus")
            ).asset_materialization.metadata.items()
        }
    assert meta["num_prompts"] == 2  # the build read the file before the edit
    now = corpus_fingerprint(PromptCorpusConfig(**config), storage)
    assert freshness.corpus_reason(meta, now) == "the corpus config or a prompt file changed"
