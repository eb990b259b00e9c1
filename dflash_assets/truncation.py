"""Truncation statistics and cap advice over completions tables (no Dagster imports).

Lengths of truncated rows are right-censored: a ``length`` row only says ``L >= cap``. The tail beyond
the cap is estimated by a log-normal fitted by maximum likelihood to the censored sample (uncensored
rows contribute the density, censored rows the survival function; e.g. Klein & Moeschberger,
*Survival Analysis*, 2nd ed., sec. 3.5). The prediction at a candidate cap C' > cap is anchored to the
observed truncation rate: P(L > C') = P(L > cap)_observed * S(C') / S(cap), so the fit only decides how
the tail thins out. A Poisson bootstrap of the rows gives a 90% interval.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from dflash_assets.figures import figure_png_bytes, new_figure

SQRT2 = math.sqrt(2.0)

#: The completions columns the report and the cap advice read: never the reasoning / answer text or the
#: token ids, which are nearly all of a partition's bytes (about 6 KB of text per row for the user's model).
REPORT_COLUMNS = ("source", "finish_reason", "completion_tokens", "max_output_tokens", "error",
                  "truncated_in_reasoning", "empty_answer")


def read_report_columns(store, *parts: str, columns: tuple[str, ...] = REPORT_COLUMNS) -> pl.DataFrame:
    """Only ``columns`` of a Parquet file under a :class:`~dflash_assets.storage.Storage` (those present).

    Opens the file through the storage's filesystem and reads the column chunks of those columns alone
    (on S3: ranged GETs), so memory and transfer scale with the few small columns, not the text.
    Remote reads are retried like every storage call. Raises FileNotFoundError when the file is missing.
    """
    path = store.path(*parts)

    def read():
        with store.fs.open(path, "rb") as f:
            parquet = pq.ParquetFile(f)
            present = [c for c in columns if c in parquet.schema_arrow.names]
            return parquet.read(columns=present)

    return pl.from_arrow(store.call("get", parts, read))


@dataclass(frozen=True)
class LogNormalFit:
    """Parameters of ln L ~ Normal(mu, sigma^2), L in tokens."""

    mu: float
    sigma: float

    def survival(self, tokens: float) -> float:
        """P(L > tokens)."""
        return 0.5 * math.erfc((math.log(max(tokens, 1e-9)) - self.mu) / (self.sigma * SQRT2))


def _log_survival(z: np.ndarray) -> np.ndarray:
    erfc = np.vectorize(math.erfc)
    return np.log(np.maximum(0.5 * erfc(z / SQRT2), 1e-300))


def fit_censored_lognormal(tokens: np.ndarray, censored: np.ndarray, caps: np.ndarray, weights: np.ndarray | None = None) -> LogNormalFit | None:
    """Maximum-likelihood log-normal fit to right-censored lengths, by coarse-to-fine grid search.

    Args:
        tokens: completion_tokens per row (float, >= 1).
        censored: bool per row, True where the row hit its cap (finish_reason ``length``).
        caps: the cap (tokens) each censored row hit.
        weights: optional row weights (for the bootstrap).

    Returns:
        The fit, or None with fewer than 2 uncensored rows.
    """
    w = np.ones(len(tokens)) if weights is None else weights
    unc = ~censored
    logs = np.log(np.maximum(tokens[unc], 1.0))
    wu = w[unc]
    n_u = wu.sum()
    if n_u < 2:
        return None
    s1, s2 = (wu * logs).sum(), (wu * logs**2).sum()
    cap_counts: Counter = Counter()
    for cap, weight in zip(np.log(caps[censored]), w[censored]):
        cap_counts[float(cap)] += float(weight)
    log_caps = np.array(list(cap_counts.keys()))
    cap_w = np.array(list(cap_counts.values()))
    mean, std = s1 / n_u, math.sqrt(max(s2 / n_u - (s1 / n_u) ** 2, 1e-6))
    mu_lo, mu_hi, ls_lo, ls_hi = mean - 2, mean + 4, math.log(std) - 2, math.log(std) + 2
    best = (mean, std)
    for _ in range(5):
        mus = np.linspace(mu_lo, mu_hi, 41)[:, None]
        sigmas = np.exp(np.linspace(ls_lo, ls_hi, 41))[None, :]
        ll = -n_u * np.log(sigmas) - (s2 - 2 * mus * s1 + n_u * mus**2) / (2 * sigmas**2)
        for lc, cw in zip(log_caps, cap_w):
            ll = ll + cw * _log_survival((lc - mus) / sigmas)
        i, j = np.unravel_index(np.argmax(ll), ll.shape)
        best = (float(mus[i, 0]), float(sigmas[0, j]))
        mu_step, ls_step = (mu_hi - mu_lo) / 40, (ls_hi - ls_lo) / 40
        mu_lo, mu_hi = best[0] - 2 * mu_step, best[0] + 2 * mu_step
        ls_lo, ls_hi = math.log(best[1]) - 2 * ls_step, math.log(best[1]) + 2 * ls_step
    return LogNormalFit(*best)


def predict_cap(fit: LogNormalFit, cap: int, observed_rate: float, n_truncated: int, new_cap: int) -> dict:
    """Predicted truncation rate and token cost of regenerating the truncated rows at ``new_cap``.

    The rate is ``observed_rate * S(new_cap) / S(cap)`` (at most 1) in both directions: below the cap the
    fit rests on uncensored lengths, so a lowered cap is predicted too (the cost fields then describe no
    regeneration: ``tokens_to_generate = n_truncated * cap``, ``extra_output_tokens = 0``).

    Returns a dict with ``truncation_rate``, ``tokens_to_generate`` (the truncated rows regenerated in
    full, each costing E[min(L, new_cap) | L > cap]) and ``extra_output_tokens`` (growth of the dataset).
    """
    s_cap = max(fit.survival(cap), 1e-12)
    rate = min(observed_rate * fit.survival(new_cap) / s_cap, 1.0) if new_cap != cap else observed_rate
    grid = np.linspace(cap, max(new_cap, cap), 256)
    surv = np.array([fit.survival(t) for t in grid]) / s_cap
    mean_len = cap + float(np.sum((surv[1:] + surv[:-1]) / 2 * np.diff(grid)))
    return {
        "cap": int(new_cap),
        "truncation_rate": float(rate),
        "requests": int(n_truncated),
        "tokens_to_generate": float(n_truncated * mean_len),
        "extra_output_tokens": float(n_truncated * (mean_len - cap)),
    }


def cap_advice(frame: pl.DataFrame, cap: int, multipliers=(1.25, 1.5, 2.0), bootstrap: int = 100, seed: int = 0,
               target_rate: float = 0.05, max_cap: int = 32768) -> dict:
    """Advice for candidate caps: predicted truncation rate (with 90% bootstrap interval) and tokens.

    Candidates are ``cap * m`` for each multiplier; while the largest one's predicted truncation rate is
    still above ``target_rate``, the cap is doubled again (the last step clipped to ``max_cap``), so a
    heavily truncated run (say 75% at 128 tokens) is shown a cap that fixes it, not only 2x.

    Args:
        frame: completions rows without errors (``completion_tokens``, ``finish_reason``, ``max_output_tokens``).
        cap: the current cap (tokens).
        target_rate: stop doubling once a candidate's predicted truncation rate is at or below this share.
        max_cap: largest cap offered by doubling (tokens; e.g. the model's context length).

    Returns:
        ``current_cap``, ``observed_truncation_rate``, ``truncated_rows``, ``method``, ``fit`` ({mu, sigma}
        or None), ``candidates`` (dicts of :func:`predict_cap` plus ``truncation_rate_90ci``), and ``note``
        when there is nothing to advise or ``max_cap`` still leaves more than ``target_rate`` truncated.
    """
    tokens = frame["completion_tokens"].to_numpy().astype(float)
    censored = (frame["finish_reason"] == "length").to_numpy()
    caps = frame["max_output_tokens"].to_numpy().astype(float)
    n, n_trunc = len(tokens), int(censored.sum())
    observed = n_trunc / n if n else 0.0
    fit = fit_censored_lognormal(tokens, censored, caps)
    result = {
        "current_cap": cap, "observed_truncation_rate": observed, "truncated_rows": n_trunc,
        "method": "log-normal MLE on right-censored lengths, tail anchored at the observed rate; 90% Poisson-bootstrap interval",
        "fit": None, "candidates": [],
    }
    if fit is None or n_trunc == 0:
        result["note"] = "no truncated rows: every completion stopped on its own" if n_trunc == 0 else "too few finished rows to fit"
        return result
    result["fit"] = {"mu": fit.mu, "sigma": fit.sigma}
    rng = np.random.default_rng(seed)
    boot_fits = []
    for _ in range(bootstrap):
        w = rng.poisson(1.0, n).astype(float)
        f = fit_censored_lognormal(tokens, censored, caps, w)
        if f is not None and w.sum() > 0:
            boot_fits.append((f, float((w * censored).sum() / w.sum())))

    def candidate(new_cap: int) -> dict:
        pred = predict_cap(fit, cap, observed, n_trunc, new_cap)
        rates = [predict_cap(f, cap, r, n_trunc, new_cap)["truncation_rate"] for f, r in boot_fits]
        if rates:
            pred["truncation_rate_90ci"] = [float(np.percentile(rates, 5)), float(np.percentile(rates, 95))]
        return pred

    for m in multipliers:
        result["candidates"].append(candidate(round(cap * m)))
    last = result["candidates"][-1]
    while last["truncation_rate"] > target_rate and last["cap"] < max_cap:
        last = candidate(min(2 * last["cap"], max_cap))
        result["candidates"].append(last)
    if last["truncation_rate"] > target_rate:
        result["note"] = f"even at {last['cap']} tokens about {last['truncation_rate']:.1%} would still be cut"
    return result


def row_counts(frame: pl.DataFrame) -> tuple[pl.DataFrame, dict]:
    """The rows without an error, and the counts both the completions metadata and the truncation report give.

    Returns:
        ``(ok, counts)``: ``ok`` is ``frame`` filtered to ``error`` null; ``counts`` holds, in this order,
        ``rows`` (all rows), ``finish_reasons`` (finish_reason -> rows among ``ok``, sorted by reason, a
        missing one counted as ``"none"``), ``errors`` (rows with an error), ``truncated_in_reasoning``
        and ``empty_answer`` (rows of ``ok`` flagged so).
    """
    ok = frame.filter(pl.col("error").is_null())
    return ok, {
        "rows": frame.height,
        "finish_reasons": dict(sorted(Counter(ok["finish_reason"].fill_null("none").to_list()).items())),
        "errors": frame.height - ok.height,
        "truncated_in_reasoning": int(ok["truncated_in_reasoning"].sum()),
        "empty_answer": int(ok["empty_answer"].sum()),
    }


def token_summary(tokens: np.ndarray) -> dict:
    """``p50``/``p90``/``p99`` (``np.percentile``, linear interpolation), ``max``, ``mean`` and ``total`` of
    completion lengths in tokens; for an empty array every value is None except ``total`` = 0.

    Raises:
        ValueError: ``tokens`` holds NaN (a null completion_tokens read as float): ``max`` cannot be an int.
    """
    if not tokens.size:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None, "total": 0}
    return {
        "p50": float(np.percentile(tokens, 50)),
        "p90": float(np.percentile(tokens, 90)),
        "p99": float(np.percentile(tokens, 99)),
        "max": int(tokens.max()),
        "mean": float(tokens.mean()),
        "total": int(tokens.sum()),
    }


def truncation_stats(frame: pl.DataFrame) -> dict:
    """Counts and percentiles over completions rows (errors counted apart).

    Returns the :func:`row_counts` counts, ``truncation_rate`` (share of ``length`` among finished rows),
    ``per_partition``/``per_source`` rates and ``completion_tokens`` (:func:`token_summary`).
    """
    ok, counts = row_counts(frame)
    n = ok.height

    def rates(by: str) -> dict:
        g = ok.group_by(by).agg(rows=pl.len(), truncated=(pl.col("finish_reason") == "length").sum()).sort(by)
        return {r[by]: {"rows": r["rows"], "truncated": r["truncated"], "rate": r["truncated"] / r["rows"]} for r in g.iter_rows(named=True)}

    return {
        **counts,
        "truncation_rate": float((ok["finish_reason"] == "length").sum() / n) if n else 0.0,
        "per_partition": rates("partition") if "partition" in ok.columns else {},
        "per_source": rates("source"),
        # a row an old server returned without usage has no token count: left out of the percentiles, not NaN
        "completion_tokens": token_summary(ok["completion_tokens"].drop_nulls().to_numpy()),
        "completion_tokens_missing": int(ok["completion_tokens"].is_null().sum()),
    }


def length_histogram_png(tokens: np.ndarray, cap: int, title: str) -> bytes:
    """PNG bytes of a completion-length histogram with the cap drawn as a vertical line."""
    fig, ax = new_figure(figsize=(7, 3.5), dpi=100)
    ax.hist(tokens, bins=min(60, max(5, len(set(tokens.tolist())))), color="#4a7ab5")
    ax.axvline(cap, color="#c0392b", linestyle="--", label=f"cap = {cap} tokens")
    ax.set_xlabel("completion tokens")
    ax.set_ylabel("rows")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return figure_png_bytes(fig)
