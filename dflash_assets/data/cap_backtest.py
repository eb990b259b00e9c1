"""Back-tests of the cap advice (no Dagster imports): censor known lengths at a cap c, ask
:func:`~dflash_assets.data.truncation.cap_advice` for cap c' (2c), and compare with the share of the same rows
that a run at c' truncates. Used by bench/bench_cap_advice.py (many back-tests) and the tests (few).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl

from dflash_assets.data.truncation import cap_advice

# The user's job (SCALE.md): completion lengths of median ~1,970 tokens, log-sd ~0.8, cap 4,096 -> 8,192.
USER_MEDIAN, USER_SIGMA, USER_CAP, USER_NEW_CAP = 1970.0, 0.8, 4096, 8192


@dataclass(frozen=True)
class BackTest:
    """One back-test: what the advice said for ``new_cap`` and what the same rows show there (shares 0..1)."""

    dataset: str
    rows: int
    cap: int
    new_cap: int
    observed: float
    predicted: float
    lo: float
    hi: float
    actual: float

    @property
    def covered(self) -> bool:
        return self.lo <= self.actual <= self.hi


def censored_frame(lengths: np.ndarray, cap: int) -> pl.DataFrame:
    """Rows as a completions table censored at ``cap``: L > cap becomes a ``length`` row of cap tokens.
    ``lengths`` may hold ``inf`` (a row known only to run past every cap tested)."""
    cut = lengths > cap
    return pl.DataFrame(
        {
            "completion_tokens": np.where(cut, cap, lengths).astype(np.int64),
            "finish_reason": np.where(cut, "length", "stop"),
            "max_output_tokens": np.full(len(lengths), cap, dtype=np.int64),
        }
    )


def run_backtest(
    dataset: str, lengths: np.ndarray, cap: int, new_cap: int, seed: int = 0, bootstrap: int = 100
) -> BackTest:
    """Censor ``lengths`` (tokens) at ``cap``, predict the truncation rate at ``new_cap``, compare with the truth."""
    advice = cap_advice(
        censored_frame(lengths, cap), cap, multipliers=(new_cap / cap,), bootstrap=bootstrap, seed=seed, target_rate=1.0
    )
    cand = next((c for c in advice["candidates"] if c["cap"] == new_cap), None)
    observed = float(np.mean(lengths > cap))
    actual = float(np.mean(lengths > new_cap))
    if cand is None:  # nothing truncated, or too few finished rows: no advice (see :func:`coverage`)
        return BackTest(dataset, len(lengths), cap, new_cap, observed, math.nan, math.nan, math.nan, actual)
    lo, hi = cand.get("truncation_rate_90ci", [math.nan, math.nan])
    return BackTest(dataset, len(lengths), cap, new_cap, observed, cand["truncation_rate"], lo, hi, actual)


def lognormal_lengths(
    n: int, rng: np.random.Generator, median: float = USER_MEDIAN, sigma: float = USER_SIGMA
) -> np.ndarray:
    """``n`` integer lengths with ln L ~ Normal(ln median, sigma^2)."""
    return np.ceil(np.exp(rng.normal(math.log(median), sigma, n)))


def subsample_backtests(
    dataset: str,
    lengths: np.ndarray,
    caps: list[int],
    rows: int,
    trials: int,
    seed: int = 0,
    bootstrap: int = 100,
    factor: int = 2,
) -> list[BackTest]:
    """``trials`` back-tests per cap: ``rows`` drawn without replacement from ``lengths``, cap c -> factor*c."""
    rng = np.random.default_rng(seed)
    out = []
    for cap in caps:
        for t in range(trials):
            sample = lengths if rows >= len(lengths) else rng.choice(lengths, rows, replace=False)
            out.append(run_backtest(dataset, sample, cap, factor * cap, seed=seed * 1000 + t, bootstrap=bootstrap))
    return out


def advised(tests: list[BackTest]) -> list[BackTest]:
    """The back-tests where the advice gave an interval (it declines with < MIN_FINISHED_ROWS finished rows)."""
    return [t for t in tests if not math.isnan(t.lo)]


def coverage(tests: list[BackTest]) -> float:
    """Share of the advised back-tests whose 90% interval covers the actual rate."""
    tests = advised(tests)
    return sum(t.covered for t in tests) / len(tests) if tests else math.nan
