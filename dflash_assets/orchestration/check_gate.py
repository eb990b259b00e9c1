"""Blocking asset checks as a gate: a partition whose latest materialization failed one, or has no evaluation
of one, is not up to date.

``tokenized_sequences`` and ``hidden_states`` record their materialization *before* their checks run (the
checks read what was written), so a materialization record alone says nothing about whether the rows passed;
a check that raises (an unreadable shard) records no evaluation at all, so a missing one counts as failed.
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
from dataclasses import dataclass

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
_WHY_CHARS = 300


@dataclass(frozen=True)
class CheckHold:
    """Why a partition's latest materialization of a stage is held: the blocking checks that ``failed``, and
    those with no evaluation of it (``unevaluated``: the check raised, the step was killed before it, or the
    materialization was reported by hand), with ``why`` (the step's error, or what else the instance says)."""

    failed: tuple[str, ...] = ()
    unevaluated: tuple[str, ...] = ()
    why: str | None = None

    def __bool__(self) -> bool:
        return bool(self.failed or self.unevaluated)

    def reason(self, asset: str) -> str:
        """``failed check a.x, a.y (not evaluated: <why>)``."""
        parts = [f"{asset}.{n}" for n in self.failed]
        if self.unevaluated:
            parts.append(", ".join(f"{asset}.{n}" for n in self.unevaluated) + f" (not evaluated: {self.why})")
        return "failed check " + ", ".join(parts)


def failed_blocking_checks(
    instance: dg.DagsterInstance, asset: str, records: Mapping[str, dg.EventLogRecord | int]
) -> dict[str, CheckHold]:
    """``{partition key: CheckHold}`` for the partitions whose latest materialization (``records``: pk -> its
    latest materialization record or storage id) failed a blocking check of ``asset``, or has no evaluation of
    one: a check that raised records none, and Dagster records the materialization before its checks run, so a
    missing evaluation counts as failed (never as passed).

    Only the latest evaluation of each check that targeted that very materialization counts: a failure of an
    older materialization is cleared by rematerializing, and a rematerialization that fails again counts
    again. Cost: one paged history read per blocking check (newest first, stopping once every partition's
    latest materialization is found, else at the end of the history), and, only when some evaluation is
    missing, one read of those materializations, of their runs and of each such run's step failures.
    """
    names = BLOCKING_CHECKS.get(asset, ())
    wanted = {(r if isinstance(r, int) else r.storage_id): pk for pk, r in records.items() if r is not None}
    if not names or not wanted:
        return {}
    failed: dict[str, list[str]] = {}
    missing: dict[str, list[str]] = {}
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
        for storage_id in set(wanted) - seen:
            missing.setdefault(wanted[storage_id], []).append(name)
    whys = why_unevaluated(instance, asset, {i: pk for i, pk in wanted.items() if pk in missing})
    return {
        pk: CheckHold(tuple(failed.get(pk, ())), tuple(missing.get(pk, ())), whys.get(pk))
        for pk in {**failed, **missing}
    }


def why_unevaluated(instance: dg.DagsterInstance, asset: str, wanted: Mapping[int, str]) -> dict[str, str]:
    """``{pk: why}`` for materializations of ``asset`` (storage id -> pk) no check evaluated: the error the step
    that made it raised (``run 1a2b3c4d raised OSError: ...``, at most 300 characters), its run still in
    progress, or no run at all (reported by hand). One read of the materializations and of their runs, and
    one of each finished run's step failures."""
    if not wanted:
        return {}
    found = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), storage_ids=list(wanted)), limit=len(wanted)
    ).records
    by_id = {r.storage_id: r for r in found}
    run_ids = sorted({r.run_id for r in found if r.run_id})
    records = instance.get_run_records(dg.RunsFilter(run_ids=run_ids)) if run_ids else []
    runs = {r.dagster_run.run_id: r.dagster_run for r in records}
    out: dict[str, str] = {}
    for storage_id, pk in wanted.items():
        record = by_id.get(storage_id)
        run = runs.get(record.run_id) if record is not None and record.run_id else None
        if run is None:
            out[pk] = "materialization reported without a run, or its run was deleted: no check ran on it"
        elif not run.is_finished:
            out[pk] = f"run {run.run_id[:8]} is still running its checks"
        else:
            step = record.event_log_entry.step_key
            errors = [
                e.dagster_event.event_specific_data.error
                for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE)
                if e.dagster_event is not None and (step is None or e.step_key == step)
            ]
            error = errors[0] if errors else None
            while error is not None and error.cause is not None and error.cls_name.startswith("Dagster"):
                error = error.cause  # "Error occurred while executing op ...": the user code's error is its cause
            text = " ".join(error.message.split()) if error is not None else None
            out[pk] = (
                f"run {run.run_id[:8]} raised {text}"[:_WHY_CHARS]
                if text
                else f"run {run.run_id[:8]} ended ({run.status.value}) without evaluating it"
            )
    return out


def held_partitions(
    instance: dg.DagsterInstance, keys: Sequence[str], stages: Sequence[str] | None = None
) -> dict[str, str]:
    """``{pk: "failed check <asset>.<check>"}`` for the partitions of ``keys`` whose latest materialization of
    a stage with blocking checks (of ``stages``; None: every one) failed one or has no evaluation of one (the
    first such stage, upstream first). One query per stage and one history read per blocking check."""
    held: dict[str, str] = {}
    for asset in BLOCKING_CHECKS:
        if stages is not None and asset not in stages:
            continue
        ids = instance.event_log_storage.get_latest_storage_id_by_partition(
            dg.AssetKey(asset), dg.DagsterEventType.ASSET_MATERIALIZATION, set(keys)
        )
        for pk, hold in failed_blocking_checks(instance, asset, ids).items():
            held.setdefault(pk, hold.reason(asset))
    return held


def held_message(held: dict[str, str], shown: int = 5) -> str:
    """One line naming the partitions a failed blocking check holds, with the check, and what to do."""
    items = ", ".join(f"{pk} ({why})" for pk, why in sorted(held.items())[:shown])
    more = f" (+{len(held) - shown} more)" if len(held) > shown else ""
    return (
        f"{len(held)} partitions wait on a failed blocking check, nothing after it runs on them: {items}{more}; "
        "fix the cause and materialize that stage again (it must pass)"
    )


def check_reason(asset: str, hold: CheckHold | None) -> str | None:
    """``"failed check tokenized_sequences.no_empty_loss_mask"`` (see :meth:`CheckHold.reason`), None for none."""
    return hold.reason(asset) if hold else None
