"""Run-to-run spread of the demo drafter's acceptance length: retrain it with several seeds on one demo's data.

Uses the hidden states and prompt corpus of a finished demo run (``python -m dflash_assets run``) and
materializes ``dflash_drafter`` + ``drafter_evaluation`` once per seed, with the demo config file's
settings, in a temporary instance and storage root (the demo's own outputs are not touched). A seed
changes the drafter's initialisation, data order and anchors; the held-out prompts and the target are
the same. Prints tau and the untrained drafter's tau per seed, the spread (max - min) across seeds, and
the margin (lowest trained tau - highest untrained tau); the evaluation runs with ``untrained_baseline: true``
(the demo's main job leaves the untrained drafter out).

Usage: .venv/bin/python bench/bench_drafter_seeds.py [--dagster-home DIR] [--seeds 0 1 2] [--max-steps N]
(default DIR: $DAGSTER_HOME, else the project root; about 5 minutes per seed on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import dagster as dg
import yaml
from headline import headline

from dflash_assets.assets.drafter import dflash_drafter
from dflash_assets.assets.evaluation import drafter_evaluation
from dflash_assets.common.config import config_path
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource

ROOT = Path(__file__).resolve().parent.parent


def bench_resources(root: str, resources_cfg: dict) -> dict:
    """The resources of dflash_drafter and drafter_evaluation: the config file's, storage at ``root``
    (drafter_evaluation also takes the inference servers' settings, for its engine mode)."""
    return {
        "storage": StorageResource(root=root),
        "target_model": TargetModelResource(**resources_cfg.get("target_model", {})),
        "inference": InferenceServerResource(**resources_cfg.get("inference", {})),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dagster-home", default=os.environ.get("DAGSTER_HOME") or str(ROOT))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=None, help="override the config's dflash_drafter max_steps")
    args = parser.parse_args()
    data_root = Path(args.dagster_home) / "dflash_data"
    if not (data_root / "hidden_states").is_dir():
        raise SystemExit(
            f"{data_root}/hidden_states not found: run `python -m dflash_assets run` with "
            f"DAGSTER_HOME={args.dagster_home} first"
        )
    project = yaml.safe_load(config_path().read_text())
    ops, resources_cfg = project.get("ops", {}), project.get("resources", {})
    keys = sorted(p.name for p in (data_root / "hidden_states").iterdir() if (p / "index.json").exists())
    rows = []
    with tempfile.TemporaryDirectory() as tmp, dg.instance_for_test() as instance:
        for name in ("hidden_states", "prompt_corpus"):
            os.symlink(data_root / name, Path(tmp) / name)
        instance.add_dynamic_partitions(prompt_ranges.name, keys)
        resources = bench_resources(tmp, resources_cfg)
        for seed in args.seeds:
            train_config = dict(ops.get("dflash_drafter", {}).get("config", {}), seed=seed)
            if args.max_steps:
                train_config["max_steps"] = args.max_steps
            run_config = {
                "ops": {
                    "dflash_drafter": {"config": train_config},
                    # the untrained drafter is opt-in (the demo leaves it out); the margin needs it
                    "drafter_evaluation": {
                        "config": dict(ops.get("drafter_evaluation", {}).get("config", {}), untrained_baseline=True)
                    },
                }
            }
            started = time.monotonic()
            result = dg.materialize(
                [dflash_drafter, drafter_evaluation], instance=instance, resources=resources, run_config=run_config
            )
            meta = {
                k: getattr(v, "value", v)
                for k, v in result.asset_materializations_for_node("drafter_evaluation")[-1].metadata.items()
            }
            rows.append(
                (
                    seed,
                    meta["tau"],
                    meta["tau_stderr"],
                    meta["tau_untrained"],
                    meta["lossless"],
                    meta["num_prompts"],
                    time.monotonic() - started,
                )
            )
            print(
                f"seed {seed}: tau {meta['tau']:.4f} +- {meta['tau_stderr']:.4f} (untrained "
                f"{meta['tau_untrained']:.4f}), lossless {meta['lossless']}, {meta['num_prompts']} held-out prompts, "
                f"{rows[-1][-1]:.0f} s",
                flush=True,
            )
    taus = [r[1] for r in rows]
    untrained = [r[3] for r in rows]
    print(f"\n{len(keys)} partitions from {data_root}; config {config_path()}")
    print(f"{'seed':>4} {'tau':>8} {'stderr':>8} {'untrained':>10} {'lossless':>9} {'prompts':>8} {'wall s':>7}")
    for seed, tau, se, tau0, lossless, n, wall in rows:
        print(f"{seed:>4} {tau:>8.4f} {se:>8.4f} {tau0:>10.4f} {lossless!s:>9} {n:>8} {wall:>7.0f}")
    spread = max(taus) - min(taus)
    margin = min(taus) - max(untrained)
    sd = statistics.stdev(taus) if len(taus) > 1 else 0.0
    print(f"tau across seeds: mean {statistics.mean(taus):.4f}, std {sd:.4f}, spread (max - min) {spread:.4f}")
    print(
        f"margin (lowest trained tau - highest untrained tau) {margin:.4f}; margin / spread "
        f"{margin / spread if spread else float('inf'):.1f} (goal > 1: {'met' if margin > spread else 'NOT met'})"
    )
    headline(
        f"tau of {len(taus)} seeds "
        + ", ".join(f"{t:.2f}" for t in taus)
        + f" (untrained {max(untrained):.2f}): margin (lowest trained - highest untrained) / spread across seeds",
        margin / spread if spread else float("inf"),
        "> 1",
        margin > spread,
    )
    return 0 if margin > spread else 1


if __name__ == "__main__":
    raise SystemExit(main())
