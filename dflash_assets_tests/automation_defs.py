"""Stand-in definitions for ticking the project's schedule and sensor through Dagster's daemon path:
the real builders (dflash_assets/app/automation.py) over stand-in per-partition stages that carry the real
asset keys, partitions, pool and single-run backfill policy. Runs are only created and queued, never
executed. The sensor's cap comes from ``$AUTOMATION_TEST_CAP`` (default 4096), standing in for the
config file."""

import os

import dagster as dg

from dflash_assets.app.automation import build_backfill_schedule, build_cap_change_sensor
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.orchestration.pools import INFERENCE_POOL
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.target_model import TargetModelResource


@dg.asset(
    name="completions",
    partitions_def=prompt_ranges,
    pool=INFERENCE_POOL,
    backfill_policy=dg.BackfillPolicy.single_run(),
)
def completions(context: dg.AssetExecutionContext):
    raise dg.Failure("stand-in: never executed by these tests")


@dg.asset(name="tokenized_sequences", partitions_def=prompt_ranges, deps=[completions])
def tokenized_sequences():
    raise dg.Failure("stand-in")


@dg.asset(name="hidden_states", partitions_def=prompt_ranges, deps=[tokenized_sequences])
def hidden_states():
    raise dg.Failure("stand-in")


partition_stages = dg.define_asset_job("partition_stages", selection=[completions, tokenized_sequences, hidden_states])

defs = dg.Definitions(
    assets=[completions, tokenized_sequences, hidden_states],
    jobs=[partition_stages],
    schedules=[build_backfill_schedule(partition_stages)],
    sensors=[build_cap_change_sensor(partition_stages)],
    resources={
        "generation": GenerationResource(max_output_tokens=int(os.environ.get("AUTOMATION_TEST_CAP", "4096"))),
        "target_model": TargetModelResource(),
    },
)
