"""What the run costs, on the simulated GPU node: the forecast from a pilot partition against the measured whole.

Reuses ``bench_node``'s node (the real ``dagster asset materialize`` CLI in ``sglang`` mode against
``dflash_simulators.sglang_stub`` servers in their own processes: start-up, slots, per-slot decode
rate, user-like lengths, time compressed ``--speed`` times). Steps:

1. ``prompt_corpus`` with ``--prompts`` prompts in ``--partitions`` partitions.
2. Pilot: the first partition alone (one run).
3. Forecast (:func:`dflash_assets.stages.forecast.collect_forecast`) of the whole corpus from the pilot, kept in
   ``cost/report.json`` (:mod:`dflash_assets.app.cost_report`).
4. The other partitions as one range run; the report again: the forecast beside what was measured.

Figures (HEADLINE lines; every one is **simulated**: no GPU):

- how many of the forecast's figures (generated tokens, device-seconds, generating wall) hold the measured
  whole inside their 95% interval (goal: all);
- the range run's device-seconds (the cost table: sum of its partitions' ``cost_device_s``) over servers x
  its generating wall by the simulated servers' own request log (first request in to last reply out);
  goal 0.95-1.05;
- the forecast's device-hours error, |forecast - measured| / measured (no goal: context);
- the user's run (902,087 prompts, ``--servers`` x ``--slots``) forecast from the same pilot, in
  simulated hours (the figures x ``--speed``: the stub's decode time is compressed, so its latencies are
  too); context for docs/scale.md's ~26 h estimate, no goal.

    python bench/bench_cost.py [--servers 7] [--slots 40] [--prompts 2000] [--partitions 10] [--speed 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_node import Node
from headline import headline

USER_PROMPTS = 902_087


def stub_generating_wall(node: Node, since: float) -> float:
    """Real seconds from the first corpus request in to the last reply out after ``since`` (the stub's log)."""
    events = [e for e in node.events() if e["t"] > since and str(e.get("key", "")).startswith("bench")]
    done = [e["t"] for e in events if e["ev"] == "done"]
    return max(done) - min(e["t"] for e in events if e["ev"] == "recv")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=7)
    parser.add_argument("--slots", type=int, default=40)
    parser.add_argument("--tok-per-s", type=float, default=87.5)
    parser.add_argument("--prefill-tok-per-s", type=float, default=9000.0)
    parser.add_argument("--startup-s", type=float, default=180.0)
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--partitions", type=int, default=10)
    parser.add_argument("--speed", type=float, default=10.0, help="simulated seconds per real second")
    parser.add_argument("--keep", action="store_true", help="keep the bench directory")
    args = parser.parse_args()
    args.tail_prompts_per_slot = 4.0  # bench_node's Node reads it; tail chunks stay off here
    base = Path(tempfile.mkdtemp(prefix="bench_cost_"))
    print(f"bench dir: {base}  (cpu cores: {os.cpu_count()})")
    try:
        return run(base, args)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


def run(base: Path, args) -> int:
    os.environ["DFLASH_CONFIG"] = str(base / "cost" / "config.yaml")  # the node's config, for the resources below
    node = Node(base, "cost", args, cap=4096)
    keys = node.make_corpus()
    from dflash_assets.app.cost_report import format_comparison, write_cost_report
    from dflash_assets.app.cost_table import format_cost_table, stage_costs
    from dflash_assets.common.config import resource_fields
    from dflash_assets.stages.forecast import collect_forecast, format_forecast, rows_done
    from dflash_assets.stages.resources.inference import InferenceServerResource
    from dflash_assets.stages.resources.storage import StorageResource

    inference = InferenceServerResource(**resource_fields("inference"))
    store = StorageResource(root=str(node.data)).open()
    rc, pilot_wall = node.run(*node.range_cli(keys[:1]))
    assert rc == 0, "pilot run failed"
    print(f"pilot {keys[0]}: {pilot_wall:.1f} s real")
    with node.instance() as instance:
        forecast = collect_forecast(instance, args.prompts, inference, store)
        print(format_forecast(forecast))
        write_cost_report(store, forecast, stage_costs(instance), rows_done(instance))
        user = collect_forecast(instance, USER_PROMPTS, inference, store)
    since = time.time()
    rc, rest_wall = node.run(*node.range_cli(keys[1:]))
    assert rc == 0, "range run failed"
    print(f"range {keys[1]}...{keys[-1]}: {rest_wall:.1f} s real")
    with node.instance() as instance:
        costs = stage_costs(instance)
        report = write_cost_report(store, None, costs, rows_done(instance))
        metas = [node.materializations([pk])[pk][1] for pk in keys[1:]]
    print(format_cost_table(costs, None))
    print(format_comparison(report))
    rows = report["forecast_vs_actual"]
    inside = sum(bool(r["within"]) for r in rows)
    what = f"simulated node, {args.servers} x {args.slots} slots, {args.prompts} prompts, time x{args.speed:g}"
    headline(
        f"{what}: forecast from 1 partition of {len(keys)} holds the measured whole",
        f"{inside} / {len(rows)}",
        f"{len(rows)} / {len(rows)}",
        inside == len(rows),
    )
    device_s = sum(float(m["cost_device_s"]) for m in metas)
    stub_wall = stub_generating_wall(node, since)
    ratio = device_s / (args.servers * stub_wall)
    print(f"range run: device_s {device_s:.1f} (cost table) vs servers x stub wall {args.servers} x {stub_wall:.2f}")
    headline(
        f"{what}: cost table device-s / (servers x generating wall by the servers' log)",
        ratio,
        "0.95-1.05",
        0.95 <= ratio <= 1.05,
    )
    dev = next(r for r in rows if r["figure"] == "device_s")
    error = abs(dev["forecast_point"] - dev["actual"]) / dev["actual"]
    headline(
        f"{what}: forecast device-hours error from the pilot, |forecast - measured| / measured",
        error,
        "none (context: 95% interval held it: " + str(dev["within"]) + ")",
    )
    gen = user["generation"]
    hours = {k: v * args.speed / 3600 for k, v in gen["wall_s"].items()}
    gpu_h = {k: v * args.speed / 3600 for k, v in user["completions_whole"]["device_s"].items()}
    print(
        f"user's run forecast, simulated hours: wall {json.dumps(hours)}, GPU-h {json.dumps(gpu_h)}, "
        f"tokens {gen['tokens_to_generate']['point']:,.0f}"
    )
    headline(
        f"{what}: the user's {USER_PROMPTS:,} prompts forecast from the pilot, generation wall (simulated h)",
        hours["point"],
        f"none (context: [{hours['low']:.1f}, {hours['high']:.1f}]; docs/scale.md: ~26 h at 25K tok/s)",
    )
    return 0 if inside == len(rows) and 0.95 <= ratio <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
