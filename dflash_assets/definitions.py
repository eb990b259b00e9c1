"""Assembles the pipeline: assets, checks, resources, schedules. Nothing else lives here."""

import dagster as dg

from dflash_assets.assets import completions, drafter, hidden_states, prompts, tokenized, truncation
from dflash_assets.automation import build_backfill_schedule, build_cap_change_sensor
from dflash_assets.resources.generation import GenerationResource
from dflash_assets.resources.inference import InferenceServerResource
from dflash_assets.resources.storage import StorageResource
from dflash_assets.resources.target_model import TargetModelResource

partition_stages_job = dg.define_asset_job(
    "partition_stages",
    selection=dg.AssetSelection.assets("completions", "tokenized_sequences", "hidden_states"),
    partitions_def=completions.prompt_ranges,
    description="Per-partition stages for one index range: completions, tokenized sequences, hidden states.",
)

defs = dg.Definitions(
    assets=[prompts.prompt_corpus, completions.completions, truncation.truncation_report, tokenized.tokenized_sequences,
            hidden_states.hidden_states, drafter.dflash_drafter],
    jobs=[partition_stages_job],
    schedules=[build_backfill_schedule(partition_stages_job)],
    sensors=[build_cap_change_sensor(partition_stages_job)],
    resources={
        "storage": StorageResource(),
        "inference": InferenceServerResource(),
        "generation": GenerationResource(),
        "target_model": TargetModelResource(),
    },
)
