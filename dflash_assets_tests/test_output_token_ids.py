"""Where a row's token ids came from, and how many rows lack them (issue 38: SGLang's chat endpoint returns the
generated ids as ``response_token_ids``; read as ``token_ids``, every SGLang row silently lost them).

The replies SGLang 0.5.23 itself builds are judged in ``test_sglang_contract``; here, the same rows travel through
the completions table: the new ``output_token_ids_source`` column, a table written before it existed, and the
counts the completions metadata gives the summary."""

from __future__ import annotations

import polars as pl

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.client.results import CompletionResult
from dflash_assets.generation.rows.records import COMPLETIONS_SCHEMA, align_to_schema, row_from_result, rows_to_frame
from dflash_assets.stages.completions.tables import completion_stats

SETTINGS = GenerationSettings(max_output_tokens=8)


def result(index: int, ids: list[int] | None, source: str, error: str | None = None) -> CompletionResult:
    return CompletionResult(
        index=index,
        reasoning_content=None,
        content=None if error else "4",
        finish_reason=None if error else "stop",
        prompt_tokens=5,
        completion_tokens=None if error else 2,
        output_token_ids=ids,
        latency_s=0.1,
        server="http://s",
        attempts=1,
        error=error,
        output_token_ids_source=source,
    )


def row(index: int, *args, **kw) -> dict:
    prompt = {"index": index, "prompt_id": f"p:{index}", "source": "p", "content_hash": f"h{index}"}
    return row_from_result(result(index, *args, **kw), prompt, SETTINGS)


def test_rows_say_where_their_ids_came_from_and_the_metadata_counts_those_without():
    rows = [
        row(0, [19, 2], "response_token_ids"),  # SGLang's chat endpoint
        row(1, [19, 2], "token_ids"),  # vLLM
        row(2, None, "none"),  # transformers serve: no ids
        row(3, None, "none", error="HTTP 503"),  # an error row counts as neither
    ]
    assert [r["output_token_ids_source"] for r in rows] == ["response_token_ids", "token_ids", "none", "none"]
    stats = completion_stats(rows_to_frame(rows))
    assert stats["output_ids_missing"] == 1
    assert stats["output_token_ids_sources"] == {"none": 1, "response_token_ids": 1, "token_ids": 1}


def test_a_table_written_before_the_column_existed_still_reads_and_counts():
    old = rows_to_frame([row(0, [7, 8], "token_ids"), row(1, None, "none")]).drop("output_token_ids_source")
    assert "output_token_ids_source" not in old.columns
    aligned = align_to_schema(old)
    assert aligned.schema == pl.Schema(COMPLETIONS_SCHEMA)
    assert aligned["output_token_ids_source"].to_list() == [None, None]
    merged = pl.concat([aligned, rows_to_frame([row(2, [9], "response_token_ids")])])
    stats = completion_stats(merged)
    assert stats["output_ids_missing"] == 1  # from the ids themselves, whatever the row recorded
    assert stats["output_token_ids_sources"] == {"response_token_ids": 1, "unrecorded": 2}
