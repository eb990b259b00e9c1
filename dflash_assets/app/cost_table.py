"""The per-stage cost table that ``python -m dflash_assets run``'s summary and ``status`` print.

Each stage's figures are sums of the ``cost_*`` metadata (:mod:`dflash_assets.common.cost`) of its latest
materializations: one per partition for partitioned stages (a partition made again counts once, at its
latest cost), the latest one for the others. So the table is what the data as it stands cost, not the sum
of every run ever made. Money = device-hours x ``resources.cost.device_hour_usd``.
"""

from __future__ import annotations

import dagster as dg

from dflash_assets.app.stage_order import PARTITION_STAGES, STAGE_ORDER
from dflash_assets.common.cost import CPU, SIMULATED_GPU
from dflash_assets.orchestration.history import latest_metadata, latest_metadata_by_partition

#: stages whose materializations record a cost, upstream first
COSTED = tuple(s for s in STAGE_ORDER if s in (*PARTITION_STAGES, "dflash_drafter", "drafter_evaluation"))


def stage_costs(instance: dg.DagsterInstance, keys: list[str] | None = None) -> dict[str, dict]:
    """``{stage: figures}`` summed over the latest materializations that carry ``cost_*`` metadata.

    Figures: ``device`` (the kinds seen, joined), ``basis`` (how device-seconds were counted),
    ``device_s`` (device-seconds), ``wall_s`` (seconds, summed over materializations), ``tokens_in`` /
    ``tokens_out`` (tokens), ``tok_per_device_s`` (tokens out, else in, per device-second),
    ``materializations`` (how many were summed). Stages without any are left out.
    """
    out = {}
    for stage in COSTED:
        if stage in PARTITION_STAGES:
            metas = list(latest_metadata_by_partition(instance, stage, keys).values())
        else:
            metas = [latest_metadata(instance, stage)]
        metas = [m for m in metas if m and "cost_device_s" in m]
        if not metas:
            continue
        device_s = sum(float(m["cost_device_s"]) for m in metas)
        tokens_in = sum(int(m.get("cost_tokens_in") or 0) for m in metas)
        tokens_out = sum(int(m.get("cost_tokens_out") or 0) for m in metas)
        out[stage] = {
            "device": ", ".join(sorted({str(m["cost_device"]) for m in metas})),
            "basis": "; ".join(sorted({str(m.get("cost_basis")) for m in metas})),
            "device_s": device_s,
            "wall_s": sum(float(m.get("cost_wall_s") or 0.0) for m in metas),
            "tokens_in": tokens_in,
            "tokens_out": tokens_out,
            "tok_per_device_s": (tokens_out or tokens_in) / device_s if device_s > 0 else 0.0,
            "materializations": len(metas),
        }
    return out


def unit(device: str) -> str:
    """The unit a stage's device-seconds are in: ``GPU-h``, ``simulated GPU-h``, ``CPU-h``, ``server-h``."""
    return f"{device}-h" if "," not in device else "device-h (mixed)"


def money(device_s: float, device_hour_usd: float | None) -> float | None:
    """USD = device_s / 3600 x device_hour_usd; None without a price."""
    return None if device_hour_usd is None else device_s / 3600.0 * device_hour_usd


def format_cost_table(costs: dict[str, dict], device_hour_usd: float | None) -> str:
    """Aligned text: one line per stage (device-hours in its own unit, wall, tokens, throughput, USD), then
    a total per unit and how each stage's seconds were counted. Simulated figures say so."""
    if not costs:
        return "== cost per stage ==\nno stage has recorded a cost yet (materializations before cost metadata)"
    price = "no price set (resources.cost.device_hour_usd)" if device_hour_usd is None else f"${device_hour_usd:g}"
    header = (
        f"{'stage':<20}{'device-hours':>14} {'unit':<18}{'wall':>10}{'tokens in':>14}{'tokens out':>14}"
        f"{'tok/s/device':>14}{'USD':>11}"
    )
    lines = [f"== cost per stage == (price per device-hour: {price})", header, "-" * len(header)]
    totals: dict[str, float] = {}
    for stage, c in costs.items():
        usd = money(c["device_s"], device_hour_usd)
        u = unit(c["device"])
        totals[u] = totals.get(u, 0.0) + c["device_s"]
        lines.append(
            f"{stage:<20}{c['device_s'] / 3600:>14.4f} {u:<18}{c['wall_s']:>9.0f}s{c['tokens_in']:>14,}"
            f"{c['tokens_out']:>14,}{c['tok_per_device_s']:>14.1f}{'-' if usd is None else f'{usd:.2f}':>11}"
        )
    for u, device_s in totals.items():
        usd = money(device_s, device_hour_usd)
        tail = "" if usd is None else f"{'':>66}{usd:>11.2f}"
        lines.append(f"{'total':<20}{device_s / 3600:>14.4f} {u:<18}" + tail)
    lines += [f"  {stage}: {c['device']}-seconds counted as {c['basis']}" for stage, c in costs.items()]
    if any(SIMULATED_GPU in c["device"] for c in costs.values()):
        lines.append("  simulated GPU: figures from the GPU-node simulator, not measured on a GPU")
    if any(CPU in c["device"].split(", ") for c in costs.values()):
        lines.append("  CPU: core-seconds or process CPU-seconds (see each basis), never GPU time")
    return "\n".join(lines)


def configured_price() -> float | None:
    """``resources.cost.device_hour_usd`` of the active config (None when unset or the config is unreadable)."""
    try:
        from dflash_assets.common.config import resource_fields
        from dflash_assets.stages.resources.cost import CostResource

        return CostResource(**resource_fields("cost")).device_hour_usd
    except Exception:
        return None
