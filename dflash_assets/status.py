"""``python -m dflash_assets status``: per-stage partition counts, completions throughput and ETA.

Reads only the Dagster instance (run and event storage under ``DAGSTER_HOME``): partition statuses
come from ``DagsterInstance.get_status_by_partition`` (the same source as the UI's partition bars),
completions numbers from the metadata of each partition's latest materialization.
"""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg

from dflash_assets.partitions import key_range, prompt_ranges

STAGES = ("completions", "tokenized_sequences", "hidden_states")
COMPLETIONS = "completions"
# Dagster pools (dagster.yaml `concurrency: pools:`): steps that use the inference servers / the GPU
INFERENCE_POOL = "dflash_inference"
GPU_POOL = "dflash_gpu"
POOLS = (INFERENCE_POOL, GPU_POOL)
_PAGE = 1000


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


def partition_rows(partition_key: str) -> int:
    """Prompts in an index-range partition (both ends inclusive)."""
    first, last = key_range(partition_key)
    return last - first + 1


def stage_counts(instance: dg.DagsterInstance, asset_name: str, keys: Sequence[str]) -> dict:
    """Partition keys of one partitioned asset grouped by status.

    Returns ``{"done", "failed", "in_progress", "missing"}`` counts plus the keys of each group under
    ``"<group>_keys"`` (in partition-key order). ``done`` means the UI's "materialized": the latest
    attempt succeeded. A partition whose latest attempt failed counts as failed even if an older one
    succeeded; one with a run in flight counts as in progress whatever came before (Dagster's order).
    """
    by_status = instance.get_status_by_partition(dg.AssetKey(asset_name), list(keys), prompt_ranges) or {}
    groups: dict[str, list[str]] = {"done": [], "failed": [], "in_progress": [], "missing": []}
    name_of = {
        dg.AssetPartitionStatus.MATERIALIZED: "done",
        dg.AssetPartitionStatus.FAILED: "failed",
        dg.AssetPartitionStatus.IN_PROGRESS: "in_progress",
    }
    for pk in keys:
        groups[name_of.get(by_status.get(pk), "missing")].append(pk)
    out: dict = {name: len(pks) for name, pks in groups.items()}
    out.update({f"{name}_keys": pks for name, pks in groups.items()})
    return out


def latest_metadata_by_partition(instance: dg.DagsterInstance, asset_name: str, keys: Sequence[str]) -> dict[str, dict]:
    """``{partition_key: metadata}`` (plain values) of the newest materialization of each of ``keys``.

    Pages through the event log newest first, ``_PAGE`` records at a time, so a partition's first
    record seen is its latest.
    """
    wanted, found = set(keys), {}
    if not wanted:
        return found
    records_filter = dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset_name), asset_partitions=sorted(wanted))
    cursor = None
    while len(found) < len(wanted):
        result = instance.fetch_materializations(records_filter, limit=_PAGE, cursor=cursor, ascending=False)
        for record in result.records:
            event = record.asset_materialization
            if event is not None and event.partition in wanted and event.partition not in found:
                found[event.partition] = {k: getattr(v, "value", v) for k, v in event.metadata.items()}
        if not result.has_more:
            break
        cursor = result.cursor
    return found


def collect_status(instance: dg.DagsterInstance, stages: Sequence[str] = STAGES) -> dict:
    """Everything the status command prints, as plain values.

    Returns a dict:

    - ``partitions``: number of registered ``prompt_index_ranges`` keys; ``prompts``: prompts they cover.
    - ``stages``: ``{asset_name: stage_counts(...)}`` for each partitioned stage.
    - ``pools``: :func:`pool_usage` of the inference and GPU pools.
    - ``completions``: from the latest materialization metadata of each *done* completions partition:
      ``rows_done`` (metadata ``rows``), ``tokens_done`` (``completion_tokens_total``, tokens),
      ``generation_s`` (sum of ``wall_s``, seconds; partitions lacking a key contribute 0 to it),
      ``tokens_per_s`` = tokens_done / generation_s (None when no time was recorded),
      ``rows_remaining`` (prompts of every failed, in-progress or missing partition, from its key range),
      ``tokens_remaining_est`` = rows_remaining * tokens_done / rows_done (tokens; None without a done
      row) and ``eta_s`` = tokens_remaining_est / tokens_per_s (seconds; None when either is unknown).
      The rate sums per-partition wall time, which equals elapsed time while the ``dflash_inference``
      pool runs one completions partition at a time; in-progress partitions count as wholly remaining.
    """
    keys = list(instance.get_dynamic_partitions(prompt_ranges.name))
    counts = {name: stage_counts(instance, name, keys) for name in stages}
    comp = counts.get(COMPLETIONS) or stage_counts(instance, COMPLETIONS, keys)
    meta = latest_metadata_by_partition(instance, COMPLETIONS, comp["done_keys"])
    rows_done = sum(int(m.get("rows", 0) or 0) for m in meta.values())
    tokens_done = sum(int(m.get("completion_tokens_total", 0) or 0) for m in meta.values())
    generation_s = sum(float(m.get("wall_s", 0.0) or 0.0) for m in meta.values())
    rows_remaining = sum(partition_rows(pk) for pk in comp["failed_keys"] + comp["in_progress_keys"] + comp["missing_keys"])
    tokens_per_s = tokens_done / generation_s if generation_s > 0 else None
    tokens_remaining = rows_remaining * tokens_done / rows_done if rows_done else None
    eta_s = tokens_remaining / tokens_per_s if tokens_remaining is not None and tokens_per_s else None
    if rows_remaining == 0:
        tokens_remaining, eta_s = 0.0, 0.0
    return {
        "partitions": len(keys),
        "prompts": sum(partition_rows(pk) for pk in keys),
        "stages": counts,
        "pools": pool_usage(instance),
        "completions": {
            "rows_done": rows_done,
            "tokens_done": tokens_done,
            "generation_s": round(generation_s, 3),
            "tokens_per_s": tokens_per_s,
            "rows_remaining": rows_remaining,
            "tokens_remaining_est": tokens_remaining,
            "eta_s": eta_s,
        },
    }


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


def format_status(status: dict) -> str:
    """Human-readable text of :func:`collect_status`'s dict: a stage table, then throughput and ETA."""
    lines = [f"partitions: {status['partitions']} ({prompt_ranges.name}, {status['prompts']} prompts)"]
    header = f"{'stage':<22}{'done':>7}{'failed':>8}{'in progress':>13}{'missing':>9}"
    lines += [header, "-" * len(header)]
    for name, c in status["stages"].items():
        lines.append(f"{name:<22}{c['done']:>7}{c['failed']:>8}{c['in_progress']:>13}{c['missing']:>9}")
        if c["failed_keys"]:
            shown = ", ".join(c["failed_keys"][:5]) + (" ..." if len(c["failed_keys"]) > 5 else "")
            lines.append(f"  failed: {shown}")
    for pool, p in status.get("pools", {}).items():
        limit = "no limit" if p["limit"] is None else f"limit {p['limit']}"
        lines.append(f"pool {pool}: {limit}, {p['in_use']} in use, {p['waiting']} waiting")
    comp = status["completions"]
    rate = f"{comp['tokens_per_s']:.1f} tokens/s" if comp["tokens_per_s"] is not None else "rate unknown"
    lines.append(
        f"completions done: {comp['rows_done']} rows, {comp['tokens_done']} completion tokens in "
        f"{comp['generation_s']:.1f} s of generation ({rate})"
    )
    remaining = comp["tokens_remaining_est"]
    lines.append(
        f"completions remaining: {comp['rows_remaining']} prompts, "
        f"~{remaining:.0f} tokens" if remaining is not None else
        f"completions remaining: {comp['rows_remaining']} prompts, tokens unknown (no partition done yet)"
    )
    lines[-1] += f", ETA {_duration(comp['eta_s'])}"
    return "\n".join(lines)


def print_status(instance: dg.DagsterInstance | None = None) -> int:
    """Print :func:`format_status` for ``instance`` (default: ``DagsterInstance.get()``); returns exit code 0."""
    print(format_status(collect_status(instance or dg.DagsterInstance.get())))
    return 0
