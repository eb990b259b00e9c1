"""Materializations reported by hand *with* their blocking checks' passing evaluations, as a real run leaves them.

A materialization of ``tokenized_sequences`` or ``hidden_states`` with no evaluation of a blocking check is held by
the gate (:mod:`dflash_assets.orchestration.check_gate`), so tests that stand in for those stages by reporting a
materialization report the evaluations too."""

from __future__ import annotations

import dagster as dg

# private module: dagster 1.13 exports no public name for the evaluation's target
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)

from dflash_assets.orchestration.check_gate import BLOCKING_CHECKS


def report_checked(
    instance: dg.DagsterInstance, asset: str, partition: str | None = None, metadata: dict | None = None
) -> None:
    """Report a materialization of ``asset`` (``partition``) and a passing evaluation of each blocking check."""
    key = dg.AssetKey(asset)
    instance.report_runless_asset_event(dg.AssetMaterialization(key, partition=partition, metadata=metadata or {}))
    record = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition] if partition else None), limit=1
    ).records[0]
    target = AssetCheckEvaluationTargetMaterializationData(
        storage_id=record.storage_id, run_id=record.run_id, timestamp=record.timestamp
    )
    for name in BLOCKING_CHECKS.get(asset, ()):
        instance.report_runless_asset_event(
            dg.AssetCheckEvaluation(asset_key=key, check_name=name, passed=True, target_materialization_data=target)
        )
