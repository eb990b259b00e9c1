"""The one machine-readable line a bench prints per headline figure, which ``bench/run_all`` collects.

A bench calls :func:`headline` once per figure it is judged by; the line is ``HEADLINE `` followed by a
JSON object ``{"figure", "value", "goal", "met"}``. ``bench/run_all`` copies these objects into
``bench/RESULTS.md`` and ignores every other line, so a bench may print whatever else helps a reader.
"""

from __future__ import annotations

import json
import math

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
