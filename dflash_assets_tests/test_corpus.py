"""prompt_corpus: shapes, bad rows, duplicates, stable output, partitions registered in the instance."""

import gzip
import json
from pathlib import Path

import dagster as dg
import polars as pl
import pyarrow.parquet as pq
import pytest

from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.common.conversation import api_messages
from dflash_assets.common.settings import default_sources
from dflash_assets.data.ranges import key_range, partition_keys
from dflash_assets.data.shapes import CorpusError, build_corpus
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.prompts import CORPUS_FILE
from dflash_assets.stages.resources.storage import StorageResource

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
CODEALPACA = SHARED / "codealpaca" / "new_codealpaca.json"
SHAREGPT = SHARED / "sharegpt" / "dummy_conversation.json"


def materialize_corpus(instance, root, sources, **config):
    return dg.materialize(
        [prompt_corpus],
        instance=instance,
        resources={"storage": StorageResource(root=str(root))},
        run_config={"ops": {"prompt_corpus": {"config": {"sources": [str(s) for s in sources], **config}}}},
    )


def independent_count(codealpaca: Path, sharegpt: Path) -> tuple[int, int]:
    """Unique prompts and duplicates, computed without the project's parser."""
    seen, dups = set(), 0
    for rec in json.loads(codealpaca.read_text()):
        text = rec["instruction"].strip()
        if rec.get("input", "").strip():
            text += "\n\n" + rec["input"].strip()
        key = (("user", text),)
        dups += key in seen
        seen.add(key)
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    for rec in json.loads(sharegpt.read_text()):
        turns = [(roles[t["from"]], t["value"]) for t in rec["conversations"]]
        # turns: every (the default): the context of each assistant turn, and a trailing user message's
        ends = [p for p, t in enumerate(turns) if t[0] == "assistant"] + (
            [] if turns[-1][0] == "assistant" else [len(turns)]
        )
        for end in ends:
            key = tuple(turns[:end])
            if not any(role == "user" for role, _ in key):
                continue
            dups += key in seen
            seen.add(key)
    return len(seen), dups


@pytest.mark.skipif(not CODEALPACA.exists(), reason="../shared/data not present")
def test_shared_sources_counts_and_partitions(tmp_path):
    expected_rows, expected_dups = independent_count(CODEALPACA, SHAREGPT)
    with dg.instance_for_test() as instance:
        result = materialize_corpus(instance, tmp_path, [CODEALPACA, SHAREGPT], partition_size=1000)
        assert result.success
        meta = result.asset_materializations_for_node("prompt_corpus")[0].metadata
        assert meta["num_prompts"].value == expected_rows
        assert meta["duplicates"].value == expected_dups
        assert meta["rejected"].value == 0
        assert meta["rows_per_source"].value["new_codealpaca"] == 4535  # every CodeAlpaca instruction is distinct
        keys = instance.get_dynamic_partitions(prompt_ranges.name)
        assert keys == partition_keys(expected_rows, 1000)
        assert keys[0] == "0000000-0000999" and key_range(keys[-1]) == (4000, expected_rows - 1)
    corpus = pl.read_parquet(tmp_path / "prompt_corpus" / "corpus.parquet")
    assert corpus["index"].to_list() == list(range(expected_rows))
    assert corpus["prompt_id"].n_unique() == expected_rows
    # a ShareGPT conversation gives a row per assistant turn, the last one's context up to the last user message
    identity_2 = corpus.filter(pl.col("conversation_id") == "dummy_conversation:identity_2").sort("turn")
    assert identity_2["prompt_id"].to_list() == [f"dummy_conversation:identity_2#{t}" for t in range(3)]
    last = identity_2["messages"][-1].to_list()
    assert [m["role"] for m in last] == ["user", "assistant", "user", "assistant", "user"]
    assert last[-1]["content"] == "Goodbye"


def write_bad_file(path: Path) -> list[tuple[int, str]]:
    """A JSONL file with every bad-row kind; returns the expected (line, reason kind) of rejects."""
    lines: list[bytes] = [
        json.dumps({"id": "a", "messages": [{"role": "user", "content": "Add two numbers in C."}]}).encode(),  # 1 good
        b'{"id": "b", "messages": [{"role": "user", "content": "broken',  # 2 invalid JSON
        json.dumps({"text": "no known shape"}).encode(),  # 3 unknown shape
        json.dumps({"instruction": "   "}).encode(),  # 4 empty content
        json.dumps({"messages": [{"role": "user"}]}).encode(),  # 5 missing content
        b'{"prompt": "caf\xe9 au lait"}',  # 6 non-UTF-8 byte (latin-1 e-acute)
        json.dumps(
            {"id": "a", "messages": [{"role": "user", "content": "Something else entirely."}]}
        ).encode(),  # 7 conflicting id
        json.dumps({"conversations": [{"from": "gpt", "value": "I only answer."}]}).encode(),  # 8 no user message
        json.dumps({"conversations": [{"from": "robot", "value": "beep"}]}).encode(),  # 9 unknown role
        json.dumps(["not", "an", "object"]).encode(),  # 10 not an object
        json.dumps({"instruction": "Reverse a string.", "input": "abc"}).encode(),  # 11 good alpaca
        json.dumps(
            {
                "conversations": [
                    {"from": "human", "value": "Hi"},
                    {"from": "gpt", "value": "Hello"},
                    {"from": "human", "value": "Sort a list in Go."},
                    {"from": "gpt", "value": "dropped"},
                ]
            }
        ).encode(),  # 12 good
        json.dumps({"prompt": "Write FizzBuzz in Rust."}).encode(),  # 13 good
        json.dumps(
            {"id": "a", "messages": [{"role": "user", "content": "Add two numbers in C."}]}
        ).encode(),  # 14 exact duplicate
        b'{"prompt": "torn last li',  # 15 torn last line
    ]
    path.write_bytes(b"\n".join(lines))
    return [
        (2, "invalid JSON"),
        (3, "unknown shape"),
        (4, "empty content"),
        (5, "empty content"),
        (6, "invalid UTF-8"),
        (7, "conflicting duplicate id"),
        (8, "no user message"),
        (9, "unknown role"),
        (10, "not a JSON object"),
        (15, "invalid JSON"),
    ]


def test_bad_rows_are_set_aside_and_good_rows_kept(tmp_path):
    bad = tmp_path / "mixed.jsonl"
    expected = write_bad_file(bad)
    result = build_corpus([str(bad)])
    got = [(r["line"], r["reason"].split(":")[0]) for r in result.rejected.iter_rows(named=True)]
    assert got == expected
    # json names the column where the unterminated string starts (1-based); "at" is said once
    lines = bad.read_bytes().split(b"\n")
    reasons = dict(zip(result.rejected["line"].to_list(), result.rejected["reason"].to_list()))
    broken_col, torn_col = lines[1].index(b'"broken') + 1, lines[14].index(b'"torn') + 1
    assert (
        reasons[2]
        == f"invalid JSON: Unterminated string starting at column {broken_col}"
        == "invalid JSON: Unterminated string starting at column 54"
    )
    assert reasons[15] == f"invalid JSON: Unterminated string starting at column {torn_col}"
    assert all(r["file"] == str(bad) and r["source"] == "mixed" for r in result.rejected.iter_rows(named=True))
    # line 12's conversation has two assistant turns: a row each (turns: every, the default)
    assert result.corpus["line"].to_list() == [1, 11, 12, 12, 13]
    assert result.duplicates_per_source == {"mixed": 1}
    msgs = [api_messages(m) for m in result.corpus["messages"].to_list()]
    assert msgs[1] == [{"role": "user", "content": "Reverse a string.\n\nabc"}]
    assert [m["content"] for m in msgs[2]] == ["Hi"]
    assert [m["content"] for m in msgs[3]] == ["Hi", "Hello", "Sort a list in Go."]
    assert result.corpus["prompt_id"][0] == "mixed:a"


def test_gzip_parquet_and_json_array(tmp_path):
    rows = [{"prompt": f"Task {i}: print {i}."} for i in range(5)]
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress("\n".join(json.dumps(r) for r in rows).encode()))
    (tmp_path / "b.json").write_text(
        json.dumps(
            [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Explain RAII."}]}]
        )
    )
    pl.DataFrame({"instruction": ["Write a SQL join."], "input": [""]}).write_parquet(tmp_path / "c.parquet")
    result = build_corpus([str(tmp_path / "a.jsonl.gz"), str(tmp_path / "b.json"), str(tmp_path / "*.parquet")])
    assert result.rows_per_source == {"a": 5, "b": 1, "c": 1}
    assert result.corpus["source"].to_list() == ["a"] * 5 + ["b", "c"]
    assert api_messages(result.corpus["messages"][5].to_list())[0] == {"role": "system", "content": "Be brief."}


def test_unreadable_file_and_all_rejected_source_fail_naming_the_file(tmp_path):
    (tmp_path / "junk.json").write_text("[{ this is not json")
    with pytest.raises(CorpusError, match=r"junk\.json"):
        build_corpus([str(tmp_path / "junk.json")])
    (tmp_path / "empty.jsonl").write_text(json.dumps({"foo": 1}) + "\n" + json.dumps({"bar": 2}) + "\n")
    with pytest.raises(CorpusError, match=r"empty.jsonl: no usable prompt \(2 rows rejected: \{'unknown shape': 2\}"):
        build_corpus([str(tmp_path / "empty.jsonl")])
    with pytest.raises(CorpusError, match="matched no file"):
        build_corpus([str(tmp_path / "nothing-*.jsonl")])
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(CorpusError, match=r"bad\.jsonl\.gz: cannot read"):
        build_corpus([str(tmp_path / "bad.jsonl.gz")])


def test_rematerializing_is_byte_identical_and_default_corpus_is_humaneval(tmp_path):
    with dg.instance_for_test() as instance:
        assert materialize_corpus(instance, tmp_path / "one", default_sources()).success
        assert materialize_corpus(instance, tmp_path / "two", default_sources()).success
        assert materialize_corpus(instance, tmp_path / "fifty", default_sources(), partition_size=50).success
        assert instance.get_dynamic_partitions(prompt_ranges.name) == [
            "0000000-0000049",
            "0000050-0000099",
            "0000100-0000149",
            "0000150-0000163",
        ]
    one = (tmp_path / "one").joinpath(*CORPUS_FILE).read_bytes()
    two = (tmp_path / "two").joinpath(*CORPUS_FILE).read_bytes()
    assert one == two
    corpus = pl.read_parquet(tmp_path / "one" / "prompt_corpus" / "corpus.parquet")
    assert corpus.height == 164 and corpus["prompt_id"][0] == "HumanEval:HumanEval/0"
    # a row group per partition (a partition's run reads its group alone), the same rows
    fifty = (tmp_path / "fifty").joinpath(*CORPUS_FILE)
    groups = pq.ParquetFile(fifty).metadata
    assert [groups.row_group(g).num_rows for g in range(groups.num_row_groups)] == [50, 50, 50, 14]
    assert pl.read_parquet(fifty).equals(corpus)


def test_partition_keys_sort_and_cover():
    keys = partition_keys(2500, 1000)
    assert keys == ["0000000-0000999", "0001000-0001999", "0002000-0002499"]
    assert sorted(keys) == keys
    assert partition_keys(0, 10) == []
    with pytest.raises(ValueError, match="bad partition key"):
        key_range("12-3")
