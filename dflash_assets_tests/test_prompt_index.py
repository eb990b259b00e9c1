"""Issue 26: stable prompt indices (:mod:`dflash_assets.data.prompt_index`), on real prompt files and a real
local storage root; no Dagster. Expected indices are written out by hand from the rule: a prompt keeps
its index while its content is unchanged, new content gets indices after the largest ever given."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from dflash_assets.data.prompt_index import (
    INDEX_FILE,
    RANGES_FILE,
    load_index,
    prompt_version,
    save_index,
    stable_corpus,
)
from dflash_assets.data.shapes import build_corpus
from dflash_assets.storage.store import Storage


def write(path: Path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def build(store: Storage, sources: list[str], size: int = 4, max_prompts: int | None = None, previous=None):
    """One corpus build as the asset does it (numbered, table saved); returns {prompt text: index} and the build."""
    built = stable_corpus(store, build_corpus(sources).corpus, size, max_prompts, previous)
    save_index(store, built.table)
    text = {m[-1]["content"]: i for m, i in zip(built.corpus["messages"].to_list(), built.corpus["index"].to_list())}
    return text, built


def chain(store: Storage, *source_lists, size: int = 4, max_prompts: int | None = None):
    """Builds one after another, each compared with the one before; the last {text: index} and build."""
    previous, out = None, None
    for sources in source_lists:
        out = build(store, sources, size, max_prompts, previous)
        previous = out[1].corpus.select("index", "content_hash", "prompt_id")
    return out


@pytest.fixture
def files(tmp_path):
    a = write(tmp_path / "a.jsonl", ["a0", "a1", "a2"])
    b = write(tmp_path / "b.jsonl", ["b0", "b1"])
    new = write(tmp_path / "new.jsonl", ["n0", "n1"])
    return tmp_path, a, b, new


def test_first_build_numbers_in_corpus_order_and_cuts_ranges(files):
    tmp, a, b, _ = files
    store = Storage(str(tmp / "data"))
    text, built = build(store, [a, b])
    assert text == {"a0": 0, "a1": 1, "a2": 2, "b0": 3, "b1": 4}
    assert built.keys == ["0000000-0000003", "0000004-0000004"]
    assert built.sizes == {"0000000-0000003": 4, "0000004-0000004": 1}
    assert built.edits.as_dict() == {"new": 5, "changed": 0, "removed": 0, "kept": 0}
    assert store.exists(*INDEX_FILE) and store.read_json(*RANGES_FILE) == {
        "partition_size": 4,
        "ranges": [[0, 3], [4, 4]],
    }


@pytest.mark.parametrize("where", ["before", "between", "after"])
def test_a_file_added_anywhere_keeps_every_index_and_numbers_only_its_prompts(files, where):
    tmp, a, b, new = files
    store = Storage(str(tmp / "data"))
    sources = {"before": [new, a, b], "between": [a, new, b], "after": [a, b, new]}[where]
    text, built = chain(store, [a, b], sources)
    assert text == {"a0": 0, "a1": 1, "a2": 2, "b0": 3, "b1": 4, "n0": 5, "n1": 6}
    # the ranges cut before keep their bounds (same key, same meaning); the new indices get a range of their own
    assert built.keys == ["0000000-0000003", "0000004-0000004", "0000005-0000006"]
    assert built.edits.as_dict() == {"new": 2, "changed": 0, "removed": 0, "kept": 5}


def test_an_edited_prompt_gets_a_new_index_and_a_removed_one_leaves_a_gap(files):
    tmp, a, b, _ = files
    store = Storage(str(tmp / "data"))
    _, first = build(store, [a, b])
    write(Path(a), ["a0", "a1 edited", "a2"])
    text, built = build(store, [a, b], previous=first.corpus.select("index", "content_hash", "prompt_id"))
    assert text == {"a0": 0, "a1 edited": 5, "a2": 2, "b0": 3, "b1": 4}
    # a plain prompt's id is its content hash: its edit is a new prompt and a removed one
    assert built.edits.as_dict() == {"new": 1, "changed": 0, "removed": 1, "kept": 4}
    text, built = build(store, [b], previous=built.corpus.select("index", "content_hash", "prompt_id"))
    assert text == {"b0": 3, "b1": 4}
    assert built.keys == ["0000000-0000003", "0000004-0000004"]  # range 5..5 has no prompt left: not a partition
    assert built.edits.as_dict() == {"new": 0, "changed": 0, "removed": 3, "kept": 2}
    # removed content coming back gets its old index (and so its stored rows) again
    assert build(store, [a, b])[0] == {"a0": 0, "a1 edited": 5, "a2": 2, "b0": 3, "b1": 4}


def test_an_edit_under_the_same_id_counts_as_changed(tmp_path):
    store = Storage(str(tmp_path / "data"))
    source = tmp_path / "ids.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(["p0", "p1", "p2"])))
    _, first = build(store, [str(source)])
    source.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(["p0", "p1 v2", "p2"])))
    text, built = build(store, [str(source)], previous=first.corpus.select("index", "content_hash", "prompt_id"))
    assert text == {"p0": 0, "p1 v2": 3, "p2": 2}
    assert built.edits.as_dict() == {"new": 0, "changed": 1, "removed": 0, "kept": 2}


def test_reordered_sources_and_a_prompt_in_two_files_keep_one_index_each(files):
    tmp, a, b, _ = files
    store = Storage(str(tmp / "data"))
    both = write(tmp / "both.jsonl", ["b1", "a0", "z"])  # two prompts already in a and b, one new
    text, built = chain(store, [a, b], [b, both, a])
    assert text == {"a0": 0, "a1": 1, "a2": 2, "b0": 3, "b1": 4, "z": 5}
    assert built.corpus["content_hash"].n_unique() == built.corpus.height == 6
    assert built.edits.as_dict() == {"new": 1, "changed": 0, "removed": 0, "kept": 5}


def test_max_prompts_keeps_the_first_n_in_sources_order_at_their_stable_indices(files):
    tmp, a, b, new = files
    store = Storage(str(tmp / "data"))
    text, _ = chain(store, [a, b], [new, a, b], max_prompts=4)
    # first build: a0..b0 (0..3); with new.jsonl first the first four are n0, n1, a0, a1: a2 and b0 drop out
    assert text == {"n0": 4, "n1": 5, "a0": 0, "a1": 1}
    # raising max_prompts brings the dropped prompts back at their own indices
    assert build(store, [new, a, b])[0] == {"n0": 4, "n1": 5, "a0": 0, "a1": 1, "a2": 2, "b0": 3, "b1": 6}


def test_a_table_seeded_from_a_corpus_written_before_stable_indices_keeps_its_numbering(files):
    tmp, a, b, new = files
    store = Storage(str(tmp / "data"))
    old = build_corpus([a, b]).corpus  # the old build numbered 0.. in corpus order; no index table stored
    table = load_index(store, old.select("index", "content_hash", "prompt_id"))
    assert table.by_hash == dict(zip(old["content_hash"].to_list(), old["index"].to_list())) and table.next_index == 5
    text, built = build(store, [new, a, b], previous=old.select("index", "content_hash", "prompt_id"))
    assert text == {"a0": 0, "a1": 1, "a2": 2, "b0": 3, "b1": 4, "n0": 5, "n1": 6}
    assert built.keys == ["0000000-0000003", "0000004-0000006"]  # cut afresh on the old grid, as the old keys were


def test_partition_versions_change_only_where_prompts_changed(files):
    tmp, a, b, new = files
    store = Storage(str(tmp / "data"))
    _, first = chain(store, [a, b])
    _, second = build(store, [new, a, b], previous=first.corpus.select("index", "content_hash", "prompt_id"))
    assert {pk: second.versions[pk] for pk in first.versions} == first.versions
    rows = list(zip(second.corpus["index"].to_list(), second.corpus["content_hash"].to_list()))
    assert second.versions["0000005-0000006"] == prompt_version([r for r in rows if r[0] >= 5])


def test_a_damaged_table_is_an_error_naming_it(files):
    tmp = files[0]
    store = Storage(str(tmp / "data"))
    store.write_parquet(
        pl.DataFrame({"content_hash": ["x", "y"], "index": [0, 0], "prompt_id": ["x", "y"]}), *INDEX_FILE
    )
    with pytest.raises(
        ValueError, match=r"prompt_corpus/prompt_index\.parquet: a content hash or an index appears twice"
    ):
        load_index(store)
