"""Dagster pools (dagster.yaml ``concurrency: pools:``): the names the assets take a slot of, their
registration and their use. Apart from ``status`` so that assets importing a pool name import nothing else."""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg

# Dagster pools (dagster.yaml `concurrency: pools:`): steps that use the inference servers / the GPU
INFERENCE_POOL = "dflash_inference"
GPU_POOL = "dflash_gpu"
POOLS = (INFERENCE_POOL, GPU_POOL)


def ensure_pool_limits(instance: dg.DagsterInstance, pools: Sequence[str] = POOLS) -> list[str]:
    """Register each pool in the instance at dagster.yaml's ``default_limit`` unless it already has a limit.

    Why: the run queue reads the set of limited pools before it registers a pool it sees for the
    first time, so several runs queued together for a new pool are all launched in that first pass
    (their steps still take turns, but the runs start together). Registering the pools before any
    partition exists (``prompt_corpus`` calls this) keeps those runs queued. A limit set by hand
    (``dagster instance concurrency set``) is left as it is. Returns the pools it registered.
    """
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits or instance.global_op_concurrency_default_limit is None:
        return []  # no default_limit in dagster.yaml: nothing to register
    known = storage.get_concurrency_keys()
    added = [pool for pool in pools if pool not in known]
    for pool in added:
        storage.initialize_concurrency_limit_to_default(pool)
    return added


def pool_usage(instance: dg.DagsterInstance, pools: Sequence[str] = POOLS) -> dict[str, dict]:
    """``{pool: {"limit", "in_use", "waiting"}}``: slots, steps holding one, steps queued for one.

    ``limit`` is None for a pool without a limit (neither registered nor covered by ``default_limit``).
    """
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return {}
    out = {}
    for pool in pools:
        info = storage.get_concurrency_info(pool)
        out[pool] = {"limit": info.limit, "in_use": info.active_slot_count, "waiting": info.pending_step_count}
    return out
