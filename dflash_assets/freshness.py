"""The one rule for whether an (asset, partition) is up to date, and why not.

The main job (:mod:`dflash_assets.pipeline`), ``status``, the schedule and the sensor
(:mod:`dflash_assets.automation`) and the completions asset (whether a range run keeps a partition as it
is) all ask here. A reason is a short phrase (``None``: up to date):

================================  =====================================================================
asset                             not up to date when
================================  =====================================================================
``prompt_corpus``                 never built; the config or a prompt file (size, mtime / ETag) changed;
                                  built before stable indices (no ``partition_versions``)
``completions[pk]``               never built; the corpus's version of the partition's prompts (the hash
                                  of its ``(index, content_hash)`` pairs) is not the one the table was
                                  made for; rows the generation settings invalidate (error rows, other
                                  sampling, a cap their length rows or longest row does not fit)
``tokenized_sequences[pk]``,      never built, or older than the latest materialization of the stage
``hidden_states[pk]``             before it (which happens only when that stage's table changed)
``truncation_report``             older than a completions partition
``dflash_drafter``,               older than its upstream, or its op config changed since its last
``drafter_evaluation``            materialization (the drafter then decides by data content whether to
                                  train, resume or reuse)
================================  =====================================================================

Why not Dagster's own staleness (``CachingStaleStatusResolver``: code versions plus the data versions the
assets write): a completions partition depends on the generation *settings* (a resource, not a code
version) row by row, and on which prompts its range holds, which no data version of ``prompt_corpus``
(one unpartitioned table) can say per partition; and resolving it costs a walk of the asset graph per
partition (903 at the user's scale). The data versions the assets write still matter: a range run keeps
a partition whose table's hash is its latest data version (no new materialization, so the stages after
it stay up to date), and a table's change shows as a newer materialization.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dagster as dg

from dflash_assets.settings import GenerationSettings

NOT_MATERIALIZED = "not materialized"
PROMPTS_CHANGED = "prompts changed"
PROMPTS_UNVERSIONED = "made before rows named their prompt"


def plain(record: dg.EventLogRecord | None) -> dict[str, Any] | None:
    """Metadata of a materialization record as plain values (None for no record)."""
    if record is None:
        return None
    return {k: getattr(v, "value", v) for k, v in record.asset_materialization.metadata.items()}


def latest_record(instance: dg.DagsterInstance, asset: str, pk: str | None = None) -> dg.EventLogRecord | None:
    """The latest materialization of ``asset`` (partition ``pk``), or None."""
    flt = dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[pk] if pk else None)
    records = instance.fetch_materializations(flt, limit=1).records
    return records[0] if records else None


def latest_records(
    instance: dg.DagsterInstance, asset: str, keys: Sequence[str] | None = None
) -> dict[str, dg.EventLogRecord]:
    """``{partition_key: record}`` of the latest materialization of each partition (of ``keys``, or all):
    two queries whatever the partition count (the latest storage id per partition, then those records)."""
    key = dg.AssetKey(asset)
    ids = instance.event_log_storage.get_latest_storage_id_by_partition(
        key, dg.DagsterEventType.ASSET_MATERIALIZATION, partitions=set(keys) if keys is not None else None
    )
    if not ids:
        return {}
    result = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, storage_ids=sorted(ids.values())), limit=len(ids)
    )
    return {r.asset_materialization.partition: r for r in result.records if r.asset_materialization is not None}


# ------------------------------------------------------------------------------------------ pure rules


def corpus_reason(meta: dict | None, fingerprint: str) -> str | None:
    """Why ``prompt_corpus`` (its latest metadata) must be built again for the config ``fingerprint``."""
    if meta is None:
        return NOT_MATERIALIZED
    if meta.get("config_fingerprint") != fingerprint:
        return "the corpus config or a prompt file changed"
    if "partition_versions" not in meta:
        return "built before stable prompt indices"
    return None


def settings_reason(meta: dict, settings: GenerationSettings) -> str | None:
    """Why the generation ``settings`` invalidate rows of a completions partition (its latest metadata).

    Mirrors :func:`dflash_assets.generation.records.invalid_reason` at partition level: raising the cap
    touches partitions with ``length`` rows cut at another cap, lowering it partitions holding a row
    longer than the new cap; error rows and changed sampling touch their partition too."""
    cap = settings.max_output_tokens
    if meta.get("errors", 0):
        return "error rows"
    if meta.get("completion_tokens_missing", 0):
        return "no completion_tokens"
    if set(meta.get("finish_reasons", {})) - {"stop", "length"}:  # abort etc.: invalid_reason redoes them
        return "unfinished rows"
    if any(fp != settings.sampling_fingerprint() for fp in meta.get("settings_fingerprints", [])):
        return "sampling changed"
    if meta.get("completion_tokens_max", 0) > cap:
        return "cap lowered"
    if any(c != cap for c in meta.get("length_row_caps", [])):
        return "cap raised"
    return None


def prompts_reason(meta: dict, corpus_version: str | None) -> str | None:
    """Why a completions partition's table does not answer the corpus's prompts of its range: its recorded
    ``prompts_version`` is not ``corpus_version`` (None: a corpus built before versions; not checked)."""
    if corpus_version is None:
        return None
    made_for = meta.get("prompts_version")
    if made_for == corpus_version:
        return None
    return PROMPTS_CHANGED if made_for else PROMPTS_UNVERSIONED


def completions_reason(
    meta: dict | None, settings: GenerationSettings | None, corpus_version: str | None
) -> str | None:
    """Why ``completions[pk]`` (its latest metadata, None when never materialized) is not up to date."""
    if meta is None:
        return NOT_MATERIALIZED
    return prompts_reason(meta, corpus_version) or (settings_reason(meta, settings) if settings is not None else None)


def _storage_id(record: dg.EventLogRecord | int) -> int:
    return record if isinstance(record, int) else record.storage_id


def after_upstream_reason(
    record: dg.EventLogRecord | int | None,
    upstream: Sequence[dg.EventLogRecord | int | None],
    upstream_name: str = "upstream",
) -> str | None:
    """Why a stage built from ``upstream`` is not up to date: never materialized, or an upstream materialization
    is newer. Records or their storage ids."""
    if record is None:
        return NOT_MATERIALIZED
    if any(u is not None and _storage_id(u) > _storage_id(record) for u in upstream):
        return f"{upstream_name} changed since"
    return None


# ------------------------------------------------------------------------------------ instance queries


def corpus_versions(instance: dg.DagsterInstance) -> dict[str, str] | None:
    """``{partition key: version}`` of the latest corpus build (None: none, or one built before versions)."""
    meta = plain(latest_record(instance, "prompt_corpus"))
    return (meta or {}).get("partition_versions")


def completions_reasons(
    instance: dg.DagsterInstance,
    keys: Sequence[str],
    settings: GenerationSettings | None,
    records: dict[str, dg.EventLogRecord] | None = None,
    versions: dict[str, str] | bool | None = False,
) -> dict[str, str | None]:
    """``{pk: reason or None}`` for every key (three instance queries whatever the count).

    ``records``/``versions``: already-fetched latest completions records and corpus versions (``False``:
    fetch them)."""
    if records is None:
        records = latest_records(instance, "completions", keys)
    if versions is False:
        versions = corpus_versions(instance)
    return {
        pk: completions_reason(plain(records.get(pk)), settings, (versions or {}).get(pk) if versions else None)
        for pk in keys
    }


def partition_reason(
    instance: dg.DagsterInstance,
    stage: str,
    pk: str,
    settings: GenerationSettings | None = None,
    upstream: str | None = None,
) -> str | None:
    """Why ``stage[pk]`` is not up to date (``upstream``: the stage it is built from, for the later stages)."""
    if stage == "completions":
        versions = corpus_versions(instance)
        return completions_reason(
            plain(latest_record(instance, stage, pk)), settings, (versions or {}).get(pk) if versions else None
        )
    return after_upstream_reason(
        latest_record(instance, stage, pk),
        [latest_record(instance, upstream, pk)] if upstream else [],
        upstream or "upstream",
    )
