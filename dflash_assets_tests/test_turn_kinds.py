"""Issue 43, item 6: completions rows keep their turn kind and whether the turn called a tool; the truncation
report splits rows and truncation by turn kind and source. Expected counts come from how the rows are built."""

from types import SimpleNamespace

import polars as pl

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.truncation import TURN_KINDS, truncation_stats, turn_kind_labels
from dflash_assets.generation.rows.records import holds_tool_call, row_from_result, rows_to_frame


def _result(content: str | None, finish_reason: str = "stop", error: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        content=content,
        reasoning_content=None,
        finish_reason=finish_reason,
        prompt_tokens=5,
        completion_tokens=7,
        output_token_ids=None,
        output_token_ids_source=None,
        latency_s=0.1,
        server="s0",
        attempts=1,
        error=error,
        prompt_token_ids=None,
    )


def _prompt(index: int, turn_kind: str | None, source: str = "agent") -> dict:
    return {"index": index, "prompt_id": f"p{index}", "content_hash": "h", "source": source, "turn_kind": turn_kind}


def test_a_row_keeps_its_turn_kind_and_whether_it_called_a_tool():
    settings = GenerationSettings(enable_thinking=False)
    call = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    row = row_from_result(_result(f"Listing.\n{call}"), _prompt(0, "after_tool"), settings)
    assert (row["turn_kind"], row["tool_call"]) == ("after_tool", True)
    row = row_from_result(_result("Done: 3 files."), _prompt(1, "after_tool"), settings)
    assert (row["turn_kind"], row["tool_call"]) == ("after_tool", False)
    row = row_from_result(_result(None, None, error="HTTP 500"), _prompt(2, "prompt"), settings)
    assert row["tool_call"] is None  # nothing was generated
    assert holds_tool_call("I would call <tool_call>") and not holds_tool_call("") and not holds_tool_call(None)


def test_the_truncation_report_splits_by_turn_kind_and_source():
    settings = GenerationSettings(enable_thinking=False)
    call = '<tool_call>{"name": "cd", "arguments": {"folder": "a"}}</tool_call>'
    layout = [  # (source, corpus turn_kind, answer, finish_reason)
        ("agent", "prompt", call, "stop"),
        ("agent", "after_tool", call, "length"),
        ("agent", "after_tool", "The file moved.", "stop"),
        ("agent", "after_tool", "The file", "length"),
        ("agent", "follow_up", "Sure.", "stop"),
        ("humaneval", "prompt", "def f(): pass", "length"),
        ("humaneval", None, "def g(): pass", "stop"),  # a row made before turn kinds were kept
    ]
    rows = [
        row_from_result(_result(answer, reason), _prompt(i, kind, source), settings)
        for i, (source, kind, answer, reason) in enumerate(layout)
    ]
    frame = rows_to_frame(rows)
    stats = truncation_stats(frame)
    label = TURN_KINDS
    assert {k: (v["rows"], v["truncated"]) for k, v in stats["per_turn_kind"].items()} == {
        label["tool_call"]: (2, 1),
        label["after_tool"]: (2, 1),
        label["follow_up"]: (1, 0),
        label["prompt"]: (2, 1),
    }
    assert stats["per_source_turn_kind"]["agent / tool-call turn"] == {"rows": 2, "truncated": 1, "rate": 0.5}
    assert stats["per_source_turn_kind"]["humaneval / single-turn prompt"]["rows"] == 2
    # a table stored before the columns existed reads as single-turn prompts
    old = frame.drop("turn_kind", "tool_call")
    assert turn_kind_labels(old).to_list() == [label["prompt"]] * len(layout)
    assert truncation_stats(old)["per_turn_kind"] == {label["prompt"]: {"rows": 7, "truncated": 3, "rate": 3 / 7}}
    assert frame.schema["tool_call"] == pl.Boolean and frame.schema["turn_kind"] == pl.String
