"""Issue 50, findings 3, 5 and 7 and the length check read in code: on-policy runs through a stand-in server
(``test_on_policy.on_policy_through``) and the tool sandbox. A tool result holding a lone surrogate, a runaway tool
call, a turn over the servers' context and a raised turn limit each cost at most that conversation's turn, never
the run, and make exactly the conversations they touch stale."""

from __future__ import annotations

import json

import polars as pl

from dflash_assets.data import bfcl
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.target_model import TargetModelResource

try:
    from dflash_assets_tests.test_on_policy import call, on_policy_through
except ImportError:  # run from inside the tests folder
    from test_on_policy import call, on_policy_through  # type: ignore[no-redef]


def test_a_tool_result_holding_a_lone_surrogate_is_an_error_result_never_the_runs_end(tmp_path):
    """Finding 3: the reply ``<tool_call>{"name": "cd", "arguments": {"folder": "\\ud800"}}</tool_call>`` (ASCII
    text): ``cd`` echoed the lone surrogate into its result, the row check did not look at tool messages, and the
    journal append raised ``UnicodeEncodeError`` in the follow-up callback, which ended every conversation."""
    text = '<tool_call>{"name": "cd", "arguments": {"folder": "\\ud800"}}</tool_call>'
    assert text.isascii()
    result, metadata = on_policy_through(tmp_path, "surrogate", call_text=text)
    assert result.success, result.failure_data_for_node("completions")
    (table,) = tmp_path.rglob("*.on_policy.parquet")
    rows = pl.read_parquet(table).sort("index").to_dicts()
    assert len(rows) > 1  # the conversation went on after the bad result
    (message,) = json.loads(rows[0]["tool_messages"])
    assert json.loads(message["content"]) == {
        "error": "the result of cd holds a lone surrogate (\\ud800), not valid Unicode: not sent"
    }
    assert metadata["tool_error_results"].value == 1


def test_a_runaway_tool_call_is_stopped_at_its_time_bound_and_the_conversation_goes_on(tmp_path):
    """Finding 5: ``power(base=3, exponent=1000000000)`` (92 bytes from the model) ran inline on the client's
    event-loop thread with the GIL held: one try ran ten minutes before it was killed. Task 15 offers MathAPI."""
    task = next(t for t in bfcl.load_tasks() if t.id == "multi_turn_base_15")
    source = tmp_path / "src" / "bfcl_multi_turn_base.jsonl"
    source.parent.mkdir()
    source.write_text(json.dumps(bfcl.ground_truth_record(task, "used")) + "\n")
    text = call("power", {"base": 3, "exponent": 1000000000})
    assert len(text.encode()) == 92
    import time

    started = time.monotonic()
    result, metadata = on_policy_through(
        tmp_path / "run", "power", call_text=text, source=str(source), config={"tool_timeout_s": 2.0}
    )
    assert time.monotonic() - started < 120
    assert result.success, result.failure_data_for_node("completions")
    (table,) = (tmp_path / "run").rglob("*.on_policy.parquet")
    rows = pl.read_parquet(table).sort("index").to_dicts()
    (message,) = json.loads(rows[0]["tool_messages"])
    assert json.loads(message["content"]) == {"error": "power did not return within 2 s: stopped (its effects undone)"}
    assert len(rows) > 1 and metadata["tool_timeout_s"].value == 2.0


def test_the_sandbox_bounds_result_size_and_replays_state_into_a_new_process():
    """A call stopped at the time bound kills the child; the conversation's earlier calls are replayed into the
    next one, so its state (here: the working directory) carries on; a result over the size bound is an error."""
    from dflash_assets.data.tool_sandbox import ToolSandbox

    task = next(t for t in bfcl.load_tasks() if t.id == "multi_turn_base_15")
    local = bfcl.ToolEnvironment(task)
    with ToolSandbox(timeout_s=1.0, max_result_bytes=4096) as sandbox:
        env = sandbox.environment("a", task)
        for name, arguments in (("mkdir", {"dir_name": "work"}), ("cd", {"folder": "work"})):
            assert env.call(name, json.dumps(arguments)) == local.call(name, arguments)
        stopped = env.call("power", '{"base": 3, "exponent": 1000000000}')
        assert "did not return within 1 s" in stopped and sandbox.timeouts == 1
        assert env.call("pwd", "{}") == local.call("pwd", {}) == '{"current_working_directory": "/project/work"}'

        big = env.call("mean", json.dumps({"numbers": list(range(3000))}))
        assert json.loads(big) == {"result": 1499.5}
        huge = env.call("echo", json.dumps({"content": "x" * 5000}))
        assert "bytes, over the 4,096 a tool result may be" in huge


def _meta(metadata) -> dict:
    return {k: v.value for k, v in metadata.items()}


def test_a_turn_over_the_context_is_set_aside_before_it_is_sent_and_a_context_change_makes_it_stale(tmp_path):
    """Read in code: on-policy turns were never length-checked (a turn over the context became a ``length`` row at
    the cap where the server lowers ``max_tokens``). Same rule as regenerate mode's ``prompt_too_long``; and a
    larger context makes exactly that partition stale (finding 7)."""
    from dflash_assets.generation.engines.chat_render import SMOLLM2_TOOLS_TEMPLATE
    from dflash_assets.generation.rows.records import TOO_LONG_CONTEXT
    from dflash_assets.orchestration.freshness import completions_reason
    from dflash_assets.stages.resources.generation import served_settings

    result, metadata = on_policy_through(tmp_path, "count", context_length=64)
    assert result.success
    assert not (tmp_path / "requests.txt").exists()  # no turn sent
    (table,) = tmp_path.rglob("*.on_policy.parquet")
    (row,) = pl.read_parquet(table).to_dicts()
    assert row["finish_reason"] == "prompt_too_long" and row["turn"] == 0 and row["context_length"] == 64
    meta = _meta(metadata)
    assert meta["conversations_ended_at_context"] == 1
    generation = GenerationResource(max_output_tokens=8)
    external = {"base_urls": ["http://x"], "served_model_name": "m"}
    for context, reason in ((64, None), (4096, TOO_LONG_CONTEXT)):
        inference = InferenceServerResource(mode="external", external={**external, "context_length": context})
        target = TargetModelResource(chat_template=SMOLLM2_TOOLS_TEMPLATE)
        settings = served_settings(generation, inference, target)
        assert completions_reason(meta, settings, None, "on_policy", (64, 8)) == reason


def test_raising_the_turn_limit_makes_exactly_the_conversations_it_cut_stale(tmp_path):
    """Finding 7: after ``max_turns_per_conversation`` was raised (1 -> 64), freshness saw nothing to do."""
    from dflash_assets.orchestration.freshness import completions_reason

    result, metadata = on_policy_through(tmp_path, "count", config={"max_turns_per_conversation": 1})
    assert result.success
    meta = _meta(metadata)
    assert meta["conversations_ended_at_max_turns"] == 1 and meta["conversation_turns_max"] == 1
    assert completions_reason(meta, None, None, "on_policy", (1, 8)) is None
    assert completions_reason(meta, None, None, "on_policy", (64, 8)) == (
        "max_turns_per_conversation raised (1 -> 64): 1 conversations ended at the old limit"
    )
    ended_by_task = {**meta, "conversations_ended_at_max_turns": 0}  # its task had no more to ask: untouched
    assert completions_reason(ended_by_task, None, None, "on_policy", (64, 8)) is None
    rounds = {**meta, "max_rounds_per_user_turn": 8, "user_turns_ended_at_max_rounds": 2, "rounds_max": 8}
    assert completions_reason(rounds, None, None, "on_policy", (1, 16)).startswith("max_rounds_per_user_turn raised")
    assert completions_reason({**rounds, "user_turns_ended_at_max_rounds": 0}, None, None, "on_policy", (1, 16)) is None
