"""Cap advice that keeps its promise (issue 16: at cap 256 it predicted 45.7% truncation with a 90% interval
of 31.3-61.6%; the actual was 25.0%). Fewer back-tests than bench/bench_cap_advice.py: predict cap 2c from
the rows at cap c on the user's shape (log-normal, median 1,970, sigma 0.8, cap 4,096 -> 8,192) and on the
demo's own completions; the 90% interval must cover the actual in >= 90% of them."""

import json
from pathlib import Path

import numpy as np

from dflash_assets.data.cap_backtest import (
    USER_CAP,
    USER_NEW_CAP,
    advised,
    censored_frame,
    coverage,
    lognormal_lengths,
    run_backtest,
    subsample_backtests,
)
from dflash_assets.data.truncation import cap_advice

DEMO = Path(__file__).resolve().parents[1] / "bench" / "data" / "demo_completion_lengths_cap128.json"


def test_user_shape_back_tests_cover_at_least_90_percent():
    rng = np.random.default_rng(3)
    tests = [
        run_backtest("user", lognormal_lengths(n, rng), USER_CAP, USER_NEW_CAP, seed=i, bootstrap=60)
        for n in (64, 500)
        for i in range(10)
    ]
    assert len(advised(tests)) == 20
    assert coverage(tests) >= 0.9, [(t.lo, t.actual, t.hi) for t in tests if not t.covered]
    large = [t for t in tests if t.rows == 500]
    assert np.mean([t.hi - t.lo for t in large]) < 0.06  # informative at 500 rows: a few points of truncation wide


def test_demo_data_back_tests_cover_and_too_few_finished_rows_get_no_false_precision():
    d = json.loads(DEMO.read_text())
    lengths = np.array(
        [np.inf if r == "length" else t for t, r in zip(d["completion_tokens"], d["finish_reason"])], float
    )
    tests = subsample_backtests("demo", lengths, [64], rows=60, trials=6, seed=1, bootstrap=60)
    assert advised(tests) and coverage(tests) >= 0.9
    # 2 rows stopped below the cap: no fit, and the note says what is known (0 .. the current rate)
    advice = cap_advice(censored_frame(np.array([10, 20] + [np.inf] * 30), 64), 64)
    assert advice["candidates"] == [] and "too few finished rows to fit (2; at least 4 needed)" in advice["note"]
    assert "0-94%" in advice["note"]
