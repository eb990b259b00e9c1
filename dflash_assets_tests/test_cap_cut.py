"""Cutting a row to a lowered cap from its own tokens (``dflash_assets.data.cap_cut``).

The property checked for every layout: the cut row, rendered back the way tokenization renders it and
encoded, is exactly the first ``cap`` tokens of the original row's completion, with the flags a server
gives a reply cut there. The end-to-end check against a real server's own reply at the lower cap (greedy
SmolLM2) is ``test_cap_change.test_lowering_the_cap_cuts_the_rows_longer_than_it_from_their_own_tokens``.
"""

from __future__ import annotations

import pytest

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.cap_cut import cut_to_cap
from dflash_assets.data.sequence_builder import SequenceBuilder
from dflash_assets.generation.rows.records import completion_layout
from dflash_simulators.thinking_tokenizer import write_thinking_tokenizer

MESSAGES = [{"role": "user", "content": "Sort a list in Python."}]
REASONING = "The user wants a sorted list. The built-in sorted returns a new list; list.sort sorts in place."
ANSWER = "Use sorted(xs) for a new list, or xs.sort() to sort in place."


@pytest.fixture(scope="module", params=[False, True], ids=["qwen3_layout", "prompt_opens_think"])
def builder(request, tmp_path_factory):
    from transformers import AutoTokenizer

    path = write_thinking_tokenizer(tmp_path_factory.mktemp("tok"), opens_think=request.param)
    return SequenceBuilder(AutoTokenizer.from_pretrained(str(path)))


def settings(cap: int, **kw) -> GenerationSettings:
    return GenerationSettings(max_output_tokens=cap, temperature=0.6, top_p=0.95, enable_thinking=True, **kw)


def made_row(
    builder: SequenceBuilder, reasoning: str | None, answer: str, finish: str, cap: int, ids: bool = False
) -> dict:
    """A row as the pipeline stores it, with the token count its text encodes to (+1 end token for stop)."""
    opened = builder.prompt_text(MESSAGES, True).rstrip("\n").endswith("<think>")
    text = completion_layout(reasoning, answer, False, opened)
    tokens = builder.tokenizer(text, add_special_tokens=False)["input_ids"]
    made = settings(cap)
    return {
        "index": 7,
        "prompt_id": "p7",
        "source": "s",
        "reasoning_content": reasoning,
        "content": answer,
        "finish_reason": finish,
        "prompt_tokens": 20,
        "completion_tokens": len(tokens) + (finish == "stop"),
        "output_token_ids": ([*tokens, builder.end_token_id] if finish == "stop" else tokens) if ids else None,
        "truncated_in_reasoning": False,
        "empty_answer": False,
        "max_output_tokens": cap,
        "settings_fingerprint": made.sampling_fingerprint(),
        "settings": made.settings_json,
        "latency_s": 3.5,
        "server": "s0",
        "attempts": 1,
        "error": None,
        "continued_from_tokens": 0,
        "cut_from_tokens": 0,
    }


def layout_ids(builder: SequenceBuilder, row: dict) -> list[int]:
    text = builder.completion_text(row, builder.prompt_text(MESSAGES, True))
    return builder.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("ids", [False, True], ids=["text", "server_ids"])
def test_the_cut_row_is_the_first_cap_tokens_wherever_the_cap_falls(builder, ids):
    row = made_row(builder, REASONING, ANSWER, "stop", 4096, ids=ids)
    full = layout_ids(builder, row)
    close = full.index(builder.tokenizer.convert_tokens_to_ids("</think>"))
    gap = builder.tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    assert full[close + 1 : close + 3] == builder.tokenizer("\n\nUse", add_special_tokens=False)["input_ids"][:2]
    for cap in sorted({3, close - 1, close, close + 1, close + 2, close + 3, close + 4, len(full) - 1}):
        cut, why = cut_to_cap(row, MESSAGES, settings(cap), builder)
        assert why is None and cut is not None, (cap, why)
        if close < cap <= close + 3:
            # cut between </think> and the answer's first token: stored, as a server's reply cut there is,
            # as closed thinking and an empty answer, which renders with the template's "\n\n"
            assert layout_ids(builder, cut) == full[: close + 1] + gap and cut["content"] == "", cap
        else:
            assert layout_ids(builder, cut) == full[:cap], cap  # token for token, the original's head
        assert (cut["finish_reason"], cut["completion_tokens"], cut["max_output_tokens"]) == ("length", cap, cap)
        assert cut["cut_from_tokens"] == row["completion_tokens"] and cut["latency_s"] == 3.5
        assert cut["truncated_in_reasoning"] == (cap <= close), cap  # the thinking closes with </think>
        assert cut["empty_answer"] == (not (cut["content"] or "").strip())
        assert cut["settings"] == settings(cap).settings_json
        assert cut["output_token_ids"] == (full[:cap] if ids else None)
        assert REASONING.startswith(cut["reasoning_content"].rstrip("\n"))
        assert ANSWER.startswith(cut["content"])


def test_a_row_without_thinking_and_a_length_row_cut_again(builder):
    plain = made_row(builder, None, ANSWER, "stop", 4096)
    plain["settings_fingerprint"] = settings(5).sampling_fingerprint()
    cut, _ = cut_to_cap(plain, MESSAGES, settings(5), builder)
    assert (
        cut["reasoning_content"] is None
        and builder.tokenizer(cut["content"], add_special_tokens=False)["input_ids"]
        == builder.tokenizer(ANSWER, add_special_tokens=False)["input_ids"][:5]
    )
    long = made_row(builder, REASONING, ANSWER, "length", 64)
    again, why = cut_to_cap(long, MESSAGES, settings(20), builder)
    assert why is None and layout_ids(builder, again) == layout_ids(builder, long)[:20]


def test_rows_that_cannot_be_cut_say_why(builder):
    row = made_row(builder, REASONING, ANSWER, "stop", 4096)
    off = dict(row, completion_tokens=row["completion_tokens"] + 3)  # the model's tokens were not the text's encoding
    assert cut_to_cap(off, MESSAGES, settings(10), builder) == (
        None,
        "its text encodes to another token count than it was generated with",
    )
    assert (
        cut_to_cap(row, MESSAGES, settings(10, presence_penalty=0.5), builder)[1] == "made with other sampling settings"
    )
    assert cut_to_cap(dict(row, error="HTTP 500"), MESSAGES, settings(10), builder)[0] is None
    assert cut_to_cap(row, MESSAGES, settings(row["completion_tokens"]), builder)[0] is None  # not longer than the cap


def test_a_continued_row_cut_inside_its_first_part_is_no_longer_continued(builder):
    row = dict(made_row(builder, REASONING, ANSWER, "stop", 4096), continued_from_tokens=8)
    assert cut_to_cap(row, MESSAGES, settings(4), builder)[0]["continued_from_tokens"] == 0
    assert cut_to_cap(row, MESSAGES, settings(20), builder)[0]["continued_from_tokens"] == 8


def _plan_run(tmp_path, builder_path, keys, settings_):
    import logging

    from dflash_assets.stages.completions.range_run import RangeRun
    from dflash_assets.stages.resources.inference import InferenceServerResource
    from dflash_assets.storage.store import Storage

    inference = InferenceServerResource(
        mode="external", base_urls=["http://127.0.0.1:9/v1"], external_tokenizer_path=str(builder_path)
    )
    return RangeRun(logging.getLogger("test"), Storage(str(tmp_path)), settings_, keys), inference


def test_lowering_a_half_done_partition_cuts_what_it_has_and_journals_nothing(tmp_path):
    """Review: a partition killed with 2 of 4 rows journaled, then the cap lowered, raised KeyError on
    every rerun (prompts without a row were looked up). And cut rows journaled at planning outlived a
    run that failed to start its servers, then replaced the valid table when the cap went back up."""
    import polars as pl
    from transformers import AutoTokenizer

    from dflash_assets.data.shapes import content_hash
    from dflash_assets.generation.rows.journal import RowJournal
    from dflash_assets.generation.rows.records import rows_to_frame
    from dflash_assets.stages.completions.tables import partition_file

    path = write_thinking_tokenizer(tmp_path / "tok", opens_think=False)
    builder = SequenceBuilder(AutoTokenizer.from_pretrained(str(path)))
    # rows name their prompt by content (issue 26): the corpus's content_hash, the rows' prompt_hash
    hashes = [content_hash([*MESSAGES, {"role": "user", "content": f"variant {i}"}]) for i in range(4)]
    prompts = pl.DataFrame(
        {
            "index": [0, 1, 2, 3],
            "prompt_id": ["p0", "p1", "p2", "p3"],
            "source": ["s"] * 4,
            "messages": [MESSAGES] * 4,
            "content_hash": hashes,
        }
    )

    def rows(indexes):
        made = made_row(builder, REASONING, ANSWER, "stop", 64)
        return [dict(made, index=i, prompt_id=f"p{i}", prompt_hash=hashes[i]) for i in indexes]

    journal = RowJournal(tmp_path / "j.jsonl")
    journal.append_many(rows([0, 2]))
    run, inference = _plan_run(tmp_path / "store", path, ["0000000-0000003"], settings(10))
    part = run.plan("0000000-0000003", prompts, journal, inference)
    assert part.cut == 2 and sorted(p["index"] for p in part.todo) == [1, 3] and part.reasons == {"missing": 2}
    assert sorted(journal.load()) == [0, 2] and journal.load()[0]["completion_tokens"] > 10  # the journal is as it was

    # a range run over a complete table: everything cut, nothing requested, the table committed
    store_root = tmp_path / "range"
    run, inference = _plan_run(store_root, path, ["0000000-0000003", "0000004-0000007"], settings(10))
    run.store.write_parquet(rows_to_frame(rows([0, 1, 2, 3])), *partition_file("0000000-0000003"))
    empty = RowJournal(tmp_path / "empty.jsonl")
    part = run.plan("0000000-0000003", prompts, empty, inference)
    assert part.cut == 4 and not part.todo and empty.load() == {}
    (committed,) = list(run.commit_or_keep(part))
    assert committed.metadata["cut_to_lowered_cap"] == 4
    table = pl.read_parquet(store_root / "completions" / "0000000-0000003.parquet")
    assert table["completion_tokens"].to_list() == [10] * 4 and (table["cut_from_tokens"] > 10).all()


def test_a_tokenizer_directory_that_is_not_there_is_called_that(tmp_path):
    """New-user trial: a wrong external_tokenizer_path warned with transformers' 'Repo id must be in the
    form ...' rather than saying the directory is missing."""
    from dflash_assets.stages.completions.continuing import missing_directory

    with pytest.raises(FileNotFoundError, match="no such directory: /nowhere/tokenizer"):
        missing_directory("/nowhere/tokenizer")
    missing_directory(str(tmp_path))  # a directory
    missing_directory("Qwen/Qwen3-8B")  # may be a hub id in the local cache: left to transformers
