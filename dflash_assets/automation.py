"""Schedules and sensors: backfill unfinished partitions, and re-run only what a settings change touches."""

from collections.abc import Iterable

import dagster as dg

from dflash_assets.partitions import prompt_ranges
from dflash_assets.resources.generation import GenerationResource
from dflash_assets.settings import GenerationSettings

COMPLETIONS = dg.AssetKey("completions")
PER_PARTITION_STAGES = ["completions", "tokenized_sequences", "hidden_states"]


def partition_job_selection(available: Iterable[str]) -> list[str]:
    """The per-partition stages that exist in these definitions, upstream first."""
    names = set(available)
    return [s for s in PER_PARTITION_STAGES if s in names]


def latest_record(instance: dg.DagsterInstance, asset_key: dg.AssetKey, pk: str) -> dg.EventLogRecord | None:
    """The latest materialization record of one partition, or None."""
    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=[pk]), limit=1).records
    return records[0] if records else None


def latest_metadata(instance: dg.DagsterInstance, asset_key: dg.AssetKey, pk: str) -> dict | None:
    """Metadata (plain values) of the latest materialization of one partition, or None."""
    record = latest_record(instance, asset_key, pk)
    if record is None:
        return None
    meta = record.asset_materialization.metadata
    return {k: getattr(v, "value", v) for k, v in meta.items()}


def affected_reason(meta: dict, settings: GenerationSettings) -> str | None:
    """Why a completions partition (described by its latest metadata) must be re-materialized under ``settings``.

    Mirrors :func:`dflash_assets.generation.records.invalid_reason` at partition level: raising the cap
    touches partitions with ``length`` rows cut at another cap, lowering it partitions holding a row
    longer than the new cap; error rows and changed sampling touch their partition too.
    """
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


def affected_partitions(instance: dg.DagsterInstance, settings: GenerationSettings) -> dict[str, str]:
    """``{partition_key: reason}`` for materialized completions partitions the settings touch."""
    out = {}
    for pk in instance.get_dynamic_partitions(prompt_ranges.name):
        meta = latest_metadata(instance, COMPLETIONS, pk)
        if meta is not None and (reason := affected_reason(meta, settings)):
            out[pk] = reason
    return out


def unfinished_partitions(instance: dg.DagsterInstance, asset_key: dg.AssetKey) -> tuple[list[str], list[str]]:
    """``(to_request, in_progress)``: partitions missing or failed, and those running now (skipped)."""
    keys = instance.get_dynamic_partitions(prompt_ranges.name)
    status = instance.get_status_by_partition(asset_key, keys, prompt_ranges) or {}
    to_request, running = [], []
    for pk in keys:
        s = status.get(pk)
        if s == dg.AssetPartitionStatus.IN_PROGRESS:
            running.append(pk)
        elif s in (None, dg.AssetPartitionStatus.FAILED):
            to_request.append(pk)
    return to_request, running


def failed_attempts(instance: dg.DagsterInstance, asset_key: dg.AssetKey, pk: str) -> int:
    """Failed runs of partition ``pk`` since ``asset_key``'s last materialization of it (all, if never)."""
    record = latest_record(instance, asset_key, pk)
    since = record.timestamp if record is not None else 0.0
    runs = instance.get_run_records(dg.RunsFilter(tags={"dagster/partition": pk}, statuses=[dg.DagsterRunStatus.FAILURE]))
    return sum(1 for r in runs if (r.end_time or r.create_timestamp.timestamp()) > since)


def build_backfill_schedule(job, cron: str = "*/10 * * * *", max_per_tick: int = 4, max_failed_attempts: int = 3):
    """Every tick: request runs for up to ``max_per_tick`` missing or failed completions partitions, skipping
    those in progress, and giving up on a partition after ``max_failed_attempts`` failed runs since its last
    success (a partition that fails every time, e.g. on a bad row, would otherwise take a slot every tick;
    the tick log names them, and a run launched by hand that succeeds resets the count). Run concurrency
    against the servers is capped by the ``dflash/inference`` tag limit in dagster.yaml."""

    @dg.schedule(job=job, cron_schedule=cron, name="backfill_unfinished_partitions", default_status=dg.DefaultScheduleStatus.STOPPED,
                 description=(f"Requests up to {max_per_tick} missing or failed partitions of {job.name} per tick; skips in-progress "
                              f"ones and those that failed {max_failed_attempts} times since their last success."))
    def backfill_unfinished_partitions(context: dg.ScheduleEvaluationContext):
        to_request, running = unfinished_partitions(context.instance, COMPLETIONS)
        given_up = [pk for pk in to_request if failed_attempts(context.instance, COMPLETIONS, pk) >= max_failed_attempts]
        if given_up:
            context.log.warning(
                f"not retrying {len(given_up)} partitions that failed {max_failed_attempts} times since their last success: "
                f"{given_up[:10]}; read their run logs, fix the cause and launch them by hand"
            )
        to_request = [pk for pk in to_request if pk not in given_up]
        if not to_request:
            return dg.SkipReason(f"nothing unfinished to retry ({len(running)} in progress, {len(given_up)} given up)")
        return [dg.RunRequest(partition_key=pk, tags={"dflash/trigger": "backfill"}) for pk in to_request[:max_per_tick]]

    return backfill_unfinished_partitions


def build_cap_change_sensor(job, max_per_tick: int = 50):
    """A sensor that launches exactly the completions partitions the current generation settings touch.

    Stopped by default: "Preview" / "Test sensor" in the UI lists the partitions it would launch (with the
    reason in each run's tags) before anything runs.

    The run key holds the storage id of the partition's latest completions materialization: Dagster makes
    one run per sensor run key for the sensor's whole life, so a key of (partition, cap, sampling) alone
    would never launch again after the cap went 10 -> 14 -> 10 -> 14. A run that fails leaves the key as
    it was (no relaunch loop); the backfill schedule retries failed partitions.
    """

    @dg.sensor(job=job, name="generation_settings_changed", minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.STOPPED,
               description="Launches only the completions partitions (and their downstream stages) that the current cap or sampling settings touch.")
    def generation_settings_changed(context: dg.SensorEvaluationContext, generation: GenerationResource):
        settings = generation.settings()
        affected = affected_partitions(context.instance, settings)
        _, running = unfinished_partitions(context.instance, COMPLETIONS)
        requests = [
            dg.RunRequest(
                partition_key=pk,
                run_key=f"{pk}:{settings.max_output_tokens}:{settings.sampling_fingerprint()}:"
                        f"{latest_record(context.instance, COMPLETIONS, pk).storage_id}",
                tags={"dflash/trigger": "settings-change", "dflash/reason": reason},
            )
            for pk, reason in sorted(affected.items()) if pk not in running
        ][:max_per_tick]
        if not requests:
            return dg.SkipReason(f"no partition is touched by max_output_tokens={settings.max_output_tokens}")
        return requests

    return generation_settings_changed
