"""Storage.write_json writes strict JSON: drafter_evaluation/report.json held a bare NaN (acc at block
position 0), which jq and JavaScript reject."""

from __future__ import annotations

import json
import math

from dflash_assets.storage import Storage, finite_json


def _reject(constant: str):
    raise ValueError(f"non-standard JSON constant {constant}")


def test_write_json_turns_non_finite_floats_into_null(tmp_path):
    store = Storage(str(tmp_path))
    report = {"acc_per_position": [math.nan, 0.25, 0.5], "tau": 1.5, "ratio": math.inf, "nested": {"low": -math.inf, "k": (1, math.nan)}}
    store.write_json(report, "drafter_evaluation", "report.json")
    text = (tmp_path / "drafter_evaluation" / "report.json").read_text()
    parsed = json.loads(text, parse_constant=_reject)  # raises on NaN / Infinity
    assert parsed == {"acc_per_position": [None, 0.25, 0.5], "tau": 1.5, "ratio": None, "nested": {"low": None, "k": [1, None]}}
    assert finite_json([1, 2.0, "x", None, True]) == [1, 2.0, "x", None, True]
