"""The one machine-readable line a bench prints per headline figure, which ``bench/run_all`` collects.

A bench calls :func:`headline` once per figure it is judged by; the line is ``HEADLINE `` followed by a
JSON object ``{"figure", "value", "goal", "met"}``. ``bench/run_all`` copies these objects into
``bench/RESULTS.md`` and ignores every other line, so a bench may print whatever else helps a reader.
Also the CPU steal readings (:func:`cpu_steal_counters`) that ``run_all`` and timed benches report beside a time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

PREFIX = "HEADLINE "


def headline(figure: str, value: float | int | str, goal: str, met: bool | None = None) -> None:
    """Print one headline figure.

    figure: what was measured and against which baseline, e.g. "pipeline / bare client output tok/s".
    value: the number (rounded to 3 decimals when a float) or a short text such as "3 / 3".
    goal: the goal it is judged against, e.g. ">= 0.9", or "none (context: ...)" for a figure with none.
    met: whether the goal was met; None when there is no goal or it cannot be judged here.
    """
    if isinstance(value, float):
        value = round(value, 3) if math.isfinite(value) else str(value)
    print(PREFIX + json.dumps({"figure": figure, "value": value, "goal": goal, "met": met}), flush=True)


def parse(line: str) -> dict | None:
    """The object of a ``HEADLINE`` line, or None for any other line (or a damaged one)."""
    if not line.startswith(PREFIX):
        return None
    try:
        obj = json.loads(line[len(PREFIX) :])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and {"figure", "value", "goal"} <= obj.keys() else None


def cpu_steal_counters() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from /proc/stat (Linux), None elsewhere. Steal is the time the hypervisor
    ran other guests while this one had work: 40% of it was seen on the 2-core VM mid-session (``vmstat``'s
    ``st``), every stage of the main job ~25% slower at a load average that read as idle."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return values[7], sum(values)


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen between two :func:`cpu_steal_counters` readings, None when unknown."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])
