"""Issue 27, prompt files: a bad record of any kind costs its row (set aside with file, line and reason) in every
shape; a file that cannot be read, or is over a bound, fails naming the file, the bound and the fix; files are
streamed (a gzip bomb is refused, not swapped in). Each case with the input that showed it."""

from __future__ import annotations

import gzip
import json

import dagster as dg
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_assets.assets.prompts import corpus_fingerprint, prompt_corpus
from dflash_assets.data.reader import MiB, ReadLimits
from dflash_assets.data.shapes import CorpusError, build_corpus
from dflash_assets.stages.prompts import REJECTED_FILE, PromptCorpusConfig
from dflash_assets.stages.resources.storage import StorageResource

DEEP = 100_000  # far past the JSON reader's ~1,000 levels
GOOD = ['{"prompt": "Sort a list in Go."}', '{"prompt": "Reverse a string in C."}']
# (line text, reason kind) for each hostile record; the file's other lines are GOOD
HOSTILE = [
    ('{"prompt": "lone \\ud800 surrogate"}', "invalid Unicode"),  # was: UnicodeEncodeError in content_hash
    ('{"prompt": "deep", "meta": ' + "[" * DEEP + "]" * DEEP + "}", "too deeply nested"),  # was: RecursionError
    ('{"prompt": "big int", "id": 1' + "0" * 5000 + "}", "invalid JSON"),  # was: ValueError past JSONDecodeError
    ('{"prompt": "id with a surrogate", "id": "\\udc80"}', "invalid Unicode"),  # was: polars failed the corpus
    ('{"messages": [{"role": "user", "content": ["part", "\\ud83d"]}]}', "invalid Unicode"),
]


def kinds(result) -> list[tuple[int, str]]:
    return [(r["line"], r["reason"].split(":")[0]) for r in result.rejected.iter_rows(named=True)]


def test_a_hostile_jsonl_record_costs_its_row_and_is_written_to_rejected_parquet(tmp_path):
    lines = [GOOD[0], *(text for text, _ in HOSTILE), GOOD[1]]
    source = tmp_path / "hostile.jsonl"
    source.write_text("\n".join(lines) + "\n")
    root = tmp_path / "data"
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources={"storage": StorageResource(root=str(root))},
            run_config={"ops": {"prompt_corpus": {"config": {"sources": [str(source)]}}}},
        )
    assert result.success
    corpus = pl.read_parquet(root / "prompt_corpus" / "corpus.parquet")
    assert [m[-1]["content"] for m in corpus["messages"].to_list()] == ["Sort a list in Go.", "Reverse a string in C."]
    assert corpus["line"].to_list() == [1, len(lines)]
    rejects = pl.read_parquet(root.joinpath(*REJECTED_FILE))
    assert [(r["line"], r["reason"].split(":")[0]) for r in rejects.iter_rows(named=True)] == [
        (i + 2, kind) for i, (_, kind) in enumerate(HOSTILE)
    ]
    assert set(rejects["file"]) == {str(source)}
    assert rejects["reason"][0] == (
        "invalid Unicode: the text holds a lone surrogate (\\ud800), which no UTF-8 file can store"
    )
    assert rejects["raw"][0] == lines[1]  # the line as written, for the user to find
    assert len(rejects["raw"][2]) == 300  # a preview, not the record


def test_a_hostile_json_array_element_costs_its_row(tmp_path):
    """Was: the whole array failed (RecursionError for one deep element, UnicodeEncodeError for a surrogate)."""
    source = tmp_path / "hostile.json"
    source.write_text("[\n" + ",\n".join([GOOD[0], *(text for text, _ in HOSTILE), GOOD[1]]) + "\n]")
    result = build_corpus([str(source)])
    assert result.corpus["line"].to_list() == [1, len(HOSTILE) + 2]  # element numbers
    assert kinds(result) == [(i + 2, kind) for i, (_, kind) in enumerate(HOSTILE)]
    # strings holding brackets and escaped quotes do not confuse where an element ends
    tricky = tmp_path / "tricky.json"
    tricky.write_text(json.dumps([{"prompt": 'a ] } [ { " \\" end'}, "a string", 7, {"prompt": "last"}]))
    result = build_corpus([str(tricky)])
    assert [m[-1]["content"] for m in result.corpus["messages"].to_list()] == ['a ] } [ { " \\" end', "last"]
    assert kinds(result) == [(2, "not a JSON object"), (3, "not a JSON object")]


def test_a_parquet_row_with_bytes_that_are_not_utf8_costs_its_row(tmp_path):
    """Was: UnicodeDecodeError from Arrow ended prompt_corpus without naming the file."""
    values = pa.array([b"Write a parser.", b"\xff\xfe broken", b"Write a lexer."], pa.binary()).view(pa.string())
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": values}), path)
    result = build_corpus([str(path)])
    assert [m[-1]["content"] for m in result.corpus["messages"].to_list()] == ["Write a parser.", "Write a lexer."]
    assert result.corpus["line"].to_list() == [1, 3]
    assert kinds(result) == [(2, "invalid UTF-8")]


def gzip_bomb(path, content_bytes: int) -> int:
    """A gzip of ``content_bytes`` zeros made of repeated 16 MiB members (cheap to build); returns its size."""
    member = gzip.compress(b"\0" * (16 * MiB), compresslevel=9)
    path.write_bytes(member * (content_bytes // (16 * MiB)))
    return path.stat().st_size


def test_unreadable_files_fail_naming_the_file_the_bound_and_the_fix(tmp_path):
    body = "".join(json.dumps({"prompt": f"Task {i}"}) + "\n" for i in range(2000)).encode()
    corrupt = bytearray(gzip.compress(body))
    corrupt[40:60] = b"\xff" * 20
    (tmp_path / "corrupt.jsonl.gz").write_bytes(corrupt)  # was: a raw zlib.error naming no file
    with pytest.raises(
        CorpusError,
        match=r"corrupt.jsonl.gz: cannot read the file past byte .* \(zlib.error: .*\); "
        r"the file is damaged or cut short: fix or fetch it again",
    ):
        build_corpus([str(tmp_path / "corrupt.jsonl.gz")])
    whole = gzip.compress(body)
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CorpusError, match=r"cut.jsonl.gz: cannot read the file past byte .* \(EOFError"):
        build_corpus([str(tmp_path / "cut.jsonl.gz")])

    # a 20 MB gzip of zeros (~20 GB of content; the reader used to decompress it whole, several copies)
    assert gzip_bomb(tmp_path / "bomb.jsonl.gz", 1232 * 16 * MiB) > 20_000_000
    with pytest.raises(CorpusError) as err:
        build_corpus([str(tmp_path / "bomb.jsonl.gz")])
    assert str(err.value).startswith(
        f"{tmp_path / 'bomb.jsonl.gz'}: line 1 is longer than 16 MiB "
        "(ops.prompt_corpus.config.max_record_mb); no prompt record is this long"
    )
    assert "decompression bomb" in str(err.value) and "raise ops.prompt_corpus.config.max_record_mb" in str(err.value)

    (tmp_path / "big.jsonl").write_bytes(body)  # 40 KB of good lines, over a 16 KB file bound
    with pytest.raises(
        CorpusError,
        match=r"big.jsonl: more than 16,384 bytes \(ops.prompt_corpus.config.max_file_gb\) "
        r"of content.*split it into several files",
    ):
        build_corpus([str(tmp_path / "big.jsonl")], limits=ReadLimits(max_file_bytes=16 * 1024))
    pl.DataFrame({"prompt": [f"Task {i}" for i in range(2000)]}).write_parquet(tmp_path / "big.parquet")
    with pytest.raises(CorpusError, match=r"big.parquet: its footer declares .* of uncompressed data, over"):
        build_corpus([str(tmp_path / "big.parquet")], limits=ReadLimits(max_file_bytes=1024))
    (tmp_path / "array.json").write_text('[{"prompt": "a"} {"prompt": "b"}]')
    with pytest.raises(CorpusError, match=r"array.json: not a valid JSON array \(expected ',' or ']' after element 1"):
        build_corpus([str(tmp_path / "array.json")])


def test_the_record_bound_is_a_prompt_corpus_setting_and_not_part_of_its_fingerprint(tmp_path):
    source = tmp_path / "long.jsonl"
    source.write_text(json.dumps({"prompt": "x" * 3000}) + "\n")
    root = tmp_path / "data"
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources={"storage": StorageResource(root=str(root))},
            raise_on_error=False,
            run_config={"ops": {"prompt_corpus": {"config": {"sources": [str(source)], "max_record_mb": 0.001}}}},
        )
    assert not result.success
    message = result.get_step_failure_events()[0].event_specific_data.error.message
    assert f"{source}: line 1 is longer than 1,048 bytes (ops.prompt_corpus.config.max_record_mb)" in message
    # the bounds refuse a file or not; they never change a corpus that builds, so its fingerprint ignores them
    assert corpus_fingerprint(
        PromptCorpusConfig(sources=[str(source)], max_record_mb=1, max_file_gb=1)
    ) == corpus_fingerprint(PromptCorpusConfig(sources=[str(source)]))


@pytest.mark.parametrize("name", ["mixed.jsonl", "mixed.jsonl.gz", "mixed.json"])
def test_records_cut_across_read_chunks_read_the_same(tmp_path, monkeypatch, name):
    """The stream reader keeps a record whole whatever read chunk its bytes arrive in (5-byte chunks here):
    BOM, blank and CRLF lines, U+2028 inside strings, brackets, quotes and backslashes inside strings."""
    import dflash_assets.data.reader as reader

    records = [
        {"prompt": "one\u2028two"},
        {"prompt": 'brackets ] } [ { and a quote " inside'},
        {"prompt": "ends with a backslash \\"},
        {"messages": [{"role": "user", "content": "é ✓ 𝄞"}]},
        {"prompt": "x" * 300},
        {"prompt": ""},
        {"instruction": "Sort.", "input": "[3, 1]"},
    ]
    if name.endswith(".json"):
        text = "\ufeff[\n" + ",\r\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n]\n"
    else:
        text = "\ufeff\n\n" + "\r\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n \n"
    data = text.encode()
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    whole = build_corpus([str(tmp_path / name)])
    monkeypatch.setattr(reader, "CHUNK_BYTES", 5)
    cut = build_corpus([str(tmp_path / name)])
    assert cut.corpus.equals(whole.corpus) and cut.rejected.equals(whole.rejected)
    assert [m[-1]["content"] for m in whole.corpus["messages"].to_list()] == [
        "one\u2028two",
        'brackets ] } [ { and a quote " inside',
        "ends with a backslash \\",
        "é ✓ 𝄞",
        "x" * 300,
        "Sort.\n\n[3, 1]",
    ]
    first = 1 if name.endswith(".json") else 3  # element numbers; JSONL lines after a BOM and two blank lines
    assert whole.corpus["line"].to_list() == [first + k for k in (0, 1, 2, 3, 4, 6)]
    assert kinds(whole) == [(first + 5, "empty content")]
