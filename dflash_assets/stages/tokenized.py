"""The ``tokenized_sequences`` stage, outside any Dagster run: its settings (:class:`TokenizeConfig`), where a
partition's table lives, and :func:`tokenize_stage`, the stage's whole work for one partition (the asset and
bench/bench_tokenize.py both run it)."""

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

import dagster as dg
import polars as pl
import pyarrow as pa
from pydantic import Field

from dflash_assets.data.tokenization import SequenceBuilder, TokenizePolicy, degenerate_mask_mode, tokenize_partition
from dflash_assets.generation.rows.records import PROMPT_TOO_LONG
from dflash_assets.orchestration.check_gate import CHECK_DEGENERATE, CHECK_NONEMPTY, CHECK_ROUNDTRIP
from dflash_assets.storage.store import parquet_bytes

CHECK_MAX_LENGTH = "max_length_fits_prompt_plus_cap"
CHECK_RETOKENIZED = "retokenized_length_matches_server"


def tokenized_file(pk: str) -> tuple[str, str]:
    return ("tokenized_sequences", f"{pk}.parquet")


class CompletionsSourceError(ValueError):
    """Which completions table to tokenize cannot be told, or it is missing (the message says how to fix it)."""


@dataclass(frozen=True)
class CompletionsSource:
    """The completions table ``tokenized_sequences[pk]`` reads: ``parts`` (storage path), ``mode`` (``regenerate``
    or ``on_policy``) and ``ignored``: the other mode's table when one exists too (not read: it is stale)."""

    parts: tuple[str, str]
    mode: str
    ignored: tuple[str, str] | None = None

    @property
    def on_policy(self) -> bool:
        return self.mode == "on_policy"


def completions_source(store, pk: str, recorded_mode: str | None) -> CompletionsSource:
    """Which of partition ``pk``'s completions tables to tokenize.

    A partition may hold both ``completions/<pk>.parquet`` (``mode: regenerate``) and
    ``completions/<pk>.on_policy.parquet`` (``mode: on_policy``) when completions ran in both modes. The one read
    is the one the latest completions materialization made (``recorded_mode``: its metadata's ``mode``,
    ``regenerate`` when it has none): that is the partition's completions as Dagster, ``status`` and the
    freshness rules know them, and the other table is what an earlier run of the other mode left (its rows
    judged by no check since): never mixed in. Without a materialization (``recorded_mode`` None: tables written
    outside Dagster) the one table that exists is read.

    Raises:
        CompletionsSourceError: the recorded mode's table is missing, or no materialization says which of two
            tables to read; the message names the files and the fix.
    """
    from dflash_assets.stages.completions.on_policy import table_file as on_policy_file
    from dflash_assets.stages.completions.tables import partition_file

    files = {"regenerate": partition_file(pk), "on_policy": on_policy_file(pk)}
    present = {mode for mode, parts in files.items() if store.exists(*parts)}
    mode = recorded_mode
    if mode is None:
        if len(present) == 2:
            raise CompletionsSourceError(
                f"{pk}: both {'/'.join(files['regenerate'])} and {'/'.join(files['on_policy'])} exist and no "
                "completions materialization says which is current: materialize completions for this partition "
                "in the mode to train on (ops.completions.config.mode), or remove the other table"
            )
        mode = next(iter(present), "regenerate")
    if mode not in files:
        raise CompletionsSourceError(f"{pk}: completions recorded mode {mode!r}, not one of {sorted(files)}")
    if mode not in present:
        raise CompletionsSourceError(
            f"{pk}: the latest completions of this partition ran mode: {mode}, but {'/'.join(files[mode])} is "
            "missing: materialize completions for this partition again"
        )
    other = next((parts for m, parts in files.items() if m != mode and m in present), None)
    return CompletionsSource(files[mode], mode, other)


class TokenizeConfig(dg.Config):
    """Policies for rows that are not plain finished completions (counts go to metadata)."""

    max_length: int = Field(default=3072, ge=8, description="Longest sequence kept, tokens (DFlash trains at 3072).")
    truncated: Literal["drop", "keep"] = Field(
        default="drop", description="drop | keep rows with finish_reason length (kept without end token)."
    )
    over_max_length: Literal["drop", "cut"] = Field(
        default="drop", description="drop | cut sequences longer than max_length."
    )
    end_token: str = Field(
        default="", description="End-of-turn token; empty = <|im_end|> if in the vocabulary, else eos."
    )
    degenerate_small_tokens: int = Field(
        default=16, ge=0, description="A mask-length mode at or below this many tokens..."
    )
    degenerate_share: float = Field(
        default=0.5, ge=0.0, le=1.0, description="...held by more than this share of rows fails the check."
    )


def tokenize_stage(
    store,
    pk: str,
    completions: pl.DataFrame,
    prompts: pl.DataFrame,
    builder: SequenceBuilder,
    config: TokenizeConfig,
    cap: int,
    on_policy: bool = False,
):
    """The stage's whole work for one partition, without Dagster's bookkeeping (the asset and
    bench/bench_tokenize.py both run this): tokenize, write the table and the set-aside rows, hash the
    written table's bytes (the data version), run the checks. One after another: with the checks at ~5% of
    the tokenization (table-driven round-trip decode), running the writes on a second thread beside them
    was slower (median 0.274 vs 0.255 s per 1,000 rows on 2 cores, bench/bench_tokenize.py).

    ``on_policy``: ``completions`` are the partition's on-policy rows (``completions/<pk>.on_policy.parquet``),
    each tokenized with its own context (:func:`~dflash_assets.data.tokenization.tokenize_partition`).

    Returns:
        ``(tokenized, set_aside, counts, uri, data_version, check_results)``.

    Raises:
        OSError / StorageError: a write failed (before the checks ran; nothing is half-written).
    """
    policy = TokenizePolicy(config.max_length, config.truncated, config.over_max_length)
    tokenized, aside, counts = tokenize_partition(completions, prompts, builder, policy, on_policy)
    uri, version = _write_outputs(store, pk, tokenized, aside)
    checks = list(run_checks(tokenized, completions, builder, config, cap, on_policy))
    return tokenized, aside, counts, uri, version, checks


def _write_outputs(store, pk: str, tokenized: pl.DataFrame, aside: pl.DataFrame) -> tuple[str, str]:
    """Write the table and the set-aside rows; ``(uri, data version)``, the version being the sha256
    (first 20 hex digits) of the table's bytes as written."""
    data = parquet_bytes(tokenized)
    uri = store.write_bytes(data, *tokenized_file(pk))
    store.write_parquet(aside, "tokenized_sequences", f"{pk}.set_aside.parquet")
    return uri, hashlib.sha256(data).hexdigest()[:20]


def _column(frame: pl.DataFrame, name: str) -> list:
    return frame[name].to_list() if name in frame.columns else [None] * frame.height


def run_checks(
    tokenized: pl.DataFrame,
    completions: pl.DataFrame,
    builder: SequenceBuilder,
    config: TokenizeConfig,
    cap: int,
    on_policy: bool = False,
):
    """The per-partition checks as AssetCheckResults (the first three block downstream stages).

    An on-policy partition (``on_policy``) in which no conversation ran (none of the corpus's BFCL
    conversations starts in it) has no row, rightly, as a partition whose every prompt was too long.
    The round trip compares each row's text (``reasoning_content``, ``content``: for an on-policy turn the reply
    as generated, tool-call markup included) with its supervised tokens decoded, special tokens kept.

    Reads columns whole (no per-row dicts): building row dicts of the ``input_ids`` lists costs as much as
    the round-trip decode itself.
    """
    index, num_loss = tokenized["index"].to_list(), tokenized["num_loss_tokens"].to_list()
    empty = [i for i, n in zip(index, num_loss) if n == 0]
    # a partition whose every prompt was set aside as too long for the context has nothing to train on, rightly
    never_sent = completions.height > 0 and completions["finish_reason"].eq_missing(PROMPT_TOO_LONG).all()
    no_conversation = on_policy and completions.height == 0
    yield dg.AssetCheckResult(
        check_name=CHECK_NONEMPTY,
        passed=not empty and (tokenized.height > 0 or never_sent or no_conversation),
        metadata={"empty_mask_rows": len(empty), "first_indexes": str(empty[:10]), "rows": tokenized.height},
        description=None
        if tokenized.height
        else f"every prompt was set aside as {PROMPT_TOO_LONG}: no row to train on"
        if never_sent
        else "no on-policy conversation starts in this partition: no row to train on"
        if no_conversation
        else "no row was kept",
    )
    mode = degenerate_mask_mode(num_loss, config.degenerate_small_tokens, config.degenerate_share)
    yield dg.AssetCheckResult(
        check_name=CHECK_DEGENERATE,
        passed=mode is None,
        metadata={"mode_num_loss_tokens": mode[0] if mode else -1, "mode_share": round(mode[1], 3) if mode else 0.0},
        description=(f"{mode[1]:.0%} of rows supervise exactly {mode[0]} tokens: empty answers?" if mode else None),
    )
    bad, retokenized = _round_trip(tokenized, completions, builder)
    yield dg.AssetCheckResult(
        check_name=CHECK_ROUNDTRIP,
        passed=not bad,
        metadata={"mismatched_rows": len(bad), "first_indexes": json.dumps(bad[:10])},
    )
    differ = [i for i, n, c in retokenized if c is not None and n != c]
    yield dg.AssetCheckResult(
        check_name=CHECK_RETOKENIZED,
        passed=not differ,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "retokenized_rows": len(retokenized),
            "length_differs": len(differ),
            "first_indexes": json.dumps(differ[:10]),
        },
        description=f"{len(differ)} re-tokenized rows differ from the server's token count; "
        "serve with token ids (SGLang) to be exact"
        if differ
        else None,
    )
    prompt_lens = tokenized["prompt_len"].to_list()
    would_cut = sum(1 for p in prompt_lens if p + cap > config.max_length)
    share = would_cut / len(prompt_lens) if prompt_lens else 0.0
    yield dg.AssetCheckResult(
        check_name=CHECK_MAX_LENGTH,
        passed=share <= 0.5,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "share_prompt_plus_cap_over_max_length": round(share, 4),
            "max_length": config.max_length,
            "cap": cap,
        },
    )


def _round_trip(
    tokenized: pl.DataFrame, completions: pl.DataFrame, builder: SequenceBuilder
) -> tuple[list[int], list[tuple[int, int, int | None]]]:
    """``(indexes of whole rows whose text is not in their supervised tokens decoded, (index, loss tokens, the
    server's completion tokens) of whole rows re-tokenized here: the server returned no token ids)``."""
    index, num_loss = tokenized["index"].to_list(), tokenized["num_loss_tokens"].to_list()
    position = {i: k for k, i in enumerate(completions["index"].to_list())}
    reasoning, content = _column(completions, "reasoning_content"), _column(completions, "content")
    server_ids = (
        completions["output_token_ids"].is_not_null().to_list()
        if "output_token_ids" in completions.columns
        else [False] * completions.height
    )
    completion_tokens = _column(completions, "completion_tokens")
    prompt_lens, cut, finish = (tokenized[c].to_list() for c in ("prompt_len", "cut", "finish_reason"))
    # the completion ids of every whole row, sliced from the flat Arrow buffers (offsets index into values)
    ids = tokenized["input_ids"].to_arrow()
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    offsets, flat = ids.offsets.to_numpy(), ids.values.to_numpy(zero_copy_only=False)
    whole = [k for k in range(tokenized.height) if not cut[k]]
    decoded_all = builder.decode_spans(flat, [(offsets[k] + prompt_lens[k], offsets[k + 1], finish[k]) for k in whole])
    bad = []
    for k, decoded in zip(whole, decoded_all):
        pos = position[index[k]]
        expected = [t for t in (reasoning[pos], content[pos]) if t and t.strip()]
        # an exact substring is a squashed one too (whitespace runs inside it are runs of the decoded text)
        if not all(t in decoded or _squash(t) in _squash(decoded) for t in expected):
            bad.append(index[k])
    retokenized = [
        (index[k], num_loss[k], completion_tokens[position[index[k]]])
        for k in whole
        if not server_ids[position[index[k]]]
    ]
    return bad, retokenized


def _squash(text: str) -> str:
    return " ".join(text.split())
