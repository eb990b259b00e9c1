"""Back-tests of the cap advice: does its 90% interval cover what a run at the larger cap shows?

Each back-test censors known completion lengths at a cap c, asks the advice (truncation_report's
:func:`~dflash_assets.data.truncation.cap_advice`) for cap 2c, and checks whether the 90% interval holds the
share of the same rows that a run at 2c truncates. Data sets:
- ``demo``: the embedded demo's completions (HumanEval x SmolLM2-135M-Instruct, 64 prompts, cap 128,
  bench/data/demo_completion_lengths_cap128.json): predict cap 128 from the rows at cap 64 (48-row draws);
- ``codealpaca``: lengths (SmolLM2 tokens) of the reference answers in ../shared/data (4,535),
  caps at their 50th/75th/90th percentiles, 64- and 512-row draws (the ShareGPT file there is left
  out: its dummy replies end by 27 tokens, a hard ceiling no long-tail length model describes);
- ``user``: a log-normal of the user's shape (median 1,970 tokens, sigma 0.8), cap 4,096 -> 8,192, 64,
  500 and 2,000 rows.
Goal (issue 16): coverage >= 0.90 for the 90% interval, on every data set and overall.

    python bench/bench_cap_advice.py [--trials 20] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from headline import headline

from dflash_assets.data.cap_backtest import (
    USER_CAP,
    USER_NEW_CAP,
    advised,
    coverage,
    lognormal_lengths,
    run_backtest,
    subsample_backtests,
)

SHARED = ROOT.parent / "shared" / "data"
DEMO = ROOT / "bench" / "data" / "demo_completion_lengths_cap128.json"
GOAL = 0.90


def demo_lengths() -> np.ndarray:
    """Demo rows: lengths of rows that stopped; ``inf`` for rows cut at 128 (longer than any cap tested)."""
    d = json.loads(DEMO.read_text())
    return np.array([np.inf if r == "length" else t for t, r in zip(d["completion_tokens"], d["finish_reason"])], float)


def reference_lengths() -> dict[str, np.ndarray]:
    """Token lengths of the reference answers in ../shared/data (skipped when absent)."""
    out = {}
    if not SHARED.exists():
        return out
    from transformers import AutoTokenizer

    from dflash_assets.generation.engines.local_model import ensure_local_model

    tok = AutoTokenizer.from_pretrained(ensure_local_model())
    alpaca = json.loads((SHARED / "codealpaca" / "new_codealpaca.json").read_text())
    texts = [r.get("output") or r.get("response") or "" for r in alpaca]
    out["codealpaca"] = np.array([len(ids) for ids in tok(texts)["input_ids"]], float)
    return {k: v[v > 0] for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="back-tests per data set, cap and size")
    parser.add_argument("--quick", action="store_true", help="5 trials, user and demo data only")
    args = parser.parse_args()
    trials = 5 if args.quick else args.trials
    started = time.monotonic()
    groups: dict[str, list] = {}
    groups["demo"] = subsample_backtests("demo", demo_lengths(), [64], rows=60, trials=trials, seed=1)
    rng = np.random.default_rng(7)
    groups["user"] = [
        run_backtest("user", lognormal_lengths(n, rng), USER_CAP, USER_NEW_CAP, seed=i)
        for n in (64, 500, 2000)
        for i in range(trials)
    ]
    if not args.quick:
        for name, lengths in reference_lengths().items():
            caps = [int(np.percentile(lengths, q)) for q in (50, 75, 90)]
            groups[name] = [
                t for rows in (64, 512) for t in subsample_backtests(name, lengths, caps, rows, trials, seed=rows)
            ]
    everything = [t for g in groups.values() for t in g]
    for name, tests in groups.items():
        declined = len(tests) - len(advised(tests))
        tests = advised(tests)
        widths = [t.hi - t.lo for t in tests if t.hi == t.hi]
        errors = [abs(t.predicted - t.actual) for t in tests if t.predicted == t.predicted]
        print(
            f"{name}: back-tests {len(tests)} (+{declined} with too few finished rows: no advice), coverage of the 90% "
            f"interval {coverage(tests):.3f} (goal >= {GOAL:.2f}); mean width {np.mean(widths):.3f}, mean |predicted - "
            f"actual| {np.mean(errors):.3f} (shares)"
        )
    print(
        f"coverage_ratio (all {len(advised(everything))} advised back-tests): {coverage(everything):.3f}   goal >= "
        f"{GOAL:.2f}"
    )
    headline(
        f"share of {len(advised(everything))} cap-advice back-tests whose 90% interval covers the actual "
        f"truncation rate",
        coverage(everything),
        f">= {GOAL:.2f}",
        coverage(everything) >= GOAL,
    )
    print(f"seconds: {time.monotonic() - started:.0f}")


if __name__ == "__main__":
    main()
