"""Agentic conversations in the corpus (issue 43, items 1-2): OpenAI and ShareGPT (LLaMA-Factory) tool
conversations become one row per assistant turn (``turns: every``) or per record (``turns: last``), with the
exact context, tools, turn, turn kind and conversation id; malformed tool use is set aside with its reason while
the good rows of the same file are kept; plain single-turn records keep the content hash they always had; the
asset run again keeps every index, and a corpus stored before this change is still read."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.common.conversation import MESSAGES_SCHEMA, api_messages
from dflash_assets.data.shapes import build_corpus
from dflash_assets.stages.completions.tables import load_range_prompts
from dflash_assets.stages.prompts import CORPUS_FILE
from dflash_assets.stages.resources.storage import StorageResource

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a helpful agent."}
USER_1 = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
ASSISTANT_CALL = {
    "role": "assistant",
    "content": None,
    "reasoning_content": "I should look it up.",
    "tool_calls": [CALL],
}
RESULT = {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "sunny, 21 C"}
ANSWER = {"role": "assistant", "content": "It is sunny in Paris."}
USER_2 = {"role": "user", "content": "And should I take an umbrella?"}
FINAL = {"role": "assistant", "content": "No need."}
OPENAI = {
    "id": "trace-1",
    "tools": WEATHER_TOOLS,
    "messages": [SYSTEM, USER_1, ASSISTANT_CALL, RESULT, ANSWER, USER_2, FINAL],
}

# ASSISTANT_CALL as the corpus gives it back (API-shaped: a null content is no key at all)
CALL_API = {"role": "assistant", "reasoning_content": "I should look it up.", "tool_calls": [CALL]}

ADD_SCHEMA = {
    "name": "add",
    "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}
SHAREGPT = {
    "conversations": [
        {"from": "human", "value": "What is 2 + 3?"},
        {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}})},
        {"from": "observation", "value": "5"},
        {"from": "gpt", "value": "2 + 3 = 5."},
    ],
    "tools": json.dumps([ADD_SCHEMA]),
}
# what the ShareGPT record means, written out by hand: the call gets the id call_0, the result answers it
SHAREGPT_MESSAGES = [
    {"role": "user", "content": "What is 2 + 3?"},
    {
        "role": "assistant",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
    },
    {"role": "tool", "content": "5", "tool_call_id": "call_0", "name": "add"},
]
SHAREGPT_TOOLS = [{"type": "function", "function": ADD_SCHEMA}]


def sha16(payload) -> str:
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False, sort_keys=True).encode()).hexdigest()[:16]


def jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def rows(corpus: pl.DataFrame) -> list[dict]:
    """The corpus rows with messages API-shaped and tools parsed, for comparing with hand-written values."""
    out = []
    for r in corpus.iter_rows(named=True):
        out.append(
            {
                "prompt_id": r["prompt_id"],
                "conversation_id": r["conversation_id"],
                "turn": r["turn"],
                "turn_kind": r["turn_kind"],
                "messages": api_messages(r["messages"]),
                "tools": None if r["tools"] is None else json.loads(r["tools"]),
            }
        )
    return out


def test_openai_tool_conversation_gives_a_row_per_assistant_turn(tmp_path):
    result = build_corpus([jsonl(tmp_path / "traces.jsonl", [OPENAI])], turns="every")
    assert result.corpus.schema["messages"] == MESSAGES_SCHEMA and result.rejected.height == 0
    assert rows(result.corpus) == [
        {
            "prompt_id": "traces:trace-1#0",
            "conversation_id": "traces:trace-1",
            "turn": 0,
            "turn_kind": "follow_up",  # tools are offered: not a plain prompt
            "messages": [SYSTEM, USER_1],
            "tools": WEATHER_TOOLS,
        },
        {
            "prompt_id": "traces:trace-1#1",
            "conversation_id": "traces:trace-1",
            "turn": 1,
            "turn_kind": "after_tool",
            "messages": [SYSTEM, USER_1, CALL_API, RESULT],
            "tools": WEATHER_TOOLS,
        },
        {
            "prompt_id": "traces:trace-1#2",
            "conversation_id": "traces:trace-1",
            "turn": 2,
            "turn_kind": "follow_up",
            "messages": [SYSTEM, USER_1, CALL_API, RESULT, ANSWER, USER_2],
            "tools": WEATHER_TOOLS,
        },
    ]
    # stored: tool_calls as JSON text, every message field present (nulls where the message has none)
    stored_call = result.corpus["messages"][1].to_list()[2]
    assert stored_call["content"] is None and json.loads(stored_call["tool_calls"]) == [CALL]
    # the arguments stay the exact JSON text the source gave
    assert json.loads(stored_call["tool_calls"])[0]["function"]["arguments"] == '{"city": "Paris"}'
    # the key: the API-shaped context and the tools' stored text
    tools_text = result.corpus["tools"][0]
    assert result.corpus["content_hash"][1] == sha16(
        {"messages": [SYSTEM, USER_1, CALL_API, RESULT], "tools": tools_text}
    )
    assert result.corpus["index"].to_list() == [0, 1, 2]


def test_turns_last_gives_one_row_per_record_regenerating_the_answer_after_the_tool(tmp_path):
    answer_after_tool = {"id": 7, "tools": WEATHER_TOOLS, "messages": [USER_1, ASSISTANT_CALL, RESULT, ANSWER]}
    result = build_corpus([jsonl(tmp_path / "t.jsonl", [OPENAI, answer_after_tool])], turns="last")
    assert rows(result.corpus) == [
        {
            "prompt_id": "t:trace-1",  # one row: the id prompts always had
            "conversation_id": "t:trace-1",
            "turn": 2,
            "turn_kind": "follow_up",
            "messages": [SYSTEM, USER_1, CALL_API, RESULT, ANSWER, USER_2],
            "tools": WEATHER_TOOLS,
        },
        {
            "prompt_id": "t:7",
            "conversation_id": "t:7",
            "turn": 1,
            "turn_kind": "after_tool",
            "messages": [USER_1, CALL_API, RESULT],
            "tools": WEATHER_TOOLS,
        },
    ]


@pytest.mark.parametrize("turns", ["every", "last"])
def test_sharegpt_function_call_and_observation_turns(tmp_path, turns):
    result = build_corpus([jsonl(tmp_path / "lf.jsonl", [SHAREGPT])], turns=turns)
    tools_text = json.dumps(SHAREGPT_TOOLS)
    conversation_id = sha16({"messages": SHAREGPT_MESSAGES, "tools": tools_text})  # final reply left out
    assert result.corpus["tools"].to_list() == [tools_text] * result.corpus.height
    first = {"turn": 0, "turn_kind": "follow_up", "messages": SHAREGPT_MESSAGES[:1], "tools": SHAREGPT_TOOLS}
    second = {"turn": 1, "turn_kind": "after_tool", "messages": SHAREGPT_MESSAGES, "tools": SHAREGPT_TOOLS}
    if turns == "every":
        expected = [
            {"prompt_id": f"{conversation_id}#0", "conversation_id": conversation_id, **first},
            {"prompt_id": f"{conversation_id}#1", "conversation_id": conversation_id, **second},
        ]
    else:  # one row: its prompt id is its content hash, as prompts without an id always had
        row_hash = sha16({"messages": SHAREGPT_MESSAGES, "tools": tools_text})
        expected = [{"prompt_id": row_hash, "conversation_id": conversation_id, **second}]
    assert rows(result.corpus) == expected


def test_legacy_function_call_and_parallel_calls_without_ids(tmp_path):
    legacy = {
        "functions": [WEATHER_TOOLS[0]["function"]],
        "messages": [
            {"role": "user", "content": "Rome?"},
            {"role": "assistant", "content": None, "function_call": {"name": "weather", "arguments": {"city": "Rome"}}},
            {"role": "function", "name": "weather", "content": "rain"},
            {"role": "assistant", "content": "Rain in Rome."},
        ],
    }
    parallel = {
        "id": "p",
        "messages": [
            {"role": "user", "content": "Paris and Rome?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
                    {"function": {"name": "weather", "arguments": '{"city": "Rome"}'}},
                ],
            },
            {"role": "tool", "content": "sunny"},
            {"role": "tool", "content": "rain"},
        ],
    }
    result = build_corpus([jsonl(tmp_path / "l.jsonl", [legacy, parallel])], turns="last")
    got = rows(result.corpus)
    assert got[0]["messages"] == [
        {"role": "user", "content": "Rome?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}
            ],
        },
        {"role": "tool", "content": "rain", "tool_call_id": "call_0", "name": "weather"},
    ]
    assert got[0]["tools"] == WEATHER_TOOLS and got[0]["turn_kind"] == "after_tool"
    # a trailing tool result with no reply: its row regenerates the answer; results answer the calls in order
    assert got[1]["messages"][2:] == [
        {"role": "tool", "content": "sunny", "tool_call_id": "call_0"},
        {"role": "tool", "content": "rain", "tool_call_id": "call_1"},
    ]
    assert got[1]["tools"] is None and (got[1]["turn"], got[1]["turn_kind"]) == (1, "after_tool")


def test_malformed_tool_use_is_set_aside_with_its_reason_and_good_rows_are_kept(tmp_path):
    def convo(*messages, **extra):
        return {"messages": [USER_1, *messages], **extra}

    bad_args = {**CALL, "function": {"name": "weather", "arguments": "{city: Paris"}}
    no_name = {**CALL, "function": {"arguments": "{}"}}
    records = [
        OPENAI,  # 1 good
        convo(ASSISTANT_CALL, {**RESULT, "tool_call_id": "c9"}, ANSWER),  # 2 answers no call made
        convo({"role": "tool", "content": "sunny"}, ANSWER),  # 3 no call before it
        convo({**ASSISTANT_CALL, "tool_calls": [bad_args]}, RESULT, ANSWER),  # 4 arguments not JSON
        convo({**ASSISTANT_CALL, "tool_calls": [no_name]}, RESULT, ANSWER),  # 5 no function name
        convo(ANSWER, tools={"name": "weather"}),  # 6 tools not a list
        convo(ANSWER, tools=[{"type": "function", "function": {"description": "x"}}]),  # 7 no name
        convo({"role": "robot", "content": "beep"}, ANSWER),  # 8 unknown role
        convo({"role": "assistant", "content": ""}, USER_2, FINAL),  # 9 neither content nor calls
        convo(ASSISTANT_CALL, USER_2, FINAL),  # 10 a call with no result
        {
            "conversations": [
                {"from": "human", "value": "2+3?"},
                {"from": "function_call", "value": "add(2, 3)"},
                {"from": "observation", "value": "5"},
                {"from": "gpt", "value": "5"},
            ]
        },  # 11 value not JSON
        convo(ASSISTANT_CALL, RESULT, RESULT, ANSWER),  # 12 the same call answered twice
        convo({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),  # 13 non-text
        {"prompt": "Write FizzBuzz in Rust."},  # 14 good
    ]
    result = build_corpus([jsonl(tmp_path / "mixed.jsonl", records)])
    reasons = dict(zip(result.rejected["line"].to_list(), result.rejected["reason"].to_list()))
    assert {line: reason.split(":")[0] for line, reason in reasons.items()} == {
        2: "tool message",
        3: "tool message",
        4: "bad tool call",
        5: "bad tool call",
        6: "bad tools",
        7: "bad tools",
        8: "unknown role",
        9: "empty content",
        10: "unanswered tool call",
        11: "bad tool call",
        12: "tool message",
        13: "non-text content",
    }
    assert reasons[2] == (
        "tool message: messages[2] (tool) answers call id 'c9', which the assistant turn before it did not make "
        "(its calls: ['c1'])"
    )
    assert reasons[3] == "tool message: messages[1] (tool) is a tool result with no assistant tool call before it"
    assert reasons[4].startswith(
        "bad tool call: messages[1] (assistant) tool_calls[0] (weather) arguments are not JSON (Expecting property"
    )
    assert reasons[5] == "bad tool call: messages[1] (assistant) tool_calls[0] has no function name"
    assert reasons[6] == "bad tools: 'tools' must be a list of function schemas, got dict"
    assert reasons[9] == "empty content: messages[1] (assistant) has neither text nor tool_calls"
    assert (
        reasons[10]
        == "unanswered tool call: messages[1] (assistant) calls ['c1'] get no tool result before messages[2]"
    )
    assert reasons[12] == "tool message: messages[3] (tool) answers call id 'c1' a second time"
    assert result.corpus["line"].to_list() == [1, 1, 1, 14]
    assert result.rejected_by_reason["bad tool call"] == 3


def test_arguments_whose_text_the_tokenizer_cannot_take_are_set_aside_naming_file_line_and_reason(tmp_path):
    """Issue 50, finding 4: arguments text ``{"path": "\\ud800"}`` (ASCII, valid JSON) was accepted into the corpus;
    completions then failed with the tokenizer's ``TypeError: TextEncodeInput must be Union[...]``, naming no row or
    file, and the partition's good rows were not generated either."""
    surrogate = {**CALL, "function": {"name": "weather", "arguments": '{"path": "\\ud800"}'}}
    legacy = {"name": "weather", "arguments": {"city": "\ud800"}}  # an object holding one, as a reader gives it
    records = [
        OPENAI,
        {"messages": [USER_1, {**ASSISTANT_CALL, "tool_calls": [surrogate]}, RESULT, ANSWER], "tools": WEATHER_TOOLS},
        {"messages": [USER_1, {**ASSISTANT_CALL, "tool_calls": [legacy]}, RESULT, ANSWER], "tools": WEATHER_TOOLS},
    ]
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "\\ud800" in path.read_text() and path.read_bytes().isascii()
    result = build_corpus([str(path)])
    assert result.corpus["line"].unique().to_list() == [1]
    rejected = result.rejected.select("file", "line", "reason").to_dicts()
    assert [(Path(r["file"]).name, r["line"]) for r in rejected] == [("traces.jsonl", 2), ("traces.jsonl", 3)]
    assert rejected[0]["reason"] == (
        "bad tool call: messages[1] (assistant) tool_calls[0] (weather) arguments hold a lone surrogate (\\ud800), "
        "not valid Unicode: the tokenizer cannot render them; fix or remove the record"
    )
    assert rejected[1]["reason"].startswith("invalid Unicode") or "lone surrogate" in rejected[1]["reason"]


def test_single_turn_plain_records_keep_their_content_hash_and_prompt_id(tmp_path):
    """Stored rows stay keyed by content: the hash of [{role, content}] as before tool conversations were read."""
    records = [
        {"messages": [{"role": "user", "content": "Reverse a list."}, {"role": "assistant", "content": "xs[::-1]"}]},
        {"id": 3, "prompt": "Sort a dict by value."},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"}]},
    ]
    expected_messages = [
        [{"role": "user", "content": "Reverse a list."}],
        [{"role": "user", "content": "Sort a dict by value."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ]
    old_hashes = [
        hashlib.sha256(json.dumps(m, ensure_ascii=False, sort_keys=True).encode()).hexdigest()[:16]
        for m in expected_messages
    ]
    for turns in ("every", "last"):
        corpus = build_corpus([jsonl(tmp_path / "plain.jsonl", records)], turns=turns).corpus
        assert corpus["content_hash"].to_list() == old_hashes
        assert corpus["prompt_id"].to_list() == [old_hashes[0], "plain:3", old_hashes[2]]
        assert corpus["conversation_id"].to_list() == [old_hashes[0], "plain:3", old_hashes[2]]
        assert corpus["turn_kind"].to_list() == ["prompt"] * 3 and corpus["tools"].null_count() == 3
        assert [api_messages(m) for m in corpus["messages"].to_list()] == expected_messages


def test_identical_contexts_of_two_conversations_are_one_row(tmp_path):
    other = {
        "id": "trace-2",
        "tools": WEATHER_TOOLS,
        "messages": [SYSTEM, USER_1, {"role": "assistant", "content": "?"}],
    }
    result = build_corpus([jsonl(tmp_path / "d.jsonl", [OPENAI, other])])
    # trace-2's one context is trace-1's first: kept once (trace-1's row), counted
    assert result.corpus.height == 3 and result.duplicates_per_source == {"d": 1}
    assert result.corpus["conversation_id"].to_list() == ["d:trace-1"] * 3


def materialize(instance, root, sources, **config):
    result = dg.materialize(
        [prompt_corpus],
        instance=instance,
        resources={"storage": StorageResource(root=str(root))},
        run_config={"ops": {"prompt_corpus": {"config": {"sources": sources, **config}}}},
    )
    assert result.success
    return {k: v.value for k, v in result.asset_materializations_for_node("prompt_corpus")[0].metadata.items()}


def test_the_asset_keeps_every_index_when_run_again_and_when_a_conversation_grows(tmp_path):
    source = tmp_path / "traces.jsonl"
    jsonl(source, [{"prompt": "Hello"}, OPENAI, SHAREGPT])
    store = tmp_path / "store"
    with dg.instance_for_test() as instance:
        meta = materialize(instance, store, [str(source)])
        assert meta["num_prompts"] == 6 and meta["conversations"] == 3 and meta["tool_conversations"] == 2
        assert meta["rows_per_turn_kind"] == {"prompt": 1, "after_tool": 2, "follow_up": 3}
        first = pl.read_parquet(store / "prompt_corpus" / "corpus.parquet")
        # rows of one conversation: adjacent indices, in turn order
        assert first.select("index", "conversation_id", "turn").rows() == [
            (0, first["conversation_id"][0], 0),
            (1, "traces:trace-1", 0),
            (2, "traces:trace-1", 1),
            (3, "traces:trace-1", 2),
            (4, first["conversation_id"][4], 0),
            (5, first["conversation_id"][4], 1),
        ]
        meta = materialize(instance, store, [str(source)])
        again = pl.read_parquet(store / "prompt_corpus" / "corpus.parquet")
        assert again.equals(first) and meta["prompts_new"] == 0 and meta["prompts_kept"] == 6
        # the trace goes on: the turns it had keep their indices, the new turn gets the next one
        grown = {**OPENAI, "messages": [*OPENAI["messages"], {"role": "user", "content": "Thanks!"}]}
        jsonl(source, [{"prompt": "Hello"}, grown, SHAREGPT])
        meta = materialize(instance, store, [str(source)])
        grown_corpus = pl.read_parquet(store / "prompt_corpus" / "corpus.parquet")
        assert (
            dict(zip(first["content_hash"], first["index"])).items()
            <= dict(zip(grown_corpus["content_hash"], grown_corpus["index"])).items()
        )
        assert grown_corpus.filter(pl.col("turn") == 3).select("index", "prompt_id").rows() == [(6, "traces:trace-1#3")]
        assert (meta["prompts_new"], meta["prompts_kept"], meta["prompts_removed"]) == (1, 6, 0)


def test_a_corpus_stored_before_tool_conversations_is_still_read_and_keeps_its_indices(tmp_path):
    source = jsonl(tmp_path / "p.jsonl", [{"prompt": "one"}, {"id": "x", "messages": [USER_1, ANSWER, USER_2]}])
    store = tmp_path / "store"
    with dg.instance_for_test() as instance:
        materialize(instance, store, [source], turns="last")
        path = store / "prompt_corpus" / "corpus.parquet"
        current = pl.read_parquet(path)
        # the file as the previous version wrote it: messages of {role, content}, none of the new columns
        old_messages = pl.col("messages").list.eval(
            pl.struct(pl.element().struct.field("role"), pl.element().struct.field("content"))
        )
        current.select("index", "prompt_id", "source", old_messages, "content_hash", "file", "line").write_parquet(path)
        storage = StorageResource(root=str(store)).open()
        read = load_range_prompts(storage, ["0000000-0000999"])["0000000-0000999"]
        assert read.select(current.columns).equals(current)
        meta = materialize(instance, store, [source], turns="last")
        assert meta["prompts_kept"] == 2 and pl.read_parquet(path)["index"].to_list() == [0, 1]
        assert storage.read_parquet(*CORPUS_FILE).schema["messages"] == MESSAGES_SCHEMA


def test_an_unknown_turns_value_is_refused_naming_the_key(tmp_path):
    source = jsonl(tmp_path / "p.jsonl", [{"prompt": "one"}])
    with dg.instance_for_test() as instance, pytest.raises(dg.DagsterInvalidConfigError) as err:
        materialize(instance, tmp_path / "store", [source], turns="all")
    assert "prompt_corpus:config:turns" in str(err.value) and "'last', 'every'" in str(err.value)
    with pytest.raises(ValueError, match=r"turns: 'all' is not one of \['last', 'every'\]"):
        build_corpus([source], turns="all")


def test_an_assistant_greeting_before_the_first_user_message_is_counted_but_gives_no_row(tmp_path):
    greeting = {
        "id": "g",
        "messages": [
            {"role": "assistant", "content": "Hi, what can I do?"},
            {"role": "user", "content": "Fix my build."},
            {"role": "assistant", "content": "Done."},
        ],
    }
    corpus = build_corpus([jsonl(tmp_path / "g.jsonl", [greeting])], turns="every").corpus
    # one row (the greeting's context holds no user message): it keeps the record's id, and is turn 1
    assert corpus.select("prompt_id", "turn", "turn_kind").rows() == [("g:g", 1, "follow_up")]
    assert api_messages(corpus["messages"][0].to_list()) == greeting["messages"][:2]
