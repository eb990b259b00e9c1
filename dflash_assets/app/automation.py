"""Schedules and sensors: backfill unfinished partitions, and re-run only what a settings change touches.

Both request *ranges* of completions partitions, one run each (the asset has a single-run backfill
policy: a range starts the inference servers once and streams requests across its partitions), with
run keys (Dagster requires one on every request when a tick returns several). One tick costs a
bounded number of instance queries however many partitions exist: the partition keys, one partition
status read per stage, the latest materialization of every partition in two queries
(:func:`latest_records`), and one run query for failed attempts (:func:`failed_attempts_by_partition`).
"""

import hashlib
import os
from collections.abc import Iterable, Sequence

import dagster as dg

# private module: dagster 1.13 exports no public name for these run tags
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    MAX_RETRIES_TAG,
    PARTITION_NAME_TAG,
)

# private module: dagster 1.13 exports no public cron validator (the check its schedules apply)
from dagster._utils.schedules import is_valid_cron_string

from dflash_assets.app.stage_order import PARTITION_STAGES
from dflash_assets.common.config import completions_mode
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.orchestration import check_gate, freshness
from dflash_assets.orchestration.freshness import settings_reason
from dflash_assets.orchestration.history import latest_records
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.orchestration.pools import GPU_POOL, INFERENCE_POOL, pool_usage
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.target_model import TargetModelResource

COMPLETIONS = dg.AssetKey("completions")

#: Environment variable: the backfill schedule's cron (5 fields, the daemon's time zone), read when the definitions
#: load; unset or empty: :data:`DEFAULT_BACKFILL_CRON`.
BACKFILL_CRON_ENV = "DFLASH_BACKFILL_CRON"
DEFAULT_BACKFILL_CRON = "*/10 * * * *"


def backfill_cron() -> str:
    """The backfill schedule's cron string: :data:`BACKFILL_CRON_ENV`, or :data:`DEFAULT_BACKFILL_CRON`.

    Raises:
        ValueError: the variable holds no valid cron string (naming the variable, its value and the form).
    """
    raw = os.environ.get(BACKFILL_CRON_ENV, "").strip()
    if not raw:
        return DEFAULT_BACKFILL_CRON
    if not is_valid_cron_string(raw):
        raise ValueError(
            f"{BACKFILL_CRON_ENV}={raw!r} is not a valid cron string: 5 fields, minute (0-59) hour (0-23) "
            f"day (1-31) month (1-12) weekday (0-6), e.g. '*/10 * * * *' (the default); or unset it"
        )
    return raw


def partition_job_selection(available: Iterable[str]) -> list[str]:
    """The per-partition stages that exist in these definitions, upstream first."""
    names = set(available)
    return [s for s in PARTITION_STAGES if s in names]


def affected_reason(meta: dict, settings: GenerationSettings) -> str | None:
    """Why the generation ``settings`` touch a completions partition (its latest metadata): the settings
    part of the freshness rule, :func:`dflash_assets.orchestration.freshness.settings_reason`."""
    return settings_reason(meta, settings)


def affected_partitions(
    instance: dg.DagsterInstance, settings: GenerationSettings, records: dict[str, dg.EventLogRecord] | None = None
) -> dict[str, str]:
    """``{partition_key: reason}`` for materialized completions partitions that are not up to date
    (:func:`dflash_assets.orchestration.freshness.completions_reasons`: the settings touch them, or the corpus's prompts
    of their range changed), in key order."""
    if records is None:
        records = latest_records(
            instance, COMPLETIONS.to_user_string(), instance.get_dynamic_partitions(prompt_ranges.name)
        )
    reasons = freshness.completions_reasons(instance, sorted(records), settings, records, mode=completions_mode())
    return {pk: reason for pk, reason in reasons.items() if reason}


def partition_statuses(
    instance: dg.DagsterInstance, asset_key: dg.AssetKey, keys: Sequence[str]
) -> dict[str, dg.AssetPartitionStatus | None]:
    """Dagster's status of each partition (None: never attempted), from its partition status cache."""
    status = instance.get_status_by_partition(asset_key, list(keys), prompt_ranges) or {}
    return {pk: status.get(pk) for pk in keys}


def run_partitions(run: dg.DagsterRun, position: dict[str, int], keys: Sequence[str]) -> list[str]:
    """Partition keys a run covered: its ``dagster/partition`` tag, or every key of its partition range."""
    tags = run.tags
    if PARTITION_NAME_TAG in tags:
        return [tags[PARTITION_NAME_TAG]]
    start, end = tags.get(ASSET_PARTITION_RANGE_START_TAG), tags.get(ASSET_PARTITION_RANGE_END_TAG)
    if start in position and end in position:
        return list(keys[position[start] : position[end] + 1])
    return []


def failed_attempts_by_partition(
    instance: dg.DagsterInstance, keys: Sequence[str], records: dict[str, dg.EventLogRecord]
) -> dict[str, int]:
    """Failed runs covering each partition since its latest materialization (``records``; all, if never).

    One run query (every failed run carrying a partition or partition-range tag); a failed range run
    counts for each partition of its range.
    """
    position = {pk: i for i, pk in enumerate(keys)}
    since = {pk: records[pk].timestamp if pk in records else 0.0 for pk in keys}
    counts = dict.fromkeys(keys, 0)
    for record in instance.get_run_records(dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE])):
        ended = record.end_time or record.create_timestamp.timestamp()
        for pk in run_partitions(record.dagster_run, position, keys):
            if pk in counts and ended > since[pk]:
                counts[pk] += 1
    return counts


def failed_attempts(instance: dg.DagsterInstance, asset_key: dg.AssetKey, pk: str) -> int:
    """Failed runs of partition ``pk`` since ``asset_key``'s last materialization of it (all, if never)."""
    keys = instance.get_dynamic_partitions(prompt_ranges.name)
    return failed_attempts_by_partition(instance, keys, latest_records(instance, asset_key.to_user_string(), [pk]))[pk]


def contiguous_ranges(
    keys: Sequence[str],
    wanted: set[str],
    barriers: set[str],
    max_partitions: int | None = None,
    fill: set[str] | None = None,
    max_gap: int | None = None,
) -> list[list[str]]:
    """Ranges (lists of consecutive ``keys``) holding every key of ``wanted`` and none of ``barriers``.

    A range starts and ends at a wanted key. Between two wanted keys it may hold other keys (``fill``;
    None: any key not a barrier), at most ``max_gap`` in a row (None: any number), so a few finished
    partitions between unfinished ones cost one run and one server start, not one each (the asset
    requests only rows invalid under the settings, so a finished partition inside a range is only read).
    A range holds at most ``max_partitions`` keys.
    """
    ranges, current, gap = [], [], []
    for pk in keys:
        if pk in wanted:
            if current and max_partitions and len(current) + len(gap) + 1 > max_partitions:
                ranges.append(current)
                current = []
            current += gap if current else []
            current.append(pk)
            gap = []
        elif (
            current and pk not in barriers and (fill is None or pk in fill) and (max_gap is None or len(gap) < max_gap)
        ):
            gap.append(pk)
        else:
            if current:
                ranges.append(current)
            current, gap = [], []
    if current:
        ranges.append(current)
    return ranges


def request_partitions(request: dg.RunRequest, keys: Sequence[str]) -> list[str]:
    """The partition keys a RunRequest covers: its partition key, or every key of its partition range."""
    if request.partition_key:
        return [request.partition_key]
    position = {pk: i for i, pk in enumerate(keys)}
    start, end = request.tags.get(ASSET_PARTITION_RANGE_START_TAG), request.tags.get(ASSET_PARTITION_RANGE_END_TAG)
    return list(keys[position[start] : position[end] + 1]) if start in position and end in position else []


def range_request(pks: Sequence[str], run_key: str, tags: dict[str, str]) -> dg.RunRequest:
    """One run of the completions asset over partitions ``pks[0]...pks[-1]`` (single-run backfill)."""
    return dg.RunRequest(
        run_key=run_key,
        asset_selection=[COMPLETIONS],
        tags={
            **tags,
            ASSET_PARTITION_RANGE_START_TAG: pks[0],
            ASSET_PARTITION_RANGE_END_TAG: pks[-1],
            "dflash/partitions": str(len(pks)),
        },
    )


def downstream_requests(
    instance: dg.DagsterInstance,
    keys: Sequence[str],
    available: Iterable[str],
    completions_status: dict,
    completions_records: dict,
    limit: int,
) -> tuple[list[dg.RunRequest], int, dict[str, str]]:
    """Per-partition runs of the stages after completions (tokenized_sequences, hidden_states) where
    completions is materialized and a later stage is missing or older than its upstream (not failed or
    in progress: a failed stage waits for a human). A partition whose stage failed a blocking check, or has no
    evaluation of one (it raised; :mod:`dflash_assets.orchestration.check_gate`) waits too, and nothing after that
    stage is requested for it. Two
    queries per stage and one check-history read per blocking check. Returns (requests, candidates,
    ``{pk: "failed check <asset>.<check>"}`` of the partitions held by a failed check)."""
    stages = [s for s in partition_job_selection(available) if s != "completions"]
    upstream_ids = {pk: r.storage_id for pk, r in completions_records.items()}
    todo: dict[str, str] = {}  # pk -> first stage to run
    held: dict[str, str] = {}  # pk -> the failed check that holds it
    for stage in stages:
        key = dg.AssetKey(stage)
        status = partition_statuses(instance, key, keys)
        ids = instance.event_log_storage.get_latest_storage_id_by_partition(
            key, dg.DagsterEventType.ASSET_MATERIALIZATION
        )
        for pk in keys:
            if pk in todo or completions_status[pk] != dg.AssetPartitionStatus.MATERIALIZED or pk not in upstream_ids:
                continue
            if status[pk] in (dg.AssetPartitionStatus.FAILED, dg.AssetPartitionStatus.IN_PROGRESS):
                continue
            if freshness.after_upstream_reason(ids.get(pk), [upstream_ids[pk]]) is not None:
                todo[pk] = stage
        current = {pk: ids[pk] for pk in keys if pk in ids and pk not in todo and pk not in held}
        for pk, hold in check_gate.failed_blocking_checks(instance, stage, current).items():
            held[pk] = hold.reason(stage)
        upstream_ids = {pk: i for pk, i in current.items() if pk not in held}
    requests = [
        dg.RunRequest(
            partition_key=pk,
            run_key=f"{pk}:{'+'.join(stages[stages.index(first) :])}:{completions_records[pk].storage_id}",
            asset_selection=[dg.AssetKey(s) for s in stages[stages.index(first) :]],
            tags={"dflash/trigger": "backfill"},
        )
        for pk, first in sorted(todo.items())
    ][:limit]
    return requests, len(todo), held


def _spread_over_nodes(
    instance: dg.DagsterInstance, wanted: int, runs: int, per_run: int | None, downstream_limit: int
) -> tuple[int, int | None, int]:
    """``(runs, partitions per run, later-stage runs)`` of a tick over several nodes: the ``wanted`` unfinished
    partitions cut into one range per ``dflash_inference`` slot (one per node's servers), all in this tick; the
    later stages up to ``downstream_limit`` per ``dflash_gpu`` slot."""
    slots = pool_usage(instance, [INFERENCE_POOL, GPU_POOL])
    if wanted:
        nodes = max(1, slots.get(INFERENCE_POOL, {}).get("limit") or 1)
        share = -(-wanted // nodes)  # ceil: every unfinished partition in this tick's `nodes` runs
        runs, per_run = max(runs, nodes), min(per_run or share, share)
    return runs, per_run, downstream_limit * max(1, slots.get(GPU_POOL, {}).get("limit") or 1)


def _range_run_key(records: dict, pks: list[str]) -> str:
    """A range run's key: the range and its newest completions materialization (storage id; 0 without one), so a
    tick evaluated twice launches nothing twice."""
    newest = max((records[pk].storage_id for pk in pks if pk in records), default=0)
    return f"completions:{pks[0]}...{pks[-1]}:{newest}"


def build_backfill_schedule(
    job,
    cron: str | None = None,
    max_runs_per_tick: int = 1,
    max_partitions_per_run: int | None = None,
    max_failed_attempts: int = 3,
    max_downstream_per_tick: int = 4,
    max_finished_gap: int = 16,
    spread_over_nodes: bool = False,
):
    """Every tick: request the missing or failed completions partitions as ranges, one run each (servers
    started once per range), and the later per-partition stages of partitions whose completions are done.

    ``cron``: None reads :func:`backfill_cron` (``$DFLASH_BACKFILL_CRON``, default every 10 minutes).

    ``spread_over_nodes`` (several nodes, Dagster's Celery executor: docs/scale.md): a range run is one step on one
    node, so the unfinished partitions are cut into as many ranges as the ``dflash_inference`` pool has slots (one
    per node's servers), all requested in one tick (at least ``max_runs_per_tick``), one per node. Those range runs
    carry ``dagster/max_retries: 0``: when one fails (its node lost) the next tick cuts its unfinished partitions
    over the nodes again, where a run retry would put the whole rest of the range on one node. The later stages
    are requested up to ``max_downstream_per_tick`` per ``dflash_gpu`` slot (one per node's GPUs), one run per
    partition; each step of such a run goes to whichever node's worker is free.

    Ranges are cut at partitions in progress (another run has them) and at partitions given up after
    ``max_failed_attempts`` failed runs since their last success (one that fails every time, e.g. on a
    bad row, would otherwise take the servers every tick; the tick log names them, and a run launched by
    hand that succeeds resets the count). At most ``max_runs_per_tick`` range runs of at most
    ``max_partitions_per_run`` partitions each (None: no limit); up to ``max_finished_gap`` finished
    partitions in a row between unfinished ones stay inside a range (read, not regenerated: cheaper
    than another server start). Run keys name the range and the
    latest completions materialization in it, so a tick evaluated twice launches nothing twice.
    Runs wait for the ``dflash_inference`` pool (dagster.yaml) like any other.

    Raises:
        ValueError: ``cron`` is None and ``$DFLASH_BACKFILL_CRON`` holds no valid cron string.
    """
    cron = backfill_cron() if cron is None else cron

    @dg.schedule(
        job=job,
        cron_schedule=cron,
        name="backfill_unfinished_partitions",
        default_status=dg.DefaultScheduleStatus.STOPPED,
        description=(
            f"Requests the missing or failed partitions of completions as ranges, one run each (at most "
            f"{max_runs_per_tick} per tick), and the later stages of finished partitions; skips in-progress "
            f"ones and those that failed {max_failed_attempts} times since their last success."
        ),
    )
    def backfill_unfinished_partitions(context: dg.ScheduleEvaluationContext):
        instance = context.instance
        keys = instance.get_dynamic_partitions(prompt_ranges.name)
        status = partition_statuses(instance, COMPLETIONS, keys)
        records = latest_records(instance, COMPLETIONS.to_user_string(), keys)
        to_request = [pk for pk in keys if status[pk] in (None, dg.AssetPartitionStatus.FAILED)]
        running = {pk for pk in keys if status[pk] == dg.AssetPartitionStatus.IN_PROGRESS}
        attempts = failed_attempts_by_partition(instance, keys, records) if to_request else {}
        given_up = [pk for pk in to_request if attempts[pk] >= max_failed_attempts]
        if given_up:
            context.log.warning(
                f"not retrying {len(given_up)} partitions that failed {max_failed_attempts} times "
                "since their last success: "
                f"{given_up[:10]}; read their run logs, fix the cause and launch them by hand"
            )
        wanted = set(to_request) - set(given_up)
        runs, per_run = max_runs_per_tick, max_partitions_per_run
        downstream_limit, range_tags = max_downstream_per_tick, {"dflash/trigger": "backfill"}
        if spread_over_nodes:
            runs, per_run, downstream_limit = _spread_over_nodes(instance, len(wanted), runs, per_run, downstream_limit)
            range_tags[MAX_RETRIES_TAG] = "0"  # this schedule re-cuts a failed range over the nodes instead
        ranges = contiguous_ranges(keys, wanted, running | set(given_up), per_run, max_gap=max_finished_gap)[:runs]
        requests = [range_request(pks, _range_run_key(records, pks), range_tags) for pks in ranges]
        names = (
            {k.to_user_string() for k in job.selection.resolve(context.repository_def.asset_graph)}
            if context.repository_def
            else set(PARTITION_STAGES)
        )
        downstream, waiting, held = downstream_requests(instance, keys, names, status, records, downstream_limit)
        if held:
            context.log.warning(check_gate.held_message(held))
        requests += downstream
        if not requests:
            return dg.SkipReason(
                f"nothing unfinished to retry ({len(running)} in progress, {len(given_up)} given up"
                + (f"; {check_gate.held_message(held)}" if held else "")
                + ")"
            )
        context.log.info(
            f"{len(wanted)} unfinished completions partitions: requesting {len(ranges)} range run(s) "
            f"{[f'{r[0]}...{r[-1]} ({len(r)})' for r in ranges]}; {waiting} partitions wait for later stages, "
            f"{len(downstream)} requested"
        )
        return requests

    return backfill_unfinished_partitions


def build_cap_change_sensor(job, max_runs_per_tick: int = 10, max_partitions_per_run: int | None = None):
    """A sensor that launches exactly the completions partitions the current generation settings touch,
    as ranges of consecutive touched partitions, one run (and one server start) each. A range may run
    through partitions not materialized yet (they need generating anyway), never through a valid one.
    The later stages follow through the backfill schedule (their upstream is newer). At most
    ``max_runs_per_tick`` range runs per tick (they queue for the ``dflash_inference`` pool).

    Stopped by default: "Preview" / "Test sensor" in the UI lists the ranges it would launch (with the
    reasons in each run's tags) before anything runs.

    The run key holds the cap, the sampling fingerprint and a digest of the storage ids of the range's
    latest completions materializations: Dagster makes one run per sensor run key for the sensor's whole
    life, so a key of (range, cap, sampling) alone would never launch again after the cap went
    10 -> 14 -> 10 -> 14. A run that fails leaves the key as it was (no relaunch loop); the backfill
    schedule retries failed partitions.
    """

    @dg.sensor(
        job=job,
        name="generation_settings_changed",
        minimum_interval_seconds=60,
        default_status=dg.DefaultSensorStatus.STOPPED,
        description=(
            "Launches only the completions partitions (as ranges, one run each) that the current cap, "
            "sampling settings or chat template touch."
        ),
    )
    def generation_settings_changed(
        context: dg.SensorEvaluationContext, generation: GenerationResource, target_model: TargetModelResource
    ):
        settings = generation.settings().with_template(target_model.chat_template_text())  # the servers' template
        instance = context.instance
        keys = instance.get_dynamic_partitions(prompt_ranges.name)
        records = latest_records(instance, COMPLETIONS.to_user_string(), keys)
        affected = affected_partitions(instance, settings, records)
        status = partition_statuses(instance, COMPLETIONS, keys) if affected else {}
        running = {pk for pk in keys if status.get(pk) == dg.AssetPartitionStatus.IN_PROGRESS}
        unmaterialized = {
            pk for pk in keys if pk not in records and status.get(pk) != dg.AssetPartitionStatus.IN_PROGRESS
        }
        ranges = contiguous_ranges(keys, set(affected) - running, running, max_partitions_per_run, fill=unmaterialized)[
            :max_runs_per_tick
        ]
        requests = []
        for pks in ranges:
            touched = [pk for pk in pks if pk in affected]
            digest = hashlib.sha256(",".join(f"{pk}={records[pk].storage_id}" for pk in touched).encode()).hexdigest()[
                :16
            ]
            reasons = sorted({affected[pk] for pk in touched})
            requests.append(
                range_request(
                    pks,
                    f"{pks[0]}...{pks[-1]}:{settings.max_output_tokens}:{settings.sampling_fingerprint()}:{digest}",
                    {
                        "dflash/trigger": "settings-change",
                        "dflash/reason": ", ".join(reasons),
                        "dflash/touched_partitions": str(len(touched)),
                    },
                )
            )
        held = check_gate.held_partitions(instance, keys)
        if held:  # a new completions table makes such a stage stale: the backfill schedule then redoes it
            context.log.warning(check_gate.held_message(held))
        if not requests:
            return dg.SkipReason(
                f"no partition is touched by max_output_tokens={settings.max_output_tokens}"
                + (f" ({len(running)} in progress)" if running else "")
                + (f"; {check_gate.held_message(held)}" if held else "")
            )
        return requests

    return generation_settings_changed
