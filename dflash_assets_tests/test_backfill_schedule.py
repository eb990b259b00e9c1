"""The backfill schedule against a real Dagster instance, ticked through ``ScheduleDefinition.evaluate_tick``
(what the daemon calls: it rejects several requests without run keys): it requests the missing and failed
``completions`` partitions as ranges, one run each, cut at the ones in progress (a run STARTED and a run
created but not yet launched, each with its planned-materialization event: Dagster marks a partition in
progress when its latest planned materialization belongs to an unfinished run), at most K runs per tick.

Partition states are made by real runs of a stand-in ``completions`` asset (same key and partitions
definition, no server): succeeded, failed (raises), and one blocked mid-step in a thread.
"""

import threading
import time

import dagster as dg
import pytest
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    PARTITION_NAME_TAG,
)

from dflash_assets.app.automation import build_backfill_schedule
from dflash_assets.data.ranges import partition_keys
from dflash_assets.orchestration.partitions import prompt_ranges

KEYS = partition_keys(90, 10)  # 9 keys: 0000000-0000009 ... 0000080-0000089
MATERIALIZED = [KEYS[0], KEYS[4]]
FAILED = [KEYS[2], KEYS[6]]
STARTED = KEYS[3]  # a run executing right now
NOT_STARTED = KEYS[8]  # a run created but not yet launched
MISSING = [KEYS[1], KEYS[5], KEYS[7]]
UNFINISHED = sorted(MISSING + FAILED)  # what the schedule must request, in key order
# ranges of them cut at the in-progress keys (STARTED, NOT_STARTED); finished KEYS[4] inside the second
RANGES = [(KEYS[1], KEYS[2]), (KEYS[5], KEYS[7])]


def stand_in_assets(gate: threading.Event, started: threading.Event):
    """A ``completions`` asset that fails on FAILED keys and blocks on STARTED until ``gate`` is set."""

    @dg.asset(name="completions", partitions_def=prompt_ranges)
    def completions(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        if context.partition_key in FAILED:
            raise dg.Failure(f"{context.partition_key}: server unreachable")
        if context.partition_key == STARTED:
            started.set()
            if not gate.wait(120):
                raise TimeoutError("the test never released the blocked run")
        return dg.MaterializeResult(metadata={"rows": 10})

    return completions


def evaluate(schedule: dg.ScheduleDefinition, instance: dg.DagsterInstance, asset=None):
    """One tick of ``schedule`` through ``evaluate_tick``: the RunRequests, or a SkipReason."""
    defs = dg.Definitions(assets=[asset], jobs=[schedule.job], schedules=[schedule]) if asset is not None else None
    data = schedule.evaluate_tick(
        dg.build_schedule_context(instance=instance, repository_def=defs.get_repository_def() if defs else None)
    )
    assert all(r.run_key for r in data.run_requests)
    return data.run_requests if data.run_requests else dg.SkipReason(data.skip_message)


def ranges(requests) -> list[tuple[str, str]]:
    assert all(r.asset_selection == [dg.AssetKey("completions")] for r in requests)
    return [(r.tags[ASSET_PARTITION_RANGE_START_TAG], r.tags[ASSET_PARTITION_RANGE_END_TAG]) for r in requests]


@pytest.fixture()
def instance_with_states():
    gate, started = threading.Event(), threading.Event()
    asset = stand_in_assets(gate, started)
    job = dg.define_asset_job("partition_stages", selection=[asset])
    job_def = dg.Definitions(assets=[asset], jobs=[job]).resolve_job_def("partition_stages")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, KEYS)
        for pk in MATERIALIZED + FAILED:
            result = dg.materialize([asset], instance=instance, partition_key=pk, raise_on_error=False)
            assert result.success == (pk in MATERIALIZED)
        errors: list[Exception] = []

        def blocked_run() -> None:
            try:
                dg.materialize([asset], instance=instance, partition_key=STARTED)
            except Exception as exc:
                errors.append(exc)

        thread = threading.Thread(target=blocked_run, daemon=True)
        thread.start()
        assert started.wait(60), "the blocked run never reached its step"
        # created with its planned events, never launched (status NOT_STARTED)
        instance.create_run_for_job(job_def, tags={PARTITION_NAME_TAG: NOT_STARTED})
        try:
            yield instance, job, gate, asset
        finally:
            gate.set()
            thread.join(60)
        assert not errors, errors


def test_schedule_requests_missing_and_failed_only_at_most_k_per_tick(instance_with_states):
    instance, job, gate, asset = instance_with_states
    from dflash_assets.definitions import defs

    # the states are what the runs made them (the schedule's input, checked through Dagster's own API)
    status = instance.get_status_by_partition(dg.AssetKey("completions"), KEYS, prompt_ranges)
    expected = {
        **{k: None for k in MISSING},
        **{k: dg.AssetPartitionStatus.MATERIALIZED for k in MATERIALIZED},
        **{k: dg.AssetPartitionStatus.FAILED for k in FAILED},
        STARTED: dg.AssetPartitionStatus.IN_PROGRESS,
        NOT_STARTED: dg.AssetPartitionStatus.IN_PROGRESS,
    }
    assert {k: status.get(k) for k in KEYS} == expected
    runs = {r.tags.get(PARTITION_NAME_TAG): r.status for r in instance.get_runs()}
    assert runs[STARTED] == dg.DagsterRunStatus.STARTED and runs[NOT_STARTED] == dg.DagsterRunStatus.NOT_STARTED

    shipped = defs.get_schedule_def("backfill_unfinished_partitions")  # the one the project deploys (1 run per tick)
    requests = evaluate(build_backfill_schedule(job), instance, asset)
    assert shipped.cron_schedule == build_backfill_schedule(job).cron_schedule
    assert ranges(requests) == RANGES[:1]
    assert all(r.tags["dflash/trigger"] == "backfill" for r in requests)

    wide = build_backfill_schedule(job, max_runs_per_tick=10)
    assert ranges(evaluate(wide, instance, asset)) == RANGES
    narrow = build_backfill_schedule(job, max_runs_per_tick=10, max_partitions_per_run=2)
    assert ranges(evaluate(narrow, instance, asset)) == [(KEYS[1], KEYS[2]), (KEYS[5], KEYS[6]), (KEYS[7], KEYS[7])]

    # once the blocked run finishes, its partition is materialized: still not requested
    gate.set()
    deadline = time.monotonic() + 60
    while (
        instance.get_status_by_partition(dg.AssetKey("completions"), [STARTED], prompt_ranges)[STARTED]
        != dg.AssetPartitionStatus.MATERIALIZED
    ):
        assert time.monotonic() < deadline, "the released run did not finish"
        time.sleep(0.2)
    assert ranges(evaluate(wide, instance, asset)) == [(KEYS[1], KEYS[7])]  # no longer cut at KEYS[3]


def test_schedule_skips_when_nothing_is_unfinished():
    @dg.asset(name="completions", partitions_def=prompt_ranges)
    def completions() -> dg.MaterializeResult:
        return dg.MaterializeResult()

    job = dg.define_asset_job("partition_stages", selection=[completions])
    schedule = build_backfill_schedule(job, max_runs_per_tick=4)
    with dg.instance_for_test() as instance:
        keys = partition_keys(20, 10)
        instance.add_dynamic_partitions(prompt_ranges.name, keys)
        assert ranges(evaluate(schedule, instance, completions)) == [(keys[0], keys[1])]  # nothing run yet: all missing
        for pk in keys:
            assert dg.materialize([completions], instance=instance, partition_key=pk).success
        result = evaluate(schedule, instance, completions)
        assert isinstance(result, dg.SkipReason) and "nothing unfinished" in result.skip_message


def test_schedule_on_several_nodes_requests_one_range_per_inference_slot():
    """Issue 41: a range run is one Celery step on one node, so one range of every unfinished partition would keep
    every other node idle. Spread over the nodes (the dflash_inference pool's slots, one per node's servers), the
    tick requests that many ranges of at most ceil(unfinished / nodes) partitions, cut at a run in progress."""
    from dflash_assets.orchestration.pools import INFERENCE_POOL

    @dg.asset(name="completions", partitions_def=prompt_ranges)
    def completions() -> dg.MaterializeResult:
        return dg.MaterializeResult()

    job = dg.define_asset_job("partition_stages", selection=[completions])
    keys = partition_keys(90, 10)  # 9 partitions
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, keys)
        assert dg.materialize([completions], instance=instance, partition_key=keys[8]).success
        assert ranges(evaluate(build_backfill_schedule(job), instance, completions)) == [(keys[0], keys[7])]
        spread = build_backfill_schedule(job, spread_over_nodes=True)
        assert ranges(evaluate(spread, instance, completions)) == [(keys[0], keys[7])]  # no pool limit: one node
        instance.event_log_storage.set_concurrency_slots(INFERENCE_POOL, 2)
        assert ranges(evaluate(spread, instance, completions)) == [(keys[0], keys[3]), (keys[4], keys[7])]
        instance.event_log_storage.set_concurrency_slots(INFERENCE_POOL, 3)
        assert ranges(evaluate(spread, instance, completions)) == [
            (keys[0], keys[2]),
            (keys[3], keys[5]),
            (keys[6], keys[7]),
        ]
        capped = build_backfill_schedule(job, spread_over_nodes=True, max_partitions_per_run=2, max_runs_per_tick=1)
        assert ranges(evaluate(capped, instance, completions)) == [
            (keys[0], keys[1]),
            (keys[2], keys[3]),
            (keys[4], keys[5]),
        ]


def test_on_several_nodes_ranges_are_not_run_retries_and_later_stages_scale_with_gpu_slots():
    """A failed range run is re-cut over the nodes by the next tick (a run retry would put the whole rest of it on
    one node): the spread ranges carry dagster/max_retries 0. The later stages go one run per partition, up to
    max_downstream_per_tick per dflash_gpu slot (one per node's GPUs)."""
    from dagster._core.storage.tags import MAX_RETRIES_TAG

    from dflash_assets.orchestration.pools import GPU_POOL, INFERENCE_POOL

    @dg.asset(name="completions", partitions_def=prompt_ranges)
    def completions() -> dg.MaterializeResult:
        return dg.MaterializeResult()

    @dg.asset(name="tokenized_sequences", partitions_def=prompt_ranges, deps=[completions])
    def tokenized_sequences() -> None:
        pass

    @dg.asset(name="hidden_states", partitions_def=prompt_ranges, deps=[tokenized_sequences])
    def hidden_states() -> None:
        pass

    assets = [completions, tokenized_sequences, hidden_states]
    job = dg.define_asset_job("partition_stages", selection=assets)
    defs = dg.Definitions(assets=assets, jobs=[job])
    keys = partition_keys(90, 10)  # 9 partitions: 6 done, 3 never run

    def tick(schedule) -> list[dg.RunRequest]:
        context = dg.build_schedule_context(instance=instance, repository_def=defs.get_repository_def())
        return list(schedule.evaluate_tick(context).run_requests)

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, keys)
        for pk in keys[:6]:
            assert dg.materialize([completions], instance=instance, partition_key=pk).success
        instance.event_log_storage.set_concurrency_slots(INFERENCE_POOL, 2)
        instance.event_log_storage.set_concurrency_slots(GPU_POOL, 3)
        for spread, later in ((False, 2), (True, 6)):
            requests = tick(build_backfill_schedule(job, max_downstream_per_tick=2, spread_over_nodes=spread))
            ranges_ = [r for r in requests if r.asset_selection == [dg.AssetKey("completions")]]
            downstream = [r for r in requests if r not in ranges_]
            assert [
                (r.tags[ASSET_PARTITION_RANGE_START_TAG], r.tags[ASSET_PARTITION_RANGE_END_TAG]) for r in ranges_
            ] == ([(keys[6], keys[7]), (keys[8], keys[8])] if spread else [(keys[6], keys[8])])
            assert all(r.tags.get(MAX_RETRIES_TAG) == ("0" if spread else None) for r in ranges_)
            assert [r.partition_key for r in downstream] == keys[:later]  # one run per partition
            assert all(
                r.asset_selection == [dg.AssetKey("tokenized_sequences"), dg.AssetKey("hidden_states")]
                for r in downstream
            )
            assert all(MAX_RETRIES_TAG not in r.tags for r in downstream)  # a failed later stage waits for a human


def test_the_backfill_cron_comes_from_the_environment(monkeypatch):
    """DFLASH_BACKFILL_CRON sets the schedule's cron without editing code; a malformed one is an error naming it."""
    from dflash_assets.app.automation import BACKFILL_CRON_ENV, DEFAULT_BACKFILL_CRON, backfill_cron

    job = dg.define_asset_job("partition_stages", selection=["completions"])
    monkeypatch.delenv(BACKFILL_CRON_ENV, raising=False)
    assert backfill_cron() == DEFAULT_BACKFILL_CRON == "*/10 * * * *"
    assert build_backfill_schedule(job).cron_schedule == "*/10 * * * *"
    monkeypatch.setenv(BACKFILL_CRON_ENV, " * * * * * ")
    assert build_backfill_schedule(job).cron_schedule == "* * * * *"
    assert build_backfill_schedule(job, cron="0 * * * *").cron_schedule == "0 * * * *"  # an explicit one wins
    # "0 25 * * *": a new user's try (2026-12-06), told "give 5 fields" when it had five and an hour out of range
    for bad in ("every minute", "61 * * * *", "* * * *", "0 25 * * *"):
        monkeypatch.setenv(BACKFILL_CRON_ENV, bad)
        with pytest.raises(ValueError, match=BACKFILL_CRON_ENV) as err:
            build_backfill_schedule(job)
        assert "minute (0-59) hour (0-23) day (1-31) month (1-12) weekday (0-6)" in str(err.value)


def test_schedule_gives_up_on_a_partition_after_max_failed_attempts():
    """A partition failing every time used to be requested on every tick forever."""
    from dflash_assets.app.automation import failed_attempts

    fail = {"on": True}

    @dg.asset(name="completions", partitions_def=prompt_ranges)
    def completions(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        if fail["on"] and context.partition_key == KEYS[1]:
            raise RuntimeError("bad row")
        return dg.MaterializeResult()

    job = dg.define_asset_job("partition_stages", selection=[completions])
    schedule = build_backfill_schedule(job, max_runs_per_tick=10, max_failed_attempts=2)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, KEYS[:3])
        assert dg.materialize([completions], instance=instance, partition_key=KEYS[0]).success
        for attempt in (1, 2):
            assert ranges(evaluate(schedule, instance, completions)) == [(KEYS[1], KEYS[2])]  # retried: under the limit
            assert not dg.materialize(
                [completions], instance=instance, partition_key=KEYS[1], raise_on_error=False
            ).success
            assert failed_attempts(instance, dg.AssetKey("completions"), KEYS[1]) == attempt
        assert ranges(evaluate(schedule, instance, completions)) == [(KEYS[2], KEYS[2])]  # given up after 2 failures
        # a run by hand that succeeds resets the count; a later failure counts from there
        fail["on"] = False
        assert dg.materialize([completions], instance=instance, partition_key=KEYS[1]).success
        assert failed_attempts(instance, dg.AssetKey("completions"), KEYS[1]) == 0
        fail["on"] = True
        assert not dg.materialize([completions], instance=instance, partition_key=KEYS[1], raise_on_error=False).success
        assert failed_attempts(instance, dg.AssetKey("completions"), KEYS[1]) == 1
        assert ranges(evaluate(schedule, instance, completions)) == [(KEYS[1], KEYS[2])]
