"""Requests a cap change sends, per truncated row, against a full re-run.

Runs the scenario of ``bench/dflash_simulators/cap_change_scenario.py`` (also tested by
``dflash_assets_tests/test_cap_change.py``) on the real CPU server (SmolLM2, greedy) behind a counting proxy:
3 partitions of 2 prompts at a small cap, then the cap is raised and lowered, each time launching only what
the ``generation_settings_changed`` sensor asks for. Prints one ``name: value`` line per figure. Goal: a raise
sends one request per truncated row; a lowering cuts the rows longer than the new cap to it from their own
tokens (:mod:`dflash_assets.data.cap_cut`) and sends a request only for a row whose tokens do not match
its text.

    python bench/bench_cap_change.py [--small 10] [--raised 14] [--lowered 11]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from headline import headline

from dflash_assets.app.automation import request_partitions
from dflash_assets.generation.engines.local_model import ensure_local_model
from dflash_assets.generation.servers.transformers_server import LocalTransformersServer
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_simulators.cap_change_scenario import PROMPTS, run_scenario
from dflash_simulators.counting_proxy import CountingProxy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=10, help="first cap, tokens")
    parser.add_argument("--raised", type=int, default=14, help="raised cap, tokens")
    parser.add_argument("--lowered", type=int, default=11, help="lowered cap, tokens (after the raise)")
    args = parser.parse_args()

    model_dir = ensure_local_model()
    with tempfile.TemporaryDirectory(prefix="bench_cap_change_") as tmp:
        started = time.monotonic()
        with LocalTransformersServer(model_dir, log_path=Path(tmp) / "transformers_serve.log") as server:
            print(f"server_startup_s: {time.monotonic() - started:.1f}")
            with CountingProxy(server.base_url) as proxy:
                inference = InferenceServerResource(
                    mode="external",
                    external={
                        "base_urls": [proxy.base_url],
                        "served_model_name": server.model_name,
                        "backend": "transformers",
                        "tokenizer_path": str(model_dir),
                    },
                    max_running_requests=8,
                    client={"max_attempts": 1},
                )
                scenario = run_scenario(Path(tmp), proxy, inference, [args.small, args.raised, args.lowered])
                upstream_errors = proxy.upstream_errors

    print(f"prompts: {len(PROMPTS)}")
    print(f"partitions: {len(scenario.keys)}")
    print(f"initial_cap: {args.small}")
    print(f"initial_requests: {sum(scenario.initial_requests.values())}")
    print(f"initial_wall_s: {scenario.timings['initial_s']:.1f}")
    print(f"upstream_errors: {upstream_errors}")
    before = scenario.initial
    for change, label in zip(scenario.changes, ("raise", "lower")):
        if label == "raise":
            touched = before.truncated()
        else:
            touched = before.longer_than(change.new_cap)
        n_touched = sum(len(rows) for rows in touched.values())
        sent = sum(change.requested.values())
        partitions = sorted(pk for rr in change.run_requests for pk in request_partitions(rr, scenario.keys))  # ranges
        rows_in_partitions = sum(len(before.rows[pk]) for pk in partitions)
        print(f"{label}_cap: {change.new_cap}")
        print(f"{label}_partitions_rerun: {len(partitions)} of {len(scenario.keys)}")
        print(f"{label}_touched_rows: {n_touched}")
        print(f"{label}_requests_sent: {sent}")
        print(
            f"{label}_requests_per_touched_row: {sent / n_touched:.2f}"
            if n_touched
            else f"{label}_requests_per_touched_row: n/a"
        )
        # a lowered cap cuts the longer rows to it locally (no request) when their tokens match their text
        cut = (
            sum(1 for rows in change.after.rows.values() for r in rows if r.get("cut_from_tokens"))
            if label == "lower"
            else 0
        )
        if label == "lower":
            print(f"lower_rows_cut_locally: {cut} of {n_touched} touched (no request)")
        need = n_touched - cut
        what = "touched rows not cut locally" if label == "lower" else "touched rows"
        print(
            f"{label}: requests sent {sent} / {what} {need} (goal: equal: {'met' if sent == need else 'NOT met'}); "
            f"a full re-run would send {len(PROMPTS) / n_touched:.2f} per touched row"
            if n_touched
            else f"{label}: no touched row"
        )
        if n_touched:
            local = f"; {cut} of {n_touched} touched rows cut locally" if label == "lower" else ""
            headline(
                f"cap {label} to {change.new_cap}: requests sent / {what} (a full re-run sends {len(PROMPTS)}{local})",
                f"{sent} / {need}",
                "equal",
                sent == need,
            )
        print(f"{label}_full_rerun_would_send: {len(PROMPTS)} ({len(PROMPTS) / n_touched:.2f} per touched row)")
        print(f"{label}_partition_rerun_would_send: {rows_in_partitions}")
        print(f"{label}_wall_s: {change.wall_s:.1f}")
        before = change.after
    for name, seconds in scenario.timings.items():
        print(f"{name}: {seconds:.1f}")
    print(f"sensor_after_changes: {type(scenario.skip_after[0]).__name__}")


if __name__ == "__main__":
    main()
