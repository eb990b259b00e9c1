"""Assembles the pipeline: assets, checks, resources, schedules. Nothing else lives here."""

import os

import dagster as dg

from dflash_assets.app.automation import build_backfill_schedule, build_cap_change_sensor
from dflash_assets.app.stage_order import ASSETS, PARTITION_STAGES
from dflash_assets.common.config import build_resources, op_config
from dflash_assets.common.stop_signals import restore_stop_signals
from dflash_assets.generation.servers.pool import API_KEY_ENV
from dflash_assets.orchestration.cluster import celery_broker_url, partition_executor
from dflash_assets.orchestration.instance_url import check_postgres_url
from dflash_assets.orchestration.runs import reaping_executor
from dflash_assets.stages.config_schema import RESOURCE_CLASSES, check_local_model, check_seed, validate_ops
from dflash_assets.stages.resources.storage import s3_credentials_from_env

partition_stages_job = dg.define_asset_job(
    "partition_stages",
    selection=dg.AssetSelection.assets(*PARTITION_STAGES),
    config=op_config(*PARTITION_STAGES),
    description="Per-partition stages for one index range: completions, tokenized sequences, hidden states.",
)


def api_key_from_env() -> dict:
    """The servers' API key as an EnvVar reference (never a literal), when the variable is set."""
    return {"api_key": dg.EnvVar(API_KEY_ENV)} if os.environ.get(API_KEY_ENV) else {}


restore_stop_signals()  # every process loading the pipeline (CLI, step, daemon) stops on SIGINT / SIGTERM
check_postgres_url()  # a cluster instance's URL: psycopg2's scheme, refused before a run's first write fails
validate_ops(ASSETS)  # unknown op names / config keys in the config file are errors, named with the file

# the resources the config file's root schema names (stages/config_schema.py), each from its section
RESOURCES = build_resources(
    RESOURCE_CLASSES, extra={"storage": s3_credentials_from_env(), "inference": api_key_from_env()}
)
check_local_model(RESOURCES)  # the local server and the target model are one model
check_seed(RESOURCES)  # a seed SGLang would ignore is refused, never recorded as used

defs = dg.Definitions(
    assets=ASSETS,
    jobs=[partition_stages_job],
    # several nodes: the unfinished partitions as one range run per node (a range run is one step on one node)
    schedules=[build_backfill_schedule(partition_stages_job, spread_over_nodes=celery_broker_url() is not None)],
    sensors=[build_cap_change_sensor(partition_stages_job)],
    # tags each run with its process and reaps killed runs before steps claim pool slots; with $DFLASH_CELERY_BROKER
    # set, Dagster's Celery executor places each step on a node's worker (orchestration/cluster.py, docs/scale.md)
    executor=partition_executor(reaping_executor),
    resources=RESOURCES,
)
