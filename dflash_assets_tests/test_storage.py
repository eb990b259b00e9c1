"""Storage.write_json writes strict JSON: drafter_evaluation/report.json held a bare NaN (acc at block
position 0), which jq and JavaScript reject."""

from __future__ import annotations

import json
import math

from dflash_assets.storage.store import Storage, finite_json


def _reject(constant: str):
    raise ValueError(f"non-standard JSON constant {constant}")


def test_write_json_turns_non_finite_floats_into_null(tmp_path):
    store = Storage(str(tmp_path))
    report = {
        "acc_per_position": [math.nan, 0.25, 0.5],
        "tau": 1.5,
        "ratio": math.inf,
        "nested": {"low": -math.inf, "k": (1, math.nan)},
    }
    store.write_json(report, "drafter_evaluation", "report.json")
    text = (tmp_path / "drafter_evaluation" / "report.json").read_text()
    parsed = json.loads(text, parse_constant=_reject)  # raises on NaN / Infinity
    assert parsed == {
        "acc_per_position": [None, 0.25, 0.5],
        "tau": 1.5,
        "ratio": None,
        "nested": {"low": None, "k": [1, None]},
    }
    assert finite_json([1, 2.0, "x", None, True]) == [1, 2.0, "x", None, True]


def test_index_ranges_select_the_rows_and_row_groups_a_brute_force_check_does(tmp_path):
    """A range run passes one range per partition: 4,500 of them were OR-ed into one filter expression,
    92 s before planning began (review of the ranged reads). Ranges are merged and looked up by binary
    search; here against a brute-force check on random, overlapping, touching and disjoint ranges."""
    import numpy as np
    import polars as pl
    import pyarrow.parquet as pq

    from dflash_assets.storage.store import in_ranges, merged_ranges, row_groups_overlapping

    rng = np.random.default_rng(3)
    values = np.arange(-5, 400)
    for _ in range(200):
        ranges = [(int(a), int(a + rng.integers(0, 30))) for a in rng.integers(-10, 400, rng.integers(0, 12))]
        brute = np.array([any(a <= v <= b for a, b in ranges) for v in values], dtype=bool)
        assert (in_ranges(values, ranges) == brute).all(), ranges
    assert [x.tolist() for x in merged_ranges([(5, 9), (0, 4), (20, 30), (25, 26), (11, 12)])] == [
        [0, 11, 20],
        [9, 12, 30],
    ]

    store = Storage(str(tmp_path))
    store.write_parquet(
        pl.DataFrame({"index": list(range(100)), "v": list(range(100))}), "t.parquet", row_group_size=10
    )
    metadata = pq.ParquetFile(tmp_path / "t.parquet").metadata
    assert row_groups_overlapping(metadata, "index", [(9, 10), (55, 55), (97, 500)]) == [0, 1, 5, 9]
    assert row_groups_overlapping(metadata, "index", [(100, 200), (-9, -1)]) == []
    many = [(i, i) for i in range(0, 100, 2)]  # 50 one-row ranges
    assert store.read_parquet("t.parquet", columns=["v"], index_ranges=many)["v"].to_list() == list(range(0, 100, 2))
