"""Stage 1: ``prompt_corpus``: prompt files -> one deduplicated, indexed table; registers partitions."""

import hashlib
import os
import time

import dagster as dg

from dflash_assets.data.shapes import expand_source
from dflash_assets.orchestration.metadata import table_preview
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.orchestration.pools import ensure_pool_limits
from dflash_assets.orchestration.runs import other_live_runs
from dflash_assets.stages.prompts import CORPUS_FILE as CORPUS_FILE  # re-exported: the asset's paths
from dflash_assets.stages.prompts import REJECTED_FILE as REJECTED_FILE
from dflash_assets.stages.prompts import CorpusStageError, PromptCorpusConfig, build_corpus_stage, rejected_preview
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.storage.stale_outputs import remove_stale_outputs

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
        "Reads the configured prompt files (OpenAI messages, ShareGPT conversations, with tools, tool calls and "
        "tool results; Alpaca, plain prompt), makes one row per assistant turn to regenerate (turns: every) or "
        "per record (turns: last), each the context before that turn, drops exact duplicates (counted), "
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
            log=context.log.warning,  # who holds the store lock while this build waits for it
            turns=config.turns,
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
