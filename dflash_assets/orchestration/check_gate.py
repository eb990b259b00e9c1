"""Blocking asset checks as a gate: a partition whose latest materialization failed one is not up to date.

``tokenized_sequences`` and ``hidden_states`` record their materialization *before* their checks run (the
checks read what was written), so a materialization record alone says nothing about whether the rows passed.
Dagster skips the later stages only in the run where the check fails; without this gate the next run would
see the stage as up to date and extract or train on the rows that failed. :mod:`dflash_assets.orchestration.freshness`
asks here, so the main job, ``status``, the schedule and the sensor all refuse them.

The check names live here (the assets import them) because freshness is imported by the assets: a lookup
through the asset definitions would be an import cycle. ``test_check_gate`` holds this table equal to the
assets' ``blocking=True`` specs.

No write; instance reads only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import dagster as dg

# private module: dagster 1.13 exports no public AssetCheckExecutionRecordStatus
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus

# tokenized_sequences
CHECK_NONEMPTY = "no_empty_loss_mask"
CHECK_DEGENERATE = "no_degenerate_mask_length_mode"
CHECK_ROUNDTRIP = "completion_decodes_to_recorded_text"
# hidden_states
CHECK_IDS = "stored_input_ids_match_tokenized"
CHECK_FINITE = "hidden_states_finite"

#: asset -> its checks that block everything downstream of it (ERROR severity, ``blocking=True``)
BLOCKING_CHECKS: dict[str, tuple[str, ...]] = {
    "tokenized_sequences": (CHECK_NONEMPTY, CHECK_DEGENERATE, CHECK_ROUNDTRIP),
    "hidden_states": (CHECK_IDS, CHECK_FINITE),
}

_PAGE = 1000
_DONE = {AssetCheckExecutionRecordStatus.SUCCEEDED, AssetCheckExecutionRecordStatus.FAILED}


def failed_blocking_checks(
    instance: dg.DagsterInstance, asset: str, records: Mapping[str, dg.EventLogRecord | int]
) -> dict[str, list[str]]:
    """``{partition key: [check name, ...]}`` for the partitions whose latest materialization (``records``:
    pk -> its latest materialization record or storage id) failed a blocking check of ``asset``.

    Only the latest evaluation of each check that targeted that very materialization counts: a failure of an
    older materialization is cleared by rematerializing, and a rematerialization that fails again counts
    again. A materialization no evaluation targeted (a step killed between the write and the checks) is not
    held. Cost: one paged history read per blocking check (newest first, stopping once every partition's
    latest materialization is found).
    """
    names = BLOCKING_CHECKS.get(asset, ())
    wanted = {(r if isinstance(r, int) else r.storage_id): pk for pk, r in records.items() if r is not None}
    failed: dict[str, list[str]] = {}
    if not names or not wanted:
        return failed
    for name in names:
        key = dg.AssetCheckKey(dg.AssetKey(asset), name)
        seen: set[int] = set()
        cursor = None
        while True:
            page = instance.event_log_storage.get_asset_check_execution_history(
                key, limit=_PAGE, cursor=cursor, status=_DONE
            )
            for record in page:
                event = record.event.dagster_event if record.event else None
                evaluation = event.event_specific_data if event else None
                target = getattr(evaluation, "target_materialization_data", None)
                storage_id = target.storage_id if target is not None else None
                if storage_id not in wanted or storage_id in seen:
                    continue  # an older materialization, or an older evaluation of this one
                seen.add(storage_id)
                if record.status == AssetCheckExecutionRecordStatus.FAILED:
                    failed.setdefault(wanted[storage_id], []).append(name)
            if len(page) < _PAGE or len(seen) == len(wanted):
                break
            cursor = page[-1].id
    return failed


def held_partitions(instance: dg.DagsterInstance, keys: Sequence[str]) -> dict[str, str]:
    """``{pk: "failed check <asset>.<check>"}`` for the partitions of ``keys`` whose latest materialization of
    a stage with blocking checks failed one (the first such stage, upstream first). One query per stage and
    one history read per blocking check."""
    held: dict[str, str] = {}
    for asset in BLOCKING_CHECKS:
        ids = instance.event_log_storage.get_latest_storage_id_by_partition(
            dg.AssetKey(asset), dg.DagsterEventType.ASSET_MATERIALIZATION, set(keys)
        )
        for pk, names in failed_blocking_checks(instance, asset, ids).items():
            held.setdefault(pk, check_reason(asset, names))
    return held


def held_message(held: dict[str, str], shown: int = 5) -> str:
    """One line naming the partitions a failed blocking check holds, with the check, and what to do."""
    items = ", ".join(f"{pk} ({why})" for pk, why in sorted(held.items())[:shown])
    more = f" (+{len(held) - shown} more)" if len(held) > shown else ""
    return (
        f"{len(held)} partitions wait on a failed blocking check, nothing after it runs on them: {items}{more}; "
        "fix the cause and materialize that stage again (it must pass)"
    )


def check_reason(asset: str, names: list[str] | None) -> str | None:
    """``"failed check tokenized_sequences.no_empty_loss_mask"`` (all names, comma-separated), None for none."""
    if not names:
        return None
    return "failed check " + ", ".join(f"{asset}.{n}" for n in names)
