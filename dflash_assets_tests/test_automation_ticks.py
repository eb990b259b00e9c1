"""The backfill schedule and the cap-change sensor ticked through Dagster's own daemon code
(``launch_scheduled_runs`` / ``execute_sensor_iteration``, with the definitions loaded in a real code
server process) and through ``evaluate_tick``, on a real instance with 1,000 partitions of which many
are unfinished: they request ranges of partitions, one run each, with run keys, and the runs are created.

States: most partitions materialized (runless materializations carrying the completions metadata the
sensor reads; some with ``length`` rows cut at 4,096), a third missing, one failed once, one failed three
times (given up), one with a run created but not launched (in progress).
"""

import datetime
import logging
import os
import tempfile
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    PARTITION_NAME_TAG,
    RUN_KEY_TAG,
)
from dagster._core.test_utils import create_test_daemon_workspace_context, load_remote_repo
from dagster._core.workspace.load_target import ModuleTarget

from dflash_assets.app.automation import request_partitions
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.ranges import partition_keys
from dflash_assets.orchestration.partitions import prompt_ranges

N = 1000
KEYS = partition_keys(N * 10, 10)
IN_PROGRESS = KEYS[500]
FAILED_ONCE = KEYS[100]
GIVEN_UP = KEYS[700]  # failed 3 times
MISSING = [pk for i, pk in enumerate(KEYS) if i % 3 == 1 and pk not in (IN_PROGRESS, FAILED_ONCE, GIVEN_UP)]
MATERIALIZED = [pk for pk in KEYS if pk not in set(MISSING) | {IN_PROGRESS, FAILED_ONCE, GIVEN_UP}]
CUT_AT_4096 = [pk for i, pk in enumerate(KEYS) if pk in set(MATERIALIZED) and (200 <= i < 450 or 600 <= i < 650)]
FINGERPRINT = GenerationSettings().sampling_fingerprint()
ROOT = Path(__file__).resolve().parent.parent


def expected_ranges(
    wanted: set[str], barriers: set[str], fill: set[str] | None = None, max_gap: int = 10**9
) -> list[tuple[str, str]]:
    """Independently: walk the wanted keys in order; one range goes on to the next wanted key when every
    key between them is allowed (no barrier, in ``fill`` if given) and there are at most ``max_gap``."""
    order = sorted(KEYS.index(pk) for pk in wanted)
    out = []
    for a, b in zip([None, *order], order):
        between = KEYS[a + 1 : b] if a is not None else None
        joined = (
            between is not None
            and len(between) <= max_gap
            and not set(between) & barriers
            and (fill is None or set(between) <= fill)
        )
        if joined:
            out[-1] = (out[-1][0], KEYS[b])
        else:
            out.append((KEYS[b], KEYS[b]))
    return out


@pytest.fixture(scope="module")
def instance():
    # a tmpfs keeps the 1,000 SQLite writes of the set-up fast; the instance is a real persistent one
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=base, prefix="dflash-ticks-") as home:
        overrides = {"run_coordinator": {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator"}}
        with dg.instance_for_test(temp_dir=home, overrides=overrides) as inst:
            from dflash_assets_tests import automation_defs

            inst.add_dynamic_partitions(prompt_ranges.name, KEYS)
            cut = set(CUT_AT_4096)
            for pk in MATERIALIZED:
                inst.report_runless_asset_event(
                    dg.AssetMaterialization(
                        "completions",
                        partition=pk,
                        metadata={
                            "rows": 10,
                            "errors": 0,
                            "finish_reasons": {"stop": 8, "length": 2} if pk in cut else {"stop": 10},
                            "length_row_caps": [4096] if pk in cut else [],
                            "settings_fingerprints": [FINGERPRINT],
                            "completion_tokens_max": 4096 if pk in cut else 900,
                            "completion_tokens_missing": 0,
                        },
                    )
                )

            @dg.asset(name="completions", partitions_def=prompt_ranges)
            def failing(context):
                raise dg.Failure(f"{context.partition_key}: server unreachable")

            for pk in [FAILED_ONCE] + [GIVEN_UP] * 3:
                assert not dg.materialize([failing], instance=inst, partition_key=pk, raise_on_error=False).success
            job = automation_defs.defs.resolve_job_def("partition_stages")
            inst.create_run_for_job(job, tags={PARTITION_NAME_TAG: IN_PROGRESS})  # planned, never launched
            yield inst


def _range(run_or_request) -> tuple[str, str]:
    return run_or_request.tags[ASSET_PARTITION_RANGE_START_TAG], run_or_request.tags[ASSET_PARTITION_RANGE_END_TAG]


def test_states_are_what_the_set_up_made(instance):
    status = instance.get_status_by_partition(dg.AssetKey("completions"), KEYS, prompt_ranges)
    assert status[IN_PROGRESS] == dg.AssetPartitionStatus.IN_PROGRESS
    assert status[FAILED_ONCE] == status[GIVEN_UP] == dg.AssetPartitionStatus.FAILED
    assert all(status.get(pk) is None for pk in MISSING) and len(MISSING) > 300
    assert all(status[pk] == dg.AssetPartitionStatus.MATERIALIZED for pk in MATERIALIZED)


def test_schedule_evaluate_tick_requests_ranges_with_run_keys(instance):
    from dflash_assets.app.automation import build_backfill_schedule
    from dflash_assets_tests import automation_defs

    repo = automation_defs.defs.get_repository_def()
    wanted, barriers = set(MISSING) | {FAILED_ONCE}, {IN_PROGRESS, GIVEN_UP}
    shipped = automation_defs.defs.get_schedule_def("backfill_unfinished_partitions")
    data = shipped.evaluate_tick(dg.build_schedule_context(instance=instance, repository_def=repo))
    ranges = [r for r in data.run_requests if ASSET_PARTITION_RANGE_START_TAG in r.tags]
    assert [_range(r) for r in ranges] == expected_ranges(wanted, barriers, max_gap=16)[:1]  # one range run per tick
    assert all(r.run_key for r in data.run_requests) and len({r.run_key for r in data.run_requests}) == len(
        data.run_requests
    )
    assert ranges[0].asset_selection == [dg.AssetKey("completions")]
    # the later stages of finished partitions, per partition, at most 4 per tick
    downstream = [r for r in data.run_requests if r not in ranges]
    assert [r.partition_key for r in downstream] == MATERIALIZED[:4]
    assert downstream[0].asset_selection == [dg.AssetKey("tokenized_sequences"), dg.AssetKey("hidden_states")]

    wide = build_backfill_schedule(automation_defs.partition_stages, max_runs_per_tick=10, max_downstream_per_tick=0)
    data = wide.evaluate_tick(dg.build_schedule_context(instance=instance, repository_def=repo))
    assert [_range(r) for r in data.run_requests] == expected_ranges(wanted, barriers, max_gap=16)
    # every unfinished partition not given up or in progress is inside exactly one requested range
    covered = [pk for r in data.run_requests for pk in KEYS[KEYS.index(_range(r)[0]) : KEYS.index(_range(r)[1]) + 1]]
    assert wanted <= set(covered) and len(covered) == len(set(covered)) and not barriers & set(covered)

    chunked = build_backfill_schedule(
        automation_defs.partition_stages, max_runs_per_tick=100, max_partitions_per_run=100, max_downstream_per_tick=0
    )
    data = chunked.evaluate_tick(dg.build_schedule_context(instance=instance, repository_def=repo))
    sizes = [KEYS.index(b) - KEYS.index(a) + 1 for a, b in map(_range, data.run_requests)]
    assert max(sizes) <= 100 and len(data.run_requests) > len(expected_ranges(wanted, barriers, max_gap=16))


def test_sensor_evaluate_tick_after_a_cap_raise(instance):
    from dflash_assets.app.automation import build_cap_change_sensor
    from dflash_assets.stages.resources.generation import GenerationResource
    from dflash_assets.stages.resources.target_model import TargetModelResource
    from dflash_assets_tests import automation_defs

    sensor = build_cap_change_sensor(automation_defs.partition_stages, max_runs_per_tick=10)
    ctx = dg.build_sensor_context(
        instance=instance,
        resources={"generation": GenerationResource(max_output_tokens=8192), "target_model": TargetModelResource()},
        repository_def=automation_defs.defs.get_repository_def(),
    )
    data = sensor.evaluate_tick(ctx)
    unmaterialized = set(MISSING)  # never materialized: generated along, inside a range
    assert [_range(r) for r in data.run_requests] == expected_ranges(
        set(CUT_AT_4096), {IN_PROGRESS}, fill=unmaterialized
    )
    assert len(data.run_requests) == 2
    touched = sum(int(r.tags["dflash/touched_partitions"]) for r in data.run_requests)
    assert touched == len(CUT_AT_4096)
    covered = {pk for r in data.run_requests for pk in request_partitions(r, KEYS)}
    assert covered - set(CUT_AT_4096) <= unmaterialized  # never a valid partition
    assert all(r.run_key and r.tags["dflash/reason"] == "cap raised" for r in data.run_requests)
    same_cap = dg.build_sensor_context(
        instance=instance,
        resources={"generation": GenerationResource(max_output_tokens=4096), "target_model": TargetModelResource()},
        repository_def=automation_defs.defs.get_repository_def(),
    )
    assert sensor.evaluate_tick(same_cap).run_requests == []


def test_daemon_launches_the_runs(instance, monkeypatch):
    """Dagster's scheduler and sensor daemon iterations against the definitions in a code server."""
    from dagster._daemon.sensor import execute_sensor_iteration
    from dagster._scheduler.scheduler import launch_scheduled_runs

    monkeypatch.setenv("AUTOMATION_TEST_CAP", "8192")  # read by the code server the workspace starts
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    target = ModuleTarget(
        module_name="dflash_assets_tests.automation_defs",
        attribute=None,
        working_directory=str(ROOT),
        location_name="ticks",
    )
    logger = logging.getLogger("ticks")
    with create_test_daemon_workspace_context(target, instance) as workspace:
        repo = load_remote_repo(workspace, "__repository__")
        instance.start_schedule(repo.get_schedule("backfill_unfinished_partitions"))
        instance.start_sensor(repo.get_sensor("generation_settings_changed"))
        before = {r.run_id for r in instance.get_runs()}
        now = datetime.datetime.now(datetime.UTC)
        list(
            launch_scheduled_runs(
                workspace, logger, end_datetime_utc=now + datetime.timedelta(minutes=10, seconds=30), iteration_times={}
            )
        )
        list(execute_sensor_iteration(workspace, logger, None, None))
        schedule_ticks = instance.get_ticks(
            repo.get_schedule("backfill_unfinished_partitions").get_remote_origin_id(),
            repo.get_schedule("backfill_unfinished_partitions").selector_id,
        )
        sensor_ticks = instance.get_ticks(
            repo.get_sensor("generation_settings_changed").get_remote_origin_id(),
            repo.get_sensor("generation_settings_changed").selector_id,
        )
    assert [t.status.value for t in schedule_ticks] == ["SUCCESS"], [t.error for t in schedule_ticks]
    assert [t.status.value for t in sensor_ticks] == ["SUCCESS"], [t.error for t in sensor_ticks]
    new = [r for r in instance.get_runs() if r.run_id not in before]
    by_trigger = {}
    for run in new:
        assert run.status == dg.DagsterRunStatus.QUEUED and run.tags.get(RUN_KEY_TAG)
        by_trigger.setdefault(run.tags["dflash/trigger"], []).append(run)
    [backfill_range] = [r for r in by_trigger["backfill"] if ASSET_PARTITION_RANGE_START_TAG in r.tags]
    assert (
        _range(backfill_range) == expected_ranges(set(MISSING) | {FAILED_ONCE}, {IN_PROGRESS, GIVEN_UP}, max_gap=16)[0]
    )
    assert backfill_range.asset_selection == {dg.AssetKey("completions")}
    # the sensor ran after the schedule: the partitions of the queued range run are in progress now
    a, b = _range(backfill_range)
    queued = set(KEYS[KEYS.index(a) : KEYS.index(b) + 1])
    [cap_range] = by_trigger["settings-change"]
    assert _range(cap_range) == expected_ranges(set(CUT_AT_4096) - queued, {IN_PROGRESS} | queued, fill=set(MISSING))[0]
    assert len(by_trigger["backfill"]) == 1 + 4  # one range run, four per-partition later-stage runs
