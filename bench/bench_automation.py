"""Time and instance (SQL) queries of one backfill-schedule tick and one cap-change-sensor tick.

The project's own schedule and sensor (dflash_assets.definitions) are evaluated through Dagster's
``evaluate_tick`` on a real SQLite instance holding N completions partitions: a third missing, the rest
materialized (runless materializations with the completions metadata the sensor reads; a quarter of
them with rows cut at cap 4,096), the sensor ticking at cap 8,192. SQL statements are counted with a
SQLAlchemy ``before_cursor_execute`` listener on every engine. Goal: the query count of a tick does
not grow with the partition count (compare the N rows). Before this change a tick made ~4,000
statements at 1,000 partitions (2 instance queries per unfinished partition), the sensor ~1 per partition.

    python bench/bench_automation.py [--partitions 100 1000] [--disk]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dagster as dg
from headline import headline
from sqlalchemy import event
from sqlalchemy.engine import Engine

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.ranges import partition_keys
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.target_model import TargetModelResource


class StatementCounter:
    """Counts SQL statements sent by any SQLAlchemy engine while ``counting`` is on."""

    def __init__(self) -> None:
        self.count, self.counting = 0, False
        event.listen(Engine, "before_cursor_execute", self._on_execute)

    def _on_execute(self, *args, **kwargs) -> None:
        if self.counting:
            self.count += 1

    def measure(self, fn):
        self.count, self.counting = 0, True
        started = time.perf_counter()
        try:
            result = fn()
        finally:
            self.counting = False
        return result, time.perf_counter() - started, self.count


def populate(instance: dg.DagsterInstance, n: int) -> None:
    keys = partition_keys(n * 10, 10)
    instance.add_dynamic_partitions(prompt_ranges.name, keys)
    fingerprint = GenerationSettings().sampling_fingerprint()
    for i, pk in enumerate(keys):
        if i % 3 == 1:
            continue  # missing
        cut = i % 4 == 0
        instance.report_runless_asset_event(
            dg.AssetMaterialization(
                "completions",
                partition=pk,
                metadata={
                    "rows": 10,
                    "errors": 0,
                    "finish_reasons": {"stop": 8, "length": 2} if cut else {"stop": 10},
                    "length_row_caps": [4096] if cut else [],
                    "settings_fingerprints": [fingerprint],
                    "completion_tokens_max": 4096 if cut else 900,
                    "completion_tokens_missing": 0,
                },
            )
        )
    # later stages done for half the finished partitions, so the schedule's downstream pass has work too
    for i, pk in enumerate(keys):
        if i % 3 != 1 and i % 2 == 0:
            for stage in ("tokenized_sequences", "hidden_states"):
                instance.report_runless_asset_event(dg.AssetMaterialization(stage, partition=pk))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, nargs="+", default=[100, 1000])
    parser.add_argument(
        "--disk",
        action="store_true",
        help="instance on disk (default: /dev/shm, set-up is faster; counts are the same)",
    )
    args = parser.parse_args()

    from dflash_assets.definitions import defs

    repo = defs.get_repository_def()
    schedule = repo.get_schedule_def("backfill_unfinished_partitions")
    sensor = repo.get_sensor_def("generation_settings_changed")
    counter = StatementCounter()
    base = None if args.disk or not os.path.isdir("/dev/shm") else "/dev/shm"
    print(f"storage: SQLite in {'a temp dir on disk' if base is None else '/dev/shm'}; cpus: {os.cpu_count()}")
    rows = []
    for n in args.partitions:
        with (
            tempfile.TemporaryDirectory(dir=base, prefix="bench_automation_") as home,
            dg.instance_for_test(temp_dir=home) as instance,
        ):
            populate(instance, n)
            ticks = [
                counter.measure(
                    lambda: schedule.evaluate_tick(dg.build_schedule_context(instance=instance, repository_def=repo))
                )
                for _ in range(2)
            ]  # the first tick also fills Dagster's partition status cache
            _, first_s, first_q = ticks[0]
            sched, sched_s, sched_q = ticks[1]
            ctx = dg.build_sensor_context(
                instance=instance,
                repository_def=repo,
                resources={
                    "generation": GenerationResource(max_output_tokens=8192),
                    "target_model": TargetModelResource(),
                },
            )
            sens, sens_s, sens_q = counter.measure(functools.partial(sensor.evaluate_tick, ctx))
        rows.append((n, sched_q, sched_s, len(sched.run_requests), sens_q, sens_s, len(sens.run_requests)))
        print(
            f"partitions {n}: first schedule tick (status cache filled) {first_q} SQL statements, {first_s * 1000:.0f} "
            "ms"
        )
        print(
            f"partitions {n}: schedule tick {sched_q} SQL statements, {sched_s * 1000:.0f} ms, "
            f"{len(sched.run_requests)} run requests (error: {sched.skip_message or 'none'}); sensor tick {sens_q} SQL "
            f"statements, {sens_s * 1000:.0f} ms, {len(sens.run_requests)} run requests"
        )
    if len(rows) >= 2:
        (n0, sq0, _, _, eq0, _, _), (n1, sq1, _, _, eq1, _, _) = rows[0], rows[-1]
        print(
            f"schedule statements {n0} -> {n1} partitions: {sq0} -> {sq1} (ratio {sq1 / max(sq0, 1):.2f}; goal <= 1.1, "
            f"bounded, not {n1 / n0:.0f}: {'met' if sq1 <= 1.1 * sq0 else 'NOT met'})"
        )
        print(
            f"sensor statements {n0} -> {n1} partitions: {eq0} -> {eq1} (ratio {eq1 / max(eq0, 1):.2f}; goal <= 1.1, "
            f"bounded, not {n1 / n0:.0f}: {'met' if eq1 <= 1.1 * eq0 else 'NOT met'})"
        )
        headline(
            f"schedule tick SQL statements at {n1} / at {n0} partitions ({sq1} / {sq0})",
            sq1 / max(sq0, 1),
            "<= 1.1 (bounded)",
            sq1 <= 1.1 * sq0,
        )
        headline(
            f"sensor tick SQL statements at {n1} / at {n0} partitions ({eq1} / {eq0})",
            eq1 / max(eq0, 1),
            "<= 1.1 (bounded)",
            eq1 <= 1.1 * eq0,
        )


if __name__ == "__main__":
    main()
