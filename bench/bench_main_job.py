"""The README's main job as a user runs it: ``python -m dflash_assets run`` on a fresh ``DAGSTER_HOME``.

Times the whole command (embedded default: SmolLM2-135M served on CPU, HumanEval prompts, local storage),
records the peak RSS of its largest process, and reads the drafter's acceptance length from the report it
writes (``drafter_evaluation/report.json``: tau on the held-out prompts as the mean of per-prompt means,
its standard error, the untrained drafter's tau and the lossless check). A second run of the same
command must do no work, so it is timed too. Completions are sampled, so tau varies from run to run
(``bench_drafter_seeds`` measures the spread).

Usage: .venv/bin/python bench/bench_main_job.py [--dagster-home DIR] [--config FILE]
(DIR: kept afterwards, e.g. for bench_drafter_seeds; default a temporary directory, removed.
About 6-7 minutes on 2 idle cores.)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from headline import headline


def run_main_job(home: Path, config: str | None) -> tuple[int, float]:
    """Run ``python -m dflash_assets run`` with ``DAGSTER_HOME=home``, its output going to ours as it comes
    (a bench stopped by a timeout still shows how far the job got); returns (exit code, wall seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DFLASH_STORAGE_ROOT", "DFLASH_CONFIG")}
    env["DAGSTER_HOME"] = str(home)
    cmd = [sys.executable, "-m", "dflash_assets", "run"] + (["--config", config] if config else [])
    started = time.monotonic()
    sys.stdout.flush()
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    return proc.returncode, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dagster-home", type=Path, default=None, help="kept afterwards; must be empty or absent")
    parser.add_argument("--config", default=None, help="the run's --config (default: the embedded demo)")
    args = parser.parse_args()
    home = args.dagster_home or Path(tempfile.mkdtemp(prefix="bench_main_job_"))
    if home.exists() and any(home.iterdir()):
        raise SystemExit(f"--dagster-home {home} is not empty: the bench measures a fresh run; give a new directory")
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    try:
        code, wall = run_main_job(home, args.config)
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        print(
            f"main job: exit {code}, {wall:.0f} s, peak RSS of its largest process {peak_mb:.0f} MB, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
        )
        if code != 0:
            headline("main job on a fresh DAGSTER_HOME: exit code", code, "0", False)
            return 1
        headline(
            f"main job on a fresh DAGSTER_HOME, minutes (peak RSS {peak_mb / 1024:.1f} GB)",
            wall / 60,
            "none (context: what a user waits)",
        )
        report = json.loads((home / "dflash_data" / "drafter_evaluation" / "report.json").read_text())
        heldout = report["datasets"]["heldout"]
        trained, untrained = heldout["trained"], heldout["untrained"]
        headline(
            f"main job: drafter tau on {heldout['num_prompts']} held-out prompts, mean of per-prompt means "
            f"(+- {trained['tau_stderr']:.2f}; untrained {untrained['tau']:.2f})",
            trained["tau"],
            "> the untrained drafter's",
            trained["tau"] > untrained["tau"],
        )
        lossless = all(d[k]["lossless"] for d in report["datasets"].values() for k in ("trained", "untrained"))
        headline(
            "main job: greedy speculative output equals the target's", "yes" if lossless else "no", "yes", lossless
        )
        code2, wall2 = run_main_job(home, args.config)
        headline("main job run again with nothing changed: seconds (it does no work)", round(wall2), "none (context)")
        return code2
    finally:
        if args.dagster_home is None:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
