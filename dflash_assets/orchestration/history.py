"""Reads of the Dagster instance's materialization history, in one place.

Every stage, ``status``, the summary, the schedule and the sensor read what the assets recorded (their
metadata, as plain values) through these functions, so each read is one query shape: the latest record of a
partition, or the latest record of every partition in two queries whatever their count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dagster as dg


def plain_metadata(record: dg.EventLogRecord | dg.EventLogEntry | None) -> dict[str, Any] | None:
    """Metadata of a materialization record (or event log entry) as plain values; None for none."""
    if record is None or record.asset_materialization is None:
        return None
    return {k: getattr(v, "value", v) for k, v in record.asset_materialization.metadata.items()}


def latest_record(instance: dg.DagsterInstance, asset: str, pk: str | None = None) -> dg.EventLogRecord | None:
    """The latest materialization of ``asset`` (of partition ``pk``, or of any), or None."""
    flt = dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[pk] if pk else None)
    records = instance.fetch_materializations(flt, limit=1).records
    return records[0] if records else None


def latest_metadata(instance: dg.DagsterInstance, asset: str, pk: str | None = None) -> dict[str, Any] | None:
    """Plain metadata of the latest materialization of ``asset`` (partition ``pk``), or None."""
    return plain_metadata(latest_record(instance, asset, pk))


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


def latest_metadata_by_partition(
    instance: dg.DagsterInstance, asset: str, keys: Sequence[str] | None = None
) -> dict[str, dict[str, Any]]:
    """``{partition_key: plain metadata}`` of the latest materialization of each partition (two queries)."""
    return {pk: plain_metadata(r) for pk, r in latest_records(instance, asset, keys).items()}
