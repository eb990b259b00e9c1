"""The ``prompt_corpus`` stage, outside any Dagster run: its settings (:class:`PromptCorpusConfig`); read the
prompt files, give each prompt its stable index, write the corpus, the index table and the rejected rows. The
asset registers the partitions, logs, and turns :class:`CorpusStageError` into a failure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import dagster as dg
import polars as pl
from pydantic import Field, field_validator

from dflash_assets.common.settings import default_sources
from dflash_assets.data.bfcl import check_source_spec
from dflash_assets.data.conversation_shapes import DEFAULT_TURNS, TURN_KINDS
from dflash_assets.data.prompt_index import StableCorpus, save_index, stable_corpus
from dflash_assets.data.reader import GiB, MiB, ReadLimits
from dflash_assets.data.shapes import CorpusError, CorpusResult, build_corpus
from dflash_assets.generation.processes.machine import process_gone, process_record
from dflash_assets.storage.lock import LockBusyError, StoreLock

CORPUS_FILE = ("prompt_corpus", "corpus.parquet")
REJECTED_FILE = ("prompt_corpus", "rejected.parquet")
LOCK_FILE = ("prompt_corpus", ".build.lock")  # held while a build reads the last one and writes its files


class PromptCorpusConfig(dg.Config):
    """Where prompts come from and how they are split into partitions."""

    sources: list[str] = Field(
        default_factory=default_sources,
        description="Files, globs or directories (local or s3://) of JSONL / JSON arrays / Parquet, .gz allowed; or "
        "the embedded agentic tasks 'bfcl:multi_turn_base' (options '?limit=N', '&split=train|heldout|all').",
    )
    turns: Literal["last", "every"] = Field(
        default=DEFAULT_TURNS,
        description="Which assistant turns of a conversation become corpus rows. 'every' (default): one row per "
        "assistant turn, the conversation's own messages before it as context (tool calls and tool results "
        "included), plus one for a trailing user or tool message with no reply: the drafter serves every turn of "
        "an agentic session, not only the first. 'last': one row per record, the conversation without its "
        "trailing assistant turns. A single-turn record gives the same one row (same index) either way; only "
        "multi-turn records cost more requests.",
    )

    @field_validator("sources")
    @classmethod
    def _bfcl_options(cls, sources: list[str]) -> list[str]:
        # a bfcl: source's options, checked at start-up (validate_ops builds this class), not when the corpus builds
        return [check_source_spec(spec) for spec in sources]

    partition_size: int = Field(default=1000, ge=1, description="Prompts per index-range partition.")
    max_prompts: int | None = Field(
        default=None,
        ge=1,
        description="Keep only the first N prompts in sources order (demo runs); each keeps its stable index.",
    )
    max_record_mb: float = Field(
        default=ReadLimits.max_record_bytes / MiB,
        gt=0,
        description="Longest JSONL line / JSON-array element accepted, MiB: a longer one fails its file (a damaged "
        "file or a decompression bomb, never a prompt).",
    )
    max_file_gb: float = Field(
        default=ReadLimits.max_file_bytes / GiB,
        gt=0,
        description="Most content one prompt file may hold after gunzip, GiB (Parquet: the uncompressed size its "
        "footer declares); split larger corpora into several files.",
    )

    def read_limits(self) -> ReadLimits:
        """The bounds each prompt file is read under."""
        return ReadLimits(max_record_bytes=int(self.max_record_mb * MiB), max_file_bytes=int(self.max_file_gb * GiB))


class CorpusStageError(Exception):
    """The corpus cannot be built; ``metadata`` (plain values) goes with the failure."""

    def __init__(self, message: str, metadata: dict[str, Any] | None = None):
        super().__init__(message)
        self.metadata = metadata or {}


@dataclass
class CorpusBuild:
    """A written corpus: the read ``result`` (files, duplicates, rejected rows), the ``built`` stable corpus
    (rows, partition keys, edits against the last build), the corpus ``uri`` and the materialization
    ``metadata`` (plain values; ``path`` is the corpus uri, ``preview`` a frame of the first rows)."""

    result: CorpusResult
    built: StableCorpus
    uri: str
    metadata: dict[str, Any]

    def summary_line(self, partition_size: int) -> str:
        """One log line: prompts, files, duplicates, rejected, partitions and the edits of this build."""
        result, built = self.result, self.built
        return (
            f"{built.corpus.height} prompts from {len(result.files)} files "
            f"({built.corpus['conversation_id'].n_unique()} conversations); "
            f"{sum(result.duplicates_per_source.values())} duplicates; {result.rejected.height} rejected; "
            f"{len(built.keys)} partitions of up to {partition_size}; against the last build: {built.edits.new} new, "
            f"{built.edits.changed} changed, {built.edits.removed} removed prompts"
        )


def build_corpus_stage(
    store,
    sources: list[str],
    storage_options: Callable[[str], dict],
    limits: ReadLimits,
    partition_size: int,
    max_prompts: int | None,
    lock_wait_s: float = 900,
    log: Callable[[str], None] | None = None,
    turns: str = DEFAULT_TURNS,
) -> CorpusBuild:
    """Build the corpus of ``sources`` and write it (a row group per partition), then the index table and the
    rejected rows. ``turns``: which assistant turns become rows (:func:`~dflash_assets.data.shapes.build_corpus`).
    A prompt keeps its index while its content is unchanged (:func:`stable_corpus`). From
    reading the last build to writing the index table the build holds ``prompt_corpus/.build.lock``
    (:class:`StoreLock`, exclusive across hosts on one root), waiting up to ``lock_wait_s`` seconds for it (``log``
    gets who holds it and until when; default: the lock module's logger); a holder killed on this machine
    (:func:`~dflash_assets.generation.processes.machine.process_gone`) is taken over at once.

    Raises:
        CorpusStageError: a source cannot be read (rejected rows, if any, written to ``rejected.parquet``
            first and named), the stable indexes cannot be assigned, or another build held the lock
            past ``lock_wait_s`` (naming the lock object and the fix).
    """
    try:
        result = build_corpus(sources, storage_options, limits, turns=turns)
    except CorpusError as exc:
        if exc.rejected is None:
            raise CorpusStageError(str(exc)) from None
        uri = store.write_parquet(exc.rejected, *REJECTED_FILE)  # the rows set aside, with reasons, for the user
        raise CorpusStageError(
            f"{exc} Rejected rows with reasons: {uri}", metadata={"rejected": exc.rejected.height}
        ) from None
    # one build at a time on this storage root, across hosts: the indices are assigned from the last build,
    # so a second build must read only once the first has written its three files
    try:
        lock = StoreLock(
            store, LOCK_FILE, wait_s=lock_wait_s, holder=process_record(), holder_gone=process_gone, log=log
        )
        with lock:
            previous = (
                store.read_parquet(*CORPUS_FILE, columns=["index", "content_hash", "prompt_id"])
                if store.exists(*CORPUS_FILE)
                else None
            )
            try:
                built = stable_corpus(store, result.corpus, partition_size, max_prompts, previous)
            except ValueError as exc:
                raise CorpusStageError(str(exc)) from None
            corpus = built.corpus
            # a row group per partition: a partition's run reads its own prompts, not the whole corpus
            corpus_uri = store.write_parquet(corpus, *CORPUS_FILE, row_group_size=partition_size)
            save_index(store, built.table)  # after the corpus: a failed write leaves the last build whole
            store.write_parquet(result.rejected, *REJECTED_FILE)
    except LockBusyError as exc:
        raise CorpusStageError(str(exc)) from None
    return CorpusBuild(result, built, corpus_uri, _metadata(result, built, corpus_uri, partition_size))


def _metadata(result: CorpusResult, built: StableCorpus, uri: str, partition_size: int) -> dict[str, Any]:
    corpus = built.corpus
    head = corpus.head(10)
    last = head["messages"].list.last()
    preview = head.select(
        "index",
        "prompt_id",
        "source",
        "turn",
        "turn_kind",
        last_message=last.struct.field("role") + ": " + last.struct.field("content").fill_null("").str.slice(0, 120),
    )
    rows_per_source = corpus.group_by("source").len().sort("source")
    kinds = dict(corpus.group_by("turn_kind").len().iter_rows())
    # a conversation uses tools when it offers them, or a row's context holds a call or a result
    tool_use = (
        pl.col("tools").is_not_null()
        | pl.col("messages")
        .list.eval(
            (pl.element().struct.field("role") == "tool") | pl.element().struct.field("tool_calls").is_not_null()
        )
        .list.any()
    )
    tool_conversations = corpus.filter(tool_use)["conversation_id"].n_unique() if corpus.height else 0
    return {
        "num_prompts": corpus.height,  # rows: one per (conversation, assistant turn) with turns: every
        "rows_per_source": {r["source"]: r["len"] for r in rows_per_source.iter_rows(named=True)},
        "rows_per_turn_kind": {kind: kinds.get(kind, 0) for kind in TURN_KINDS},
        "conversations": corpus["conversation_id"].n_unique(),
        "tool_conversations": tool_conversations,
        "duplicates": sum(result.duplicates_per_source.values()),
        "duplicates_per_source": result.duplicates_per_source,
        "rejected": result.rejected.height,
        "rejected_by_reason": result.rejected_by_reason,
        "num_partitions": len(built.keys),
        # what this build changed (stable indices: only new or changed prompts need requests)
        "prompts_new": built.edits.new,
        "prompts_changed": built.edits.changed,
        "prompts_removed": built.edits.removed,
        "prompts_kept": built.edits.kept,
        "max_index": int(corpus["index"].max()) if corpus.height else -1,
        # per partition, the hash of its (index, content_hash) pairs: completions records the one it was made for
        "partition_versions": built.versions,
        "partition_prompts": built.sizes,  # a range may have gaps (removed prompts): its prompt count
        "partition_size": partition_size,
        "files": result.files,
        "path": uri,
        "preview": preview,  # the first rows (a frame: the asset shows it as a table)
    }


def rejected_preview(rejected: pl.DataFrame, limit: int = 20) -> list[str]:
    """Log lines for the first ``limit`` rejected rows: file, line and reason."""
    return [f"rejected {r['file']}:{r['line']}: {r['reason']}" for r in rejected.head(limit).iter_rows(named=True)]
