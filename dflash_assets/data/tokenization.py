"""Token sequences and loss masks from the generation boundary, a partition at a time (no Dagster imports).

``input_ids = prompt_ids + completion_ids``. Where the reply gave them, both are the server's own ids
(``ids_source`` ``server``): the tokens the engine conditioned on and sampled, whatever the project would render.
Otherwise ``prompt_ids`` is the chat template applied to the prompt messages and tools as the row's engine hands
them to it (:mod:`~dflash_assets.generation.engines.engine_render`), with the generation prompt and the row's
template settings (thinking on/off), and ``completion_ids`` are the server's generated ids, else the completion
re-tokenized exactly as emitted (``ids_source`` ``rendered``). ``loss_mask`` is 0 on the prompt (earlier turns,
tool results, tool schemas) and 1 on the completion (reasoning, thinking markers, tool-call markup, answer, and
the end-of-turn token of ``stop`` rows). The assistant turn is never re-rendered through the template: that is
where masks go wrong. The project's rendering of every row with the server's ``prompt_token_ids`` is held against
them and a difference reported with its cause (:mod:`~dflash_assets.data.prompt_check`): the rendering the length
pre-filter and the in-process evaluation rely on.

On-policy rows (``completions/<pk>.on_policy.parquet``, :mod:`dflash_assets.data.on_policy`) carry their own
context: ``messages`` and ``tools``, rendered the same way where the server gave no ids, and each row is checked
against the corpus row its conversation started from (:data:`CORPUS_INDEX`) instead of a corpus row at its own
index. The per-row sequences are :class:`~dflash_assets.data.sequence_builder.SequenceBuilder`'s.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from dflash_assets.data.on_policy import TURN_STRIDE
from dflash_assets.data.prompt_check import PromptCheck, PromptDifference, TokenizeCounts, explain
from dflash_assets.data.row_context import CORPUS_INDEX, CorpusRows
from dflash_assets.data.sequence_builder import Built, SequenceBuilder, TokenizationError, row_thinking
from dflash_assets.generation.engines.chat_render import first_difference
from dflash_assets.generation.rows.records import IDS_SERVER, IDS_UNKNOWN
from dflash_assets.generation.servers.origin import text_sha256

__all__ = [
    "ON_POLICY_TOKENIZED_SCHEMA",
    "PROVENANCE_COLUMNS",
    "TOKENIZED_SCHEMA",
    "TokenizePolicy",
    "check_renderings",
    "degenerate_mask_mode",
    "read_provenance",
    "tokenize_partition",
]

TOKENIZED_SCHEMA = {
    "index": pl.Int64,
    "prompt_id": pl.String,
    "prompt_hash": pl.String,  # the corpus's content_hash of the prompt these tokens start with
    "input_ids": pl.List(pl.Int32),
    "loss_mask": pl.List(pl.Int8),
    "prompt_len": pl.Int64,
    "num_loss_tokens": pl.Int64,
    "finish_reason": pl.String,
    "cut": pl.Boolean,
    # where input_ids come from: "server" (the reply's prompt ids and generated ids, as they are) or "rendered" (the
    # context rendered here, as `engine` hands it to the template); a table made before the column has none: read
    # it as "unknown" (data/tokenization.py read_provenance), never as the server's
    "ids_source": pl.String,
    "engine": pl.String,  # sglang, vllm, transformers, openai: the server's engine, or whose hand-over was rendered
    "engine_version": pl.String,  # as the server said it ("unknown" when it did not)
    "template_sha256": pl.String,  # the chat template the ids were rendered with (the server's, for server ids)
    # the project's rendering equals the server's prompt ids (null: the row carries none to compare with)
    "rendering_matches": pl.Boolean,
}
PROVENANCE_COLUMNS = ("ids_source", "engine", "engine_version", "template_sha256", "rendering_matches")
#: An on-policy table's schema: TOKENIZED_SCHEMA and :data:`~dflash_assets.data.row_context.CORPUS_INDEX`.
ON_POLICY_TOKENIZED_SCHEMA = {**TOKENIZED_SCHEMA, CORPUS_INDEX: pl.Int64}


@dataclass(frozen=True)
class TokenizePolicy:
    """What to do with rows that are not plain finished completions.

    truncated: ``drop`` (default) or ``keep`` a ``length`` row, without an end token.
    over_max_length: ``drop`` (default) or ``cut`` a sequence longer than ``max_length`` tokens.
    Error rows are always skipped.
    """

    max_length: int = 3072
    truncated: str = "drop"
    over_max_length: str = "drop"

    def __post_init__(self):
        if self.truncated not in ("drop", "keep") or self.over_max_length not in ("drop", "cut"):
            raise ValueError(f"bad policy {self}: truncated in drop|keep, over_max_length in drop|cut")


def tokenize_partition(
    completions: pl.DataFrame,
    prompts: pl.DataFrame,
    builder: SequenceBuilder,
    policy: TokenizePolicy,
    on_policy: bool = False,
) -> tuple[pl.DataFrame, pl.DataFrame, Counter]:
    """Tokenize one partition (one batched tokenizer call, see :meth:`SequenceBuilder.build_many`).

    Args:
        completions: rows with the completions schema; with ``on_policy``, on-policy rows
            (:data:`~dflash_assets.data.on_policy.ON_POLICY_SCHEMA`: their context in ``messages`` / ``tools``).
        prompts: corpus rows (``index``, ``messages``, ``content_hash``, ``tools`` when the corpus has them;
            ``conversation_id`` for ``on_policy``) of the partition. A regeneration row whose ``prompt_hash`` is not
            the corpus's ``content_hash`` at its index is set aside (counted as ``other_prompt``), never paired
            with the corpus's messages. An on-policy row is set aside the same way when the corpus row at
            ``index // TURN_STRIDE`` (its conversation's first) is gone, is of another conversation, or offers
            other tools than the row was generated with.
        on_policy: the rows are on-policy turns: each one's context is its own ``messages`` + ``tools``; the
            table gets :data:`CORPUS_INDEX` and ``prompt_hash`` is its conversation's first corpus row's hash.

    The server's ids are the row where it gave them (:meth:`SequenceBuilder.build_many`); the project's rendering
    of every row that carries ``prompt_token_ids`` is held against them (:func:`check_renderings`): a difference
    is counted (``prompt_ids_differ``) and the first one explained (``counts.first_prompt_difference``), never
    raised. A row made before ``ids_source`` existed whose ids differ from its rendering is set aside
    (``rendering_differs``): nothing says its ids are the server's, and its rendering is not what the server saw.

    Returns:
        ``(tokenized, set_aside, counts)``: TOKENIZED_SCHEMA rows (ON_POLICY_TOKENIZED_SCHEMA with ``on_policy``)
        sorted by ``index``; rows not kept with ``index`` and ``reason``; counts by outcome (kept,
        dropped_truncated, dropped_over_max_length, cut, error_rows, prompt_too_long, tokenization_errors,
        other_prompt, rendering_differs), by ids source (``ids_server``, ``ids_rendered``) and of the check
        (``prompt_ids_checked``, ``prompt_ids_differ``), a :class:`~dflash_assets.data.prompt_check.TokenizeCounts`.
    """
    corpus = CorpusRows(prompts, on_policy)
    todo, aside, counted = corpus.rows_to_tokenize(completions, policy.truncated)
    counts = TokenizeCounts(counted)
    contexts = corpus.contexts(todo)
    built = builder.build_many(todo, *contexts)
    check = check_renderings(builder, todo, built, *contexts)
    if check.compared:
        counts["prompt_ids_checked"] = check.compared
    if check.differ:
        counts["prompt_ids_differ"] = len(check.differ)
        counts.first_prompt_difference = check.first.message() if check.first else None
    differ = set(check.differ)
    kept_rows, kept_ids, prompt_lens, cuts, sources = [], [], [], [], []
    for row, result in zip(todo, built):
        idx = row["index"]
        if isinstance(result, TokenizationError):
            counts["tokenization_errors"] += 1
            aside.append({"index": idx, "reason": str(result)})
            continue
        if idx in differ and result.source != IDS_SERVER:
            counts["rendering_differs"] += 1
            aside.append({"index": idx, "reason": RENDERING_DIFFERS})
            continue
        input_ids, prompt_len = result.input_ids, result.prompt_len
        cut = False
        if len(input_ids) > policy.max_length:
            if policy.over_max_length == "drop" or prompt_len >= policy.max_length:
                counts["dropped_over_max_length"] += 1
                aside.append({"index": idx, "reason": f"{len(input_ids)} tokens > max_length {policy.max_length}"})
                continue
            input_ids, cut = input_ids[: policy.max_length], True
            counts["cut"] += 1
        counts["kept"] += 1
        if on_policy:  # the corpus's hash of the conversation's first row: what later stages check it against
            anchor = idx // TURN_STRIDE
            row = {**row, "prompt_hash": corpus.hashes[anchor], CORPUS_INDEX: anchor}
        counts[f"ids_{result.source}"] += 1
        kept_rows.append(row)
        kept_ids.append(input_ids)
        prompt_lens.append(prompt_len)
        cuts.append(cut)
        sources.append(_provenance(row, result, builder, idx not in differ if idx in check.checked else None))
    tokenized = _tokenized_frame(kept_rows, kept_ids, prompt_lens, cuts, on_policy, sources)
    aside_df = pl.DataFrame(aside, schema={"index": pl.Int64, "reason": pl.String}).sort("index")
    return tokenized, aside_df, counts


#: Why a row made before ``ids_source`` existed is set aside when its rendering is not its server's prompt ids.
RENDERING_DIFFERS = (
    "rendering_differs: the row predates ids_source, so its prompt_token_ids are not taken as the server's, and "
    "the project's rendering of its context differs from them; regenerate the partition's completions (rows made "
    "now record where their ids come from)"
)


def check_renderings(
    builder: SequenceBuilder, rows: list[dict], built: list, messages: list, tools: list
) -> PromptCheck:
    """Hold the project's rendering of each row (``built[k].rendered``) against its ``prompt_token_ids`` where it
    has them: the indexes compared (``checked``) and differing, and the first difference explained
    (:func:`~dflash_assets.data.prompt_check.explain`)."""
    check = PromptCheck()
    for k, (row, result) in enumerate(zip(rows, built, strict=True)):
        server = row.get("prompt_token_ids")
        if isinstance(result, TokenizationError) or server is None:
            continue
        server = [int(t) for t in server]
        check.compared += 1
        check.checked.add(row["index"])
        at = first_difference(result.rendered, server)
        if at is None:
            continue
        check.differ.append(row["index"])
        if check.first is None:
            mine, decode = result.rendered, builder.tokenizer.decode
            cause = explain(
                builder, result.engine, messages[k], tools[k] if tools else None, row_thinking(row), mine, server
            )
            check.first = PromptDifference(
                row["index"],
                row.get("prompt_id"),
                result.engine,
                at,
                len(mine),
                len(server),
                decode(mine[at : at + 8], skip_special_tokens=False) if at < len(mine) else "(ends here)",
                decode(server[at : at + 8], skip_special_tokens=False) if at < len(server) else "(ends here)",
                cause,
            )
    return check


def _provenance(row: dict, result: Built, builder: SequenceBuilder, matches: bool | None) -> dict[str, Any]:
    """A tokenized row's ``ids_source``, ``engine``, ``engine_version``, ``template_sha256`` and
    ``rendering_matches`` (None: no server ids to compare with). A server row records the completions row's
    engine and template; a rendered one the engine whose hand-over was reproduced and the template rendered with
    (the completions row's version of that engine, :data:`~dflash_assets.generation.rows.records.IDS_UNKNOWN` for
    a row made before the column)."""
    if result.source == IDS_SERVER:
        template = row.get("template_sha256") or IDS_UNKNOWN
    else:
        template = text_sha256(getattr(builder.tokenizer, "chat_template", None))
    return {
        "ids_source": result.source,
        "engine": result.engine,
        "engine_version": row.get("engine_version") or IDS_UNKNOWN,
        "template_sha256": template,
        "rendering_matches": matches,
    }


def _tokenized_frame(
    rows: list[dict],
    input_ids: list[list[int]],
    prompt_lens: list[int],
    cuts: list[bool],
    on_policy: bool = False,
    provenance: list[dict[str, Any]] | None = None,
) -> pl.DataFrame:
    """TOKENIZED_SCHEMA frame (ON_POLICY_TOKENIZED_SCHEMA with ``on_policy``, even when empty) built from flat
    arrays + offsets (building list columns from Python lists of lists costs as much as the tokenization);
    ``loss_mask`` = 0 before ``prompt_len``, 1 from it."""
    schema = ON_POLICY_TOKENIZED_SCHEMA if on_policy else TOKENIZED_SCHEMA
    if not rows:
        return pl.DataFrame(schema=schema)
    lengths = np.fromiter((len(ids) for ids in input_ids), dtype=np.int64, count=len(input_ids))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat_ids = np.fromiter(itertools.chain.from_iterable(input_ids), dtype=np.int32, count=int(offsets[-1]))
    starts, prompt = np.repeat(offsets[:-1], lengths), np.repeat(np.asarray(prompt_lens, dtype=np.int64), lengths)
    flat_mask = ((np.arange(offsets[-1], dtype=np.int64) - starts) >= prompt).astype(np.int8)
    pa_offsets = pa.array(offsets, type=pa.int64())
    return pl.DataFrame(
        {
            "index": pl.Series([r["index"] for r in rows], dtype=pl.Int64),
            "prompt_id": pl.Series([r["prompt_id"] for r in rows], dtype=pl.String),
            "prompt_hash": pl.Series([r["prompt_hash"] for r in rows], dtype=pl.String),
            "input_ids": pl.from_arrow(pa.LargeListArray.from_arrays(pa_offsets, pa.array(flat_ids))),
            "loss_mask": pl.from_arrow(pa.LargeListArray.from_arrays(pa_offsets, pa.array(flat_mask))),
            "prompt_len": pl.Series(prompt_lens, dtype=pl.Int64),
            "num_loss_tokens": pl.Series(lengths - np.asarray(prompt_lens, dtype=np.int64), dtype=pl.Int64),
            "finish_reason": pl.Series([r["finish_reason"] for r in rows], dtype=pl.String),
            "cut": pl.Series(cuts, dtype=pl.Boolean),
            **{
                name: pl.Series([p[name] for p in provenance or [{}] * len(rows)], dtype=TOKENIZED_SCHEMA[name])
                for name in PROVENANCE_COLUMNS
            },
            **({CORPUS_INDEX: pl.Series([r[CORPUS_INDEX] for r in rows], dtype=pl.Int64)} if on_policy else {}),
        }
    ).cast(schema)


def degenerate_mask_mode(num_loss_tokens: list[int], small: int = 16, share: float = 0.5) -> tuple[int, float] | None:
    """The empty-answer signature: more than ``share`` of rows with the same ``num_loss_tokens <= small``.

    Returns ``(length, share)`` of that mode, or None when the distribution is healthy.
    """
    if not num_loss_tokens:
        return None
    length, count = Counter(num_loss_tokens).most_common(1)[0]
    frac = count / len(num_loss_tokens)
    return (length, frac) if length <= small and frac > share else None


def read_provenance(tokenized: pl.DataFrame) -> pl.DataFrame:
    """A stored tokenized table with every :data:`PROVENANCE_COLUMNS` column: a table made before they existed gets
    ``ids_source`` ``unknown`` (never ``server``: nothing says where its ids came from), the others null."""
    missing = [name for name in PROVENANCE_COLUMNS if name not in tokenized.columns]
    filled = [
        (pl.lit(IDS_UNKNOWN) if name == "ids_source" else pl.lit(None)).cast(TOKENIZED_SCHEMA[name]).alias(name)
        for name in missing
    ]
    return tokenized.with_columns(filled) if filled else tokenized
