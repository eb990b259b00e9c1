"""What a range run of ``completions`` plans and reports: the prompts each partition requests
(:func:`plan_requests`), a partition's state during the run (:class:`Partition`), the event the run
yields when a partition is done (:class:`PartitionComplete`), and what the run's stream reads and sets on the
run (:class:`StreamedRun`). Dagster-free: the asset turns the events into materializations."""

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import polars as pl

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.rows.records import invalid_reason, prompt_mismatch, row_problem


class RangeRunError(Exception):
    """The run must stop: the message names the cause and the fix (the asset's failure)."""


@dataclass
class PartitionComplete:
    """A partition of the run is done. Committed: ``data_version`` (sha256 of the table written, 20 hex
    digits) and ``metadata`` (plain values; ``path`` is the table's uri). Not committed because none of its
    rows succeeded: ``failure`` says so (the run fails at its end, the journal kept)."""

    pk: str
    data_version: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    failure: str | None = None


def plan_requests(
    prompts: pl.DataFrame, existing: dict[int, dict], settings: GenerationSettings
) -> tuple[list[dict], Counter, dict[int, str]]:
    """Prompts (corpus rows) that need a request, why (counted by reason) and each one's reason by index. A
    row made for another prompt than the corpus's at its index (:func:`prompt_mismatch`) is never used:
    requested again as ``prompt changed`` (or ``prompt unknown``, a row from before rows named their prompt)."""
    todo, reasons, why = [], Counter(), {}
    for prompt in prompts.iter_rows(named=True):
        row = existing.get(prompt["index"])
        # a row that cannot be stored as it is (a journal line with a count past its type, say) is redone
        reason = (
            "missing"
            if row is None
            else prompt_mismatch(row, prompt)
            or ("unstorable row" if row_problem(row) else invalid_reason(row, settings))
        )
        if reason is not None:
            todo.append(prompt)
            reasons[reason] += 1
            why[prompt["index"]] = reason
    return todo, reasons, why


def prompt_length(prompt: dict, view: dict[int, dict], settings: GenerationSettings) -> int | None:
    """The templated length of ``prompt`` a stored row of it already gives (``view``: index -> row, rows of
    other prompts already dropped): its ``prompt_tokens`` (the server's count, or an earlier set-aside's) when
    the row has no error and was made under this sampling (the same thinking flag, so the same template); else
    None."""
    row = view.get(prompt["index"]) or {}
    usable = not row.get("error") and row.get("settings_fingerprint") == settings.sampling_fingerprint()
    return int(row["prompt_tokens"]) if usable and row.get("prompt_tokens") is not None else None


def prompt_lengths(
    prompts: list[dict], view: dict[int, dict], settings: GenerationSettings, builder=None
) -> dict[int, int]:
    """Templated prompt tokens of each of ``prompts`` (index -> tokens): :func:`prompt_length` where a stored
    row gives it, else counted once by ``builder`` (a :class:`~dflash_assets.data.tokenization.SequenceBuilder`
    on the target's tokenizer: chat template, generation prompt, ``settings.enable_thinking``), batched.

    Raises:
        ValueError: a prompt has no stored length and no ``builder`` is given.
    """
    lengths = {p["index"]: n for p in prompts if (n := prompt_length(p, view, settings)) is not None}
    unknown = [p for p in prompts if p["index"] not in lengths]
    if unknown and builder is None:
        raise ValueError(f"{len(unknown)} prompts have no stored length and no tokenizer was given")
    if unknown:
        counted = builder.prompt_lengths(
            [p["messages"] for p in unknown], settings.enable_thinking, [p.get("tools") for p in unknown]
        )
        lengths.update(zip((p["index"] for p in unknown), counted, strict=True))
    return lengths


@dataclass
class Partition:
    """One partition of the run: its prompts, rows so far, and what is still out. ``existing``: index ->
    whole row for what its last table lacks or will lose (journal rows, cut rows being continued,
    this run's rows); the table's other rows are read again only at commit."""

    pk: str
    prompts: pl.DataFrame
    journal: object
    existing: dict
    todo: list
    reasons: Counter
    remaining: int = 0
    resumed: int = 0  # valid rows taken from the journal an interrupted run left (not requested again)
    cut: int = 0  # rows cut to a lowered cap in memory (not journaled): the table must be rewritten
    too_long: int = 0  # prompts set aside as too long for the context, in memory (not journaled), never sent
    first_sent: float | None = None
    by_index: dict = field(default_factory=dict)


class StreamedRun(Protocol):
    """The run as its stream (:func:`~dflash_assets.stages.completions.range_stream.stream_partitions`) sees it: what
    the stream reads, sets (``client``, ``capacity``, ``failure``) and calls. The range run is one; declared
    here, beside the types both range modules share, so that neither imports the other for an annotation."""

    settings: GenerationSettings
    log: Any  # info / warning
    keys: list[str]
    rows_total: int
    continuing_rows: dict[int, dict]
    client: Any
    capacity: int
    failure: Exception | None

    def progress_line(self) -> str: ...

    def commit(self, part: Partition) -> Iterator[PartitionComplete]: ...
