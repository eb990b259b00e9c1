"""Assembles the pipeline: assets, checks, resources, schedules. Nothing else lives here."""


import dagster as dg

from dflash_assets.assets import prompts
from dflash_assets.resources.storage import StorageResource

defs = dg.Definitions(
    assets=[prompts.prompt_corpus],
    resources={"storage": StorageResource()},
)
