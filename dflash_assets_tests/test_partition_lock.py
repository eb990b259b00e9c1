"""Issue 27: no lock per partition. Two runs of one completions partition (a UI launch beside a shell run,
say) wrote one journal and overwrote each other's S3 journal segments. The run storage every run is
registered in is the lock: a step whose partitions another running run holds refuses, naming it, before
it writes anything."""

from __future__ import annotations

import subprocess
import sys

import dagster as dg
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    PARTITION_NAME_TAG,
)
from dagster._core.test_utils import create_run_for_test

from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.orchestration.runs import MACHINE_TAG, PID_TAG, process_tags, runs_holding_partitions
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets_tests.test_completions_asset import materialize, write_corpus

NEVER_CALLED = InferenceServerResource(
    mode="external", base_urls=["http://127.0.0.1:9/v1"], served_model_name="m", startup_timeout_s=1.0
)


def _holder(instance, asset: str, **tags) -> dg.DagsterRun:
    return create_run_for_test(
        instance,
        status=dg.DagsterRunStatus.STARTED,
        tags={**process_tags(), **tags},
        asset_selection=frozenset({dg.AssetKey(asset)}),
    )


def test_a_second_run_of_a_partition_is_refused_naming_the_first_and_writes_nothing(tmp_path):
    root = tmp_path / "data"
    with dg.instance_for_test() as instance:
        keys = write_corpus(instance, root, [f"prompt {i}" for i in range(4)], partition_size=2)
        first = _holder(instance, "completions", **{PARTITION_NAME_TAG: keys[0]})
        result = materialize(instance, root, keys[0], NEVER_CALLED, raise_on_error=False)
        assert not result.success
        [failure] = [e for e in result.all_events if e.is_step_failure]
        message = failure.step_failure_data.user_failure_data.description
        assert message.startswith(f"run {first.run_id} (pid {process_tags()['dflash/pid']} on ")
        assert f"is materializing completions[{keys[0]}]" in message and "mark-failed RUN_ID" in message
        assert not (root / "completions").exists()  # no journal, no table: nothing of the first run touched

        # a range run (single-run backfill) holds every key of its range
        ranged = _holder(
            instance,
            "completions",
            **{ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[1]},
        )
        ordered = lambda: instance.get_dynamic_partitions(prompt_ranges.name)  # noqa: E731
        assert runs_holding_partitions(instance, "completions", [keys[1]], "me", ordered) == {ranged.run_id: [keys[1]]}
        # another asset's run of the partition, or this very run, holds nothing here
        _holder(instance, "tokenized_sequences", **{PARTITION_NAME_TAG: keys[1]})
        assert runs_holding_partitions(instance, "completions", [keys[1]], ranged.run_id, ordered) == {}
        # a run provably dead (killed on this machine, still STARTED) holds nothing; one of another machine does
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        killed = _holder(instance, "completions", **{PARTITION_NAME_TAG: keys[1], PID_TAG: str(dead.pid)})
        elsewhere = _holder(
            instance,
            "completions",
            **{PARTITION_NAME_TAG: keys[1], PID_TAG: str(dead.pid), MACHINE_TAG: "etc:" + "b" * 32},
        )
        held = runs_holding_partitions(instance, "completions", [keys[1]], ranged.run_id, ordered)
        assert killed.run_id not in held and held == {elsewhere.run_id: [keys[1]]}
        instance.report_run_failed(instance.get_run_by_id(elsewhere.run_id), "ended")
        # once the first run has ended, its partition is free again
        instance.report_run_failed(instance.get_run_by_id(first.run_id), "ended")
        instance.report_run_failed(instance.get_run_by_id(ranged.run_id), "ended")
        assert runs_holding_partitions(instance, "completions", keys, "me", ordered) == {}
