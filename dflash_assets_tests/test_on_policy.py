"""On-policy trajectories without a server (issue 43 item 5): how a reply's tool calls are read, what the
conversation does with them (executed, answered, errors as tool results), the turn limits, replaying stored turns,
and the ``completions`` config that selects the mode. The runs through a real server: test_on_policy_vllm.py."""

from __future__ import annotations

import io
import json

import dagster as dg
import polars as pl
import pytest
from pydantic import ValidationError

from dflash_assets.assets.completions import completions
from dflash_assets.data import bfcl
from dflash_assets.data.on_policy import TURN_STRIDE, ToolCall, Trajectory, parse_tool_calls, row_key
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.completions.config import CompletionsConfig
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource


def call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_tool_calls_are_read_from_the_text_in_order_and_bad_ones_say_why():
    text = "Let me look.\n" + call("ls", {"a": True}) + " then " + call("cd", {"folder": "x"})
    assert parse_tool_calls(text) == [ToolCall("ls", '{"a": true}'), ToolCall("cd", '{"folder": "x"}')]
    assert parse_tool_calls('<tool_call>{"name": "pwd"}</tool_call>') == [ToolCall("pwd", "{}")]
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call>') == [
        ToolCall("f", '{"k": 1}')  # arguments given as JSON text are passed on as they are
    ]
    assert parse_tool_calls("no call here") == [] and parse_tool_calls(None) == []
    bad = parse_tool_calls(
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "tail"'
    )
    assert [c.name for c in bad] == [None] * 4
    assert "not JSON" in bad[0].error and '"name" string' in bad[1].error and '"name" string' in bad[2].error
    assert "not closed" in bad[3].error and bad[3].arguments == '{"name": "tail"'
    deep = parse_tool_calls("<tool_call>" + "[" * 100_000 + "</tool_call>")
    assert deep[0].error is not None  # deep nesting is a bad call, never a crash


def task_and_tools(task_id: str = "multi_turn_base_0") -> tuple[bfcl.BfclTask, str]:
    task = next(t for t in bfcl.load_tasks() if t.id == task_id)
    return task, json.dumps(bfcl.ToolEnvironment(task).tools)


def trajectory(max_rounds: int = 8, max_turns: int = 64) -> Trajectory:
    task, tools = task_and_tools()
    anchor = {"index": 3, "conversation_id": f"bfcl_multi_turn_base:{task.id}", "source": "bfcl_multi_turn_base"}
    return Trajectory(task, tools, anchor, max_rounds, max_turns)


def test_calls_are_executed_in_order_and_their_results_follow_the_reply_as_generated():
    t = trajectory()
    task = t.task
    assert t.messages == task.turns[0] and t.kind == "prompt" and t.key == row_key(3, 0) == 3 * TURN_STRIDE
    reply = {"role": "assistant", "content": "Sure.\n" + call("mkdir", {"dir_name": "temp"}) + call("ls", {})}
    results = t.answer(reply)
    env = bfcl.ToolEnvironment(task)  # the expected results, from a fresh environment of the task
    expected = [env.call("mkdir", {"dir_name": "temp"}), env.call("ls", {})]
    assert [m["content"] for m in results] == expected and "temp" in expected[1]
    assert [m["name"] for m in results] == ["mkdir", "ls"] and [m["tool_call_id"] for m in results] == [
        "call_0_0",
        "call_0_1",
    ]
    assert t.messages == [*task.turns[0], reply, *results]  # the reply's own text, never a parsed call
    assert t.kind == "after_tool" and t.turn == 1 and not t.done
    t.answer({"role": "assistant", "content": "Done."})  # no call: the task's next user turn
    assert t.messages[-1] == task.turns[1][0] and t.kind == "follow_up"
    for _ in task.turns[2:]:
        t.answer({"role": "assistant", "content": "Done."})
    assert not t.done
    t.answer({"role": "assistant", "content": "Done."})  # the answer to the last user turn ends it
    assert t.done and t.turn == 2 + len(task.turns) - 1
    with pytest.raises(RuntimeError, match="done"):
        t.answer({"role": "assistant", "content": "more"})


def test_bad_calls_become_error_results_and_the_conversation_goes_on():
    t = trajectory()
    text = (
        "<tool_call>{not json}</tool_call>"
        + call("rm_everything", {})
        + call("cd", {"no_such_parameter": 1})
        + '<tool_call>{"name": "tail"'
    )
    results = t.answer({"role": "assistant", "content": text})
    errors = [json.loads(m["content"])["error"] for m in results]
    assert len(errors) == 4
    assert "not JSON" in errors[0] and "unknown function 'rm_everything'" in errors[1]
    assert "bad arguments for cd" in errors[2] and "not closed" in errors[3]
    assert "name" not in results[0] and results[1]["name"] == "rm_everything"
    assert t.kind == "after_tool" and not t.done


def test_a_model_that_keeps_calling_moves_on_after_max_rounds_and_stops_at_max_turns():
    t = trajectory(max_rounds=2, max_turns=5)
    looping = {"role": "assistant", "content": call("pwd", {})}
    t.answer(looping)
    assert t.kind == "after_tool" and t.user_turn == 0
    t.answer(looping)  # the second reply to the user turn: its call is answered, then the next user turn
    assert t.messages[-2]["role"] == "tool" and t.messages[-1] == t.task.turns[1][0] and t.kind == "follow_up"
    for _ in range(3):
        t.answer(looping)
    assert t.done and t.turn == 5


def test_stored_turns_replay_without_a_request_only_onto_their_own_context():
    live = trajectory()
    rows = []
    for content in [call("mkdir", {"dir_name": "temp"}), "Done.", call("ls", {})]:
        reply = {"role": "assistant", "content": content}
        rows.append({"turn": live.turn, "prompt_hash": live.context_hash(), "reply": json.dumps(reply)})
        live.answer(reply)
    resumed = trajectory()
    assert all(resumed.replay(row) for row in rows)
    assert resumed.messages == live.messages and resumed.turn == live.turn and resumed.kind == live.kind
    assert resumed.env.call("ls", {}) == live.env.call("ls", {})  # the tools' state is rebuilt too
    other = trajectory()
    assert not other.replay(rows[1])  # not the next turn
    assert not other.replay({**rows[0], "prompt_hash": "another context"}) and other.turn == 0


def test_the_mode_is_checked_and_defaults_to_regeneration(tmp_path):
    assert CompletionsConfig().mode == "regenerate"
    assert CompletionsConfig(mode="on_policy").max_rounds_per_user_turn == 8
    with pytest.raises(ValidationError, match="mode"):
        CompletionsConfig(mode="on-policy")
    with pytest.raises(ValidationError):
        CompletionsConfig(max_turns_per_conversation=TURN_STRIDE)
    resources = {
        "storage": StorageResource(root=str(tmp_path)),
        "inference": InferenceServerResource(),
        "generation": GenerationResource(),
        "target_model": TargetModelResource(),
    }
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, ["0000000-0000001"])
        for config, words in (({"max_turn": 3}, 'unexpected config entry "max_turn"'), ({"mode": "on-policy"}, "enum")):
            with pytest.raises(dg.DagsterInvalidConfigError, match=words):
                dg.materialize(
                    [completions],
                    instance=instance,
                    resources=resources,
                    partition_key="0000000-0000001",
                    run_config={"ops": {"completions": {"config": config}}},
                )


def test_qwen36_calls_are_read_as_its_template_writes_them():
    """The Qwen3.6 stand-in's template (Qwen3.6's layout) renders calls; reading the rendered text back gives the
    same calls: a string parameter as written (digits too), any other value as the JSON the template wrote."""
    from transformers import AutoTokenizer

    from dflash_assets.generation.engines.hybrid_standin import CHAT_TEMPLATE
    from dflash_assets.generation.engines.local_model import ensure_local_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_local_model()), local_files_only=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tools = [
        {
            "type": "function",
            "function": {
                "name": "send",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "to": {"type": "string"},
                        "body": {"type": "string"},
                        "copies": {"type": "integer"},
                        "tags": {"type": "array"},
                    },
                },
            },
        }
    ]
    arguments = {"to": "7", "body": "two\nlines <b>", "copies": 2, "tags": ["a", {"b": None}]}
    calls = [{"id": "c0", "type": "function", "function": {"name": "send", "arguments": arguments}}]
    messages = [{"role": "user", "content": "Send it."}, {"role": "assistant", "content": "", "tool_calls": calls}]
    text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": "ok"}], tools=tools, tokenize=False)
    reply = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert "<function=send>" in reply
    (read,) = parse_tool_calls(reply, tools)
    assert read.error is None and read.name == "send" and json.loads(read.arguments) == arguments
    assert json.loads(parse_tool_calls(reply)[0].arguments)["to"] == 7  # without the schema, digits read as JSON
    bad = parse_tool_calls("<tool_call>\n<function=send>\n<parameter=to>\nx\n</parameter>\n</tool_call>", tools)
    assert bad[0].name is None and "</function>" in bad[0].error
    twice = "<tool_call><function=send><parameter=to>a</parameter><parameter=to>b</parameter></function></tool_call>"
    assert "twice" in parse_tool_calls(twice, tools)[0].error


STAND_IN = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE = "{mode}"

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, payload, status=200):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.reply({{"data": [{{"id": "m"}}]}})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        usage = {{"prompt_tokens": 3, "completion_tokens": 2}}
        first = len(request["messages"]) == 1 and "tools" in request
        if MODE == "parsed" or (MODE == "parsed_ids" and first):
            # a server running a tool-call parser: the calls taken out of the text, finish_reason says so
            call = {{"id": "c", "type": "function", "function": {{"name": "cd", "arguments": "{{}}"}}}}
            choice = {{"index": 0, "finish_reason": "tool_calls",
                      "message": {{"role": "assistant", "content": None, "tool_calls": [call]}}}}
            if MODE == "parsed_ids":
                choice["token_ids"] = {ids}
            return self.reply({{"choices": [choice], "usage": usage}})
        if MODE == "count" and "tools" in request:  # a turn (the start-up probe carries no tools)
            with open({count_file!r}, "a") as f:
                f.write("request\\n")
        if MODE in ("surrogate", "power") and first:  # issue 50, findings 3 and 5: the model's call, as ASCII text
            text = {call_text!r}
            message = {{"role": "assistant", "content": text}}
            choice = {{"index": 0, "finish_reason": "stop", "message": message}}
            return self.reply({{"choices": [choice], "usage": usage}})
        if MODE == "context" and "tools" in request and not first:  # the second turn no longer fits
            message = "This model's maximum context length is 10 tokens; the messages hold 12"
            return self.reply({{"error": {{"message": message}}}}, status=400)
        message = {{"role": "assistant", "content": "Done."}}
        self.reply({{"choices": [{{"index": 0, "finish_reason": "stop", "message": message}}], "usage": usage}})

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def on_policy_through(
    tmp_path,
    mode: str,
    ids: list[int] | None = None,
    *,
    call_text: str = "",
    source: str = "bfcl:multi_turn_base?limit=1&tools=used",
    config: dict | None = None,
    context_length: int | None = None,
):
    """``completions`` in on_policy mode over one BFCL task, through a stand-in server of ``mode`` (in its own
    process): the Dagster result and the completions step's materialization metadata (None when it failed).
    ``call_text``: the first reply of modes ``surrogate`` / ``power``; mode ``count`` writes a line per request to
    ``tmp_path/requests.txt``; ``config``: more of ``ops.completions.config``; ``context_length``: the servers'."""
    from dflash_assets.assets.prompts import prompt_corpus
    from dflash_assets.generation.engines.chat_render import SMOLLM2_TOOLS_TEMPLATE
    from dflash_assets.generation.engines.local_model import ensure_local_model
    from dflash_assets_tests.script_server import script_server

    script = STAND_IN.format(mode=mode, ids=ids, call_text=call_text, count_file=str(tmp_path / "requests.txt"))
    with script_server(script) as url, dg.instance_for_test() as instance:
        external = {"base_urls": [url], "served_model_name": "m", "tokenizer_path": str(ensure_local_model())}
        if context_length is not None:
            external["context_length"] = context_length
        resources = {
            "storage": StorageResource(root=str(tmp_path)),
            "inference": InferenceServerResource(mode="external", external=external),
            "generation": GenerationResource(max_output_tokens=8),
            "target_model": TargetModelResource(chat_template=SMOLLM2_TOOLS_TEMPLATE),
        }
        sources = {"sources": [source]}
        corpus = {"ops": {"prompt_corpus": {"config": sources}}}
        assert dg.materialize([prompt_corpus], instance=instance, resources=resources, run_config=corpus).success
        (pk,) = instance.get_dynamic_partitions(prompt_ranges.name)
        result = dg.materialize(
            [completions],
            instance=instance,
            resources=resources,
            partition_key=pk,
            run_config={"ops": {"completions": {"config": {"mode": "on_policy", **(config or {})}}}},
            raise_on_error=False,
        )
    events = result.asset_materializations_for_node("completions") if result.success else []
    return result, events[0].metadata if events else None


def test_a_server_that_parses_the_calls_out_of_the_text_fails_the_conversation_naming_the_fix(tmp_path):
    result, _ = on_policy_through(tmp_path, "parsed")
    assert not result.success
    failure = str(result.failure_data_for_node("completions").error)
    assert "without a tool-call parser" in failure and "rerun the partition to resume" in failure
    assert not list(tmp_path.rglob("*.on_policy.parquet"))  # nothing committed for an unfinished conversation


def test_a_conversation_that_outgrows_the_context_ends_there_and_the_run_succeeds(tmp_path):
    result, metadata = on_policy_through(tmp_path, "context")
    assert result.success
    assert metadata["rows"].value == 1 and metadata["conversations_ended_at_context"].value == 1


def test_calls_a_server_parsed_out_of_the_text_are_read_back_from_its_output_ids(tmp_path):
    """The server's parsed call object is not what the model wrote: the turn's text comes back from its ids, and
    the next turn's context holds that markup, executed as the model wrote it."""
    from transformers import AutoTokenizer

    from dflash_assets.generation.engines.local_model import ensure_local_model

    markup = "Going there.\n" + call("cd", {"folder": "document"})
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_local_model()), local_files_only=True)
    ids = tokenizer(markup, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    result, metadata = on_policy_through(tmp_path, "parsed_ids", ids)
    assert result.success and metadata["tool_calls"].value == 1
    (table,) = tmp_path.rglob("*.on_policy.parquet")
    rows = pl.read_parquet(table).sort("index").to_dicts()
    first, second = rows[0], rows[1]
    assert json.loads(first["reply"]) == {"role": "assistant", "content": markup}
    assert first["finish_reason"] == "stop" and list(first["output_token_ids"]) == ids
    task, _ = task_and_tools()
    expected = bfcl.ToolEnvironment(task).call("cd", {"folder": "document"})
    assert [m["content"] for m in json.loads(first["tool_messages"])] == [expected]
    assert json.loads(second["messages"])[1:] == [
        {"role": "assistant", "content": markup},
        *json.loads(first["tool_messages"]),
    ]


def test_tokenized_reads_the_table_the_latest_completions_made_and_never_guesses_between_two(tmp_path):
    """A partition that ran completions in both modes holds both tables: the one read is the latest
    materialization's mode (the other is what an earlier run left); without a record, two tables are refused,
    naming both, and a recorded mode whose table is gone is named too."""
    from dflash_assets.assets.tokenized import tokenized_sequences
    from dflash_assets.stages.completions.on_policy import table_file
    from dflash_assets.stages.completions.tables import partition_file
    from dflash_assets.stages.tokenized import CompletionsSourceError, completions_source

    pk = "0000000-0000003"
    store = StorageResource(root=str(tmp_path)).open()
    for parts in (partition_file(pk), table_file(pk)):
        store.write_bytes(b"", *parts)
    on_policy = completions_source(store, pk, "on_policy")
    assert on_policy.parts == table_file(pk) and on_policy.on_policy and on_policy.ignored == partition_file(pk)
    regenerate = completions_source(store, pk, "regenerate")
    assert regenerate.parts == partition_file(pk) and not regenerate.on_policy and regenerate.ignored == table_file(pk)
    with pytest.raises(CompletionsSourceError, match="both") as both:
        completions_source(store, pk, None)
    assert "/".join(partition_file(pk)) in str(both.value) and "/".join(table_file(pk)) in str(both.value)
    store.remove(*partition_file(pk))
    assert completions_source(store, pk, None).parts == table_file(pk)  # the one table there is
    with pytest.raises(CompletionsSourceError, match="ran mode: regenerate"):
        completions_source(store, pk, "regenerate")

    # the asset says so as its failure, before loading anything
    store.write_bytes(b"", *partition_file(pk))
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, [pk])
        result = dg.materialize(
            [tokenized_sequences],
            instance=instance,
            partition_key=pk,
            resources={
                "storage": StorageResource(root=str(tmp_path)),
                "target_model": TargetModelResource(),
                "generation": GenerationResource(),
            },
            raise_on_error=False,
        )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    message = failure.step_failure_data.error.message
    assert "both" in message and "ops.completions.config.mode" in message and pk in message


def test_the_truncation_report_counts_the_table_the_latest_completions_made(tmp_path):
    """After a regeneration run then an on-policy run of one partition, both tables are there; the report counts
    the on-policy turns only (it counted the stale regeneration table before), and a partition whose table
    cannot be told is missing, not guessed."""
    from dflash_assets.assets.truncation import load_all_completions
    from dflash_assets.generation.rows.records import COMPLETIONS_SCHEMA
    from dflash_assets.stages.completions.on_policy import table_file
    from dflash_assets.stages.completions.tables import partition_file

    def table(finish_reasons: list[str], turn_kind: str) -> bytes:
        rows = [
            {"index": i, "source": "bfcl", "finish_reason": f, "completion_tokens": 10 + i, "turn_kind": turn_kind}
            for i, f in enumerate(finish_reasons)
        ]
        frame = pl.DataFrame(rows).with_columns(
            [pl.lit(None, dtype=t).alias(c) for c, t in COMPLETIONS_SCHEMA.items() if c not in rows[0]]
        )
        buffer = io.BytesIO()
        frame.write_parquet(buffer)
        return buffer.getvalue()

    pk, other = "0000000-0000003", "0000004-0000007"
    store = StorageResource(root=str(tmp_path)).open()
    store.write_bytes(table(["length"] * 4, "prompt"), *partition_file(pk))  # the earlier regeneration run
    store.write_bytes(table(["stop", "stop", "length"], "after_tool"), *table_file(pk))  # the latest, on-policy
    for parts in (partition_file(other), table_file(other)):
        store.write_bytes(table(["stop"], "prompt"), *parts)
    frame, missing = load_all_completions(store, [pk, other], {pk: "on_policy"})
    assert missing == [other]  # two tables and no record of which is current
    assert frame["finish_reason"].to_list() == ["stop", "stop", "length"]
    assert set(frame["turn_kind"]) == {"after_tool"} and set(frame["partition"]) == {pk}
    frame, _ = load_all_completions(store, [pk], {pk: "regenerate"})
    assert frame["finish_reason"].to_list() == ["length"] * 4


def test_a_partition_made_in_the_other_mode_is_not_up_to_date():
    """Switching ops.completions.config.mode makes every partition made in the other mode stale (else the main
    job would keep the regeneration rows and never run the conversations); a partition recorded before modes
    were is a regeneration one."""
    from dflash_assets.orchestration.freshness import completions_reason

    assert completions_reason({"mode": "on_policy"}, None, None, "on_policy") is None
    assert completions_reason({}, None, None, "regenerate") is None
    assert completions_reason({}, None, None, "on_policy") == "made in mode regenerate, configured on_policy"
    assert completions_reason({"mode": "on_policy"}, None, None, "regenerate") == (
        "made in mode on_policy, configured regenerate"
    )
    assert completions_reason({"mode": "on_policy"}, None, None) is None  # no mode given: not compared


def test_an_on_policy_partition_has_its_output_where_its_mode_writes_it(tmp_path):
    """Freshness checks completions' output in the configured mode's file: an on-policy partition, which has no
    completions/<pk>.parquet, is not "output missing" (else every run would make it again)."""
    from dflash_assets.stages.completions.on_policy import table_file
    from dflash_assets.storage.stage_outputs import missing_outputs

    pk = "0000000-0000003"
    store = StorageResource(root=str(tmp_path)).open()
    store.write_bytes(b"", *table_file(pk))
    assert missing_outputs(store, "completions", [pk], mode="on_policy") == {}
    assert list(missing_outputs(store, "completions", [pk], mode="regenerate")) == [pk]
    assert list(missing_outputs(store, "completions", [pk])) == [pk]


def test_on_policy_turns_tokenize_with_their_own_context_and_stale_ones_are_set_aside():
    """An on-policy row's context is its own messages + tools (rendered as the servers render them); it is
    checked against the corpus row its conversation started from, and set aside naming why when that row is
    gone, is another conversation's, or offers other tools."""
    from dflash_assets.data.on_policy import ON_POLICY_SCHEMA
    from dflash_assets.data.shapes import content_hash
    from dflash_assets.data.tokenization import SequenceBuilder, TokenizePolicy, tokenize_partition
    from dflash_assets.generation.engines.chat_render import SMOLLM2_TOOLS_TEMPLATE

    target = TargetModelResource(chat_template=SMOLLM2_TOOLS_TEMPLATE)
    builder = SequenceBuilder(target.load_tokenizer())
    task, tools = task_and_tools()
    first = [dict(m) for m in task.turns[0]]
    reply = {"role": "assistant", "content": call("cd", {"folder": "document"})}
    result = {
        "role": "tool",
        "tool_call_id": "call_0_0",
        "name": "cd",
        "content": '{"current_working_directory": "document"}',
    }
    context = [*first, reply, result]
    tokenizer = builder.tokenizer
    output = tokenizer("Done.", add_special_tokens=False)["input_ids"]
    anchor, cid = 2, "bfcl_multi_turn_base:multi_turn_base_0"
    corpus = pl.DataFrame(
        {
            "index": [anchor, 3],
            "messages": [first, first],
            "content_hash": ["h-anchor", "h-other"],
            "tools": [tools, tools],
            "conversation_id": [cid, "bfcl_multi_turn_base:multi_turn_base_1"],
        }
    )

    def turn(key: int, conversation: str = cid, offered: str = tools) -> dict:
        row = {name: None for name in ON_POLICY_SCHEMA}
        row.update(
            index=key,
            prompt_id=f"{conversation}#on_policy{key % TURN_STRIDE}",
            prompt_hash=content_hash(context, offered),
            finish_reason="stop",
            content="Done.",
            output_token_ids=output,
            conversation_id=conversation,
            turn=key % TURN_STRIDE,
            messages=json.dumps(context),
            tools=offered,
            settings=json.dumps({"enable_thinking": False}),
        )
        return row

    rows = [
        turn(row_key(anchor, 1)),
        turn(row_key(7, 0)),  # no corpus row at 7
        turn(row_key(3, 0)),  # the corpus row at 3 is another conversation
        turn(row_key(anchor, 2), offered="[]"),  # other tools than the corpus offers
    ]
    frame = pl.DataFrame(rows, schema=ON_POLICY_SCHEMA)
    tokenized, aside, counts = tokenize_partition(frame, corpus, builder, TokenizePolicy(8192), on_policy=True)
    assert counts["kept"] == 1 and counts["other_prompt"] == 3, (counts, aside.to_dicts())
    reasons = dict(zip(aside["index"].to_list(), aside["reason"].to_list()))
    assert reasons[row_key(7, 0)].startswith("conversation removed") and "index 7" in reasons[row_key(7, 0)]
    assert reasons[row_key(3, 0)].startswith("conversation changed")
    assert reasons[row_key(anchor, 2)].startswith("tools changed")
    (row,) = tokenized.to_dicts()
    # the context rendered independently: the template applied to the turn's messages and tools as vLLM hands them
    expected_prompt = tokenizer.apply_chat_template(
        context, tools=json.loads(tools), add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(expected_prompt, add_special_tokens=False)["input_ids"]
    assert list(row["input_ids"]) == prompt_ids + output + [builder.end_token_id]
    assert list(row["loss_mask"]) == [0] * len(prompt_ids) + [1] * (len(output) + 1)
    assert row["corpus_index"] == anchor and row["prompt_hash"] == "h-anchor"


def test_status_counts_an_on_policy_partition_the_settings_touch_without_reading_a_regeneration_table(tmp_path):
    """``status`` counts the rows a settings change regenerates from each partition's completions table; an
    on-policy partition has none (its turns are made again as a whole): counted from its metadata, no crash."""
    from dflash_assets.app.status import collect_status

    pk = "0000000-0000003"
    settings = GenerationResource(max_output_tokens=8).settings()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, [pk])
        metadata = {"mode": "on_policy", "rows": 5, "settings_fingerprints": ["another"]}
        instance.report_runless_asset_event(
            dg.AssetMaterialization(asset_key="completions", partition=pk, metadata=metadata)
        )
        store = StorageResource(root=str(tmp_path)).open()
        status = collect_status(instance, settings=settings, store=store)
    assert status["completions"]["regenerate"]["rows"] == 5 and status["completions"]["regenerate"]["partitions"] == [
        pk
    ]
