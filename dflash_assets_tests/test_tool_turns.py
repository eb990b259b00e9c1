"""Issue 43 item 6: tau on tool-call turns reported apart from the other turns, in process and on the engine.

The outputs are real SmolLM2 token ids of texts the demo's target wrote (a tool call in the shipped template's
markup, and prose); the expected means are computed here by hand from the per-prompt figures.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dflash_assets.app.summary_lines import tool_turn_lines
from dflash_assets.generation.engines.local_model import ensure_local_model
from dflash_assets.stages.evaluation.tool_turns import tool_call_turns, tool_turn_line

CALL = '<tool_call>\n{"name": "grep", "arguments": {"file_name": "report.pdf", "pattern": "budget"}}\n</tool_call>'
PROSE = "The budget analysis is in the second section of the report."


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_local_model())


def report_of(tokenizer, texts: list[str], taus: list[float], engine_taus: list[float] | None) -> dict:
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    report = {"datasets": {"bfcl": {"trained": {"plain_output_ids": ids, "per_prompt_tau": taus}}}}
    if engine_taus is not None:
        report["engine"] = {
            "requests": [
                {"dataset": "heldout", "position": 0, "tau": 9.0},  # another dataset's position 0: not counted
                *({"dataset": "bfcl", "position": i, "tau": t} for i, t in enumerate(engine_taus)),
            ]
        }
    return report


def test_tool_call_prompts_are_grouped_apart_in_process_and_on_the_engine(tokenizer):
    report = report_of(tokenizer, [CALL, PROSE, CALL, PROSE], [2.0, 1.2, 1.6, 1.0], [2.1, 1.2, 1.5, 1.1])
    groups = tool_call_turns(report, tokenizer.decode)["bfcl"]
    assert groups["tool_call"]["positions"] == [0, 2] and groups["other"]["positions"] == [1, 3]
    assert groups["tool_call"]["tau_in_process"] == pytest.approx((2.0 + 1.6) / 2)
    assert groups["tool_call"]["tau_engine"] == pytest.approx((2.1 + 1.5) / 2)
    assert groups["tool_call"]["difference"] == pytest.approx(1.8 - 1.8, abs=1e-4)
    assert groups["other"]["tau_in_process"] == pytest.approx(1.1)
    assert groups["other"]["tau_engine"] == pytest.approx(1.15)
    assert tool_turn_line("bfcl", groups, "vLLM") == (
        "bfcl: tool-call turns 2 of 4 prompts, tau 1.8 in process, 1.8 in vLLM; other turns tau 1.1"
    )


def test_without_an_engine_or_a_tool_call_the_line_says_so(tokenizer):
    groups = tool_call_turns(report_of(tokenizer, [PROSE, PROSE], [1.5, 1.1], None), tokenizer.decode)["bfcl"]
    assert groups["tool_call"] == {
        "prompts": 0,
        "positions": [],
        "tau_in_process": None,
        "tau_engine": None,
        "difference": None,
    }
    assert groups["other"]["tau_engine"] is None and groups["other"]["tau_in_process"] == pytest.approx(1.3)
    assert (
        tool_turn_line("bfcl", groups, "vLLM")
        == "bfcl: tool-call turns 0 of 2 prompts (the target called no tool on them)"
    )


def test_a_dataset_without_per_prompt_outputs_is_left_out(tokenizer):
    report = {"datasets": {"heldout": {"trained": {"per_prompt_tau": [1.0]}}}}
    assert tool_call_turns(report, tokenizer.decode) == {}


def test_the_summary_names_tool_call_turns_and_skips_heldout_without_calls(tokenizer):
    with_calls = tool_call_turns(report_of(tokenizer, [CALL, PROSE], [2.0, 1.0], [2.0, 1.0]), tokenizer.decode)
    without = tool_call_turns(report_of(tokenizer, [PROSE], [1.4], None), tokenizer.decode)
    s = {"engine_kind": "vllm", "tool_call_turns": {"heldout": without["bfcl"], "bfcl": with_calls["bfcl"]}}
    assert tool_turn_lines(s) == [
        "bfcl: tool-call turns 1 of 2 prompts, tau 2.0 in process, 2.0 in vLLM; other turns tau 1.0"
    ]
    assert tool_turn_lines({"tool_call_turns": None}) == []
