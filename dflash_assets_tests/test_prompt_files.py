"""Prompt files a user brings (issue 16), each with the input that showed the bug:
list-of-parts content, tool calls / tool results, U+2028 inside JSONL strings, a UTF-8 BOM, a file with no
usable row (its rejects still written; the error names the file, keys/columns found and shapes accepted),
an empty file, and s3:// sources read through the storage resource's endpoint and credentials (moto)."""

from __future__ import annotations

import json

import dagster as dg
import polars as pl
import pytest

from dflash_assets.assets.prompts import corpus_fingerprint, prompt_corpus
from dflash_assets.common.conversation import api_messages
from dflash_assets.data.conversation_shapes import normalize_record
from dflash_assets.data.shapes import CorpusError, build_corpus
from dflash_assets.stages.prompts import CORPUS_FILE, REJECTED_FILE, PromptCorpusConfig
from dflash_assets.stages.resources.storage import StorageResource

try:
    from dflash_assets_tests.s3_fixtures import moto_server, s3_env, s3_target
except ImportError:
    from s3_fixtures import moto_server, s3_env, s3_target  # type: ignore[no-redef]  # noqa: F401


def jsonl(path, records, prefix: bytes = b"") -> str:
    path.write_bytes(prefix + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())
    return str(path)


def rejected_reasons(result) -> dict[int, str]:
    return dict(zip(result.rejected["line"].to_list(), result.rejected["reason"].to_list()))


def test_list_of_parts_content_is_joined_and_a_non_text_part_rejects_the_row(tmp_path):
    """Was: 'messages[0] (user) has no text' for OpenAI content parts."""
    parts = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Reverse a list"}, {"type": "text", "text": "in Python."}],
            },
        ]
    }
    image = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                ],
            }
        ]
    }
    result = build_corpus([jsonl(tmp_path / "p.jsonl", [parts, image])])
    assert [api_messages(m) for m in result.corpus["messages"].to_list()] == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse a list\nin Python."}]
    ]
    assert rejected_reasons(result) == {
        2: "non-text content: messages[0] (user) part 1 has type 'image_url'; only text parts are supported"
    }


def test_tool_calls_before_the_last_user_turn_are_context_and_a_result_answering_no_call_is_rejected():
    """Was: 'messages[1] (assistant) has no text' with no word of tool messages; then (issue 43) every tool
    exchange before the last user message rejected the row. Now it is context; a malformed one is rejected."""
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}],
    }
    record = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            call,
            {"role": "tool", "tool_call_id": "1", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "And tomorrow?"},
        ]
    }
    assert normalize_record(record) == [
        record["messages"][0],
        {"role": "assistant", "tool_calls": call["tool_calls"]},  # content null: dropped, as api_messages does
        record["messages"][2],
        record["messages"][3],
        record["messages"][4],
    ]
    no_call = {"messages": [record["messages"][0], {"role": "tool", "content": "sunny"}, record["messages"][4]]}
    with pytest.raises(ValueError, match=r"tool message: messages\[1\] \(tool\) is a tool result with no assistant"):
        normalize_record(no_call)
    # a tool exchange AFTER the last user turn: the answer after the tool result is what gets regenerated
    assert normalize_record({"messages": [record["messages"][0], call, record["messages"][2]]}) == [
        record["messages"][0],
        {"role": "assistant", "tool_calls": call["tool_calls"]},
        record["messages"][2],
    ]


def test_jsonl_is_split_on_newline_only(tmp_path):
    """Was: U+2028 / U+2029 / U+0085 inside a JSON string split the line (valid row rejected, later lines
    misnumbered)."""
    path = tmp_path / "sep.jsonl"
    rows = ['{"prompt": "one\u2028two\u2029three\u0085four"}', "{not json", '{"prompt": "last"}']
    path.write_text("\r\n".join(rows) + "\n", encoding="utf-8")
    result = build_corpus([str(path)])
    assert [m[-1]["content"] for m in result.corpus["messages"].to_list()] == [
        "one\u2028two\u2029three\u0085four",
        "last",
    ]
    assert result.corpus["line"].to_list() == [1, 3]
    assert list(rejected_reasons(result)) == [2]


def test_utf8_bom_is_stripped_for_jsonl_and_json_arrays(tmp_path):
    """Was: a BOM rejected the first row (JSONL) or the whole array (JSON)."""
    a = jsonl(tmp_path / "bom.jsonl", [{"prompt": "first"}, {"prompt": "second"}], prefix=b"\xef\xbb\xbf")
    b = tmp_path / "bom.json"
    b.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"instruction": "third"}]).encode())
    result = build_corpus([a, str(b)])
    assert [m[-1]["content"] for m in result.corpus["messages"].to_list()] == ["first", "second", "third"]
    assert result.rejected.height == 0


def test_a_file_with_no_usable_row_names_file_keys_and_shapes_and_still_writes_its_rejects(tmp_path):
    """Was: rejected.parquet not written; the error named neither the keys found nor the shapes accepted."""
    source = jsonl(
        tmp_path / "qa.jsonl", [{"question": "What is 2+2?", "answer": "4"}, {"question": "Capital of France?"}]
    )
    with pytest.raises(CorpusError) as err:
        build_corpus([source])
    msg = str(err.value)
    assert msg.startswith(f"{source}: no usable prompt (2 rows rejected: {{'unknown shape': 2}}")
    assert "keys found: ['answer', 'question']" in msg
    assert (
        "Shapes accepted" in msg
        and "'messages'" in msg
        and "'conversations'" in msg
        and "'instruction'" in msg
        and "'prompt'" in msg
    )
    assert err.value.rejected.height == 2
    parquet = tmp_path / "qa.parquet"
    pl.DataFrame({"question": ["a?"], "answer": ["b"]}).write_parquet(parquet)
    with pytest.raises(CorpusError, match=r"qa.parquet: no usable prompt .*columns found: \['question', 'answer'\]"):
        build_corpus([str(parquet)])

    root = tmp_path / "data"
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources={"storage": StorageResource(root=str(root))},
            run_config={"ops": {"prompt_corpus": {"config": {"sources": [source]}}}},
            raise_on_error=False,
        )
    assert not result.success
    failure = result.get_step_failure_events()[0].event_specific_data.error.message
    assert (
        source in failure
        and "keys found: ['answer', 'question']" in failure
        and str(root / "prompt_corpus" / "rejected.parquet") in failure
    )
    rejects = pl.read_parquet(root.joinpath(*REJECTED_FILE))
    assert rejects["line"].to_list() == [1, 2] and set(rejects["file"]) == {source}
    assert not root.joinpath(*CORPUS_FILE).exists()


@pytest.mark.parametrize(
    "name, content, says",
    [
        ("empty.jsonl", b"", "the file is empty (0 bytes)"),
        ("blank.jsonl", b"\n \n", "the file is empty (3 bytes, only whitespace)"),
        ("empty.json", b"[]", "the file is empty (an empty JSON array)"),
        ("bom_only.jsonl", b"\xef\xbb\xbf", "the file is empty (3 bytes, only whitespace)"),
    ],
)
def test_an_empty_file_is_called_empty(tmp_path, name, content, says):
    """Was: 'no usable prompt (0 rows rejected: {})'."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CorpusError) as err:
        build_corpus([str(path)])
    assert str(err.value).startswith(f"{path}: {says}")


def test_s3_sources_are_read_with_the_storage_resources_endpoint_and_credentials(
    tmp_path, s3_target, s3_env, monkeypatch
):
    """Was: s3:// prompt sources ignored the storage resource's endpoint and credentials."""
    body = "".join(json.dumps({"prompt": f"Task {i}"}) + "\n" for i in range(5)).encode()
    s3_target.client.put_object(Bucket=s3_target.bucket, Key="prompts/tasks.jsonl", Body=body)
    source = f"s3://{s3_target.bucket}/prompts/tasks.jsonl"
    access, secret = s3_env.access_key, s3_env.secret_key
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)  # only the resource knows where the bucket is and how to sign
    storage = StorageResource(
        root=str(tmp_path / "data"),
        endpoint_url=s3_target.endpoint_url,
        region="us-east-1",
        aws_access_key_id=access,
        aws_secret_access_key=secret,
    )
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources={"storage": storage},
            run_config={"ops": {"prompt_corpus": {"config": {"sources": [source], "partition_size": 2}}}},
        )
    assert result.success
    corpus = pl.read_parquet(tmp_path / "data" / "prompt_corpus" / "corpus.parquet")
    assert [m[-1]["content"] for m in corpus["messages"].to_list()] == [f"Task {i}" for i in range(5)]
    assert set(corpus["file"]) == {source}
    config = PromptCorpusConfig(sources=[source])
    before = corpus_fingerprint(config, storage)
    s3_target.client.put_object(
        Bucket=s3_target.bucket, Key="prompts/tasks.jsonl", Body=body + b'{"prompt": "Task 5"}\n'
    )
    assert corpus_fingerprint(config, storage) != before  # a changed S3 source is seen by the main job
