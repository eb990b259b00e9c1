"""Censored fits of completion lengths: the tail past the generation cap (no Dagster imports).

A ``length`` row only says ``L >= cap``: its length is right-censored. Log-normal and Weibull
distributions are fitted to such a sample by maximum likelihood (uncensored rows contribute the
density, censored rows the survival function; Klein & Moeschberger, *Survival Analysis*, 2nd ed.,
sec. 3.5), and a fit predicts the truncation rate and token cost at another cap
(:func:`predict_cap`). The cap advice built on them is :func:`dflash_assets.data.truncation.cap_advice`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

SQRT2 = math.sqrt(2.0)


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


def fit_censored_lognormal(
    tokens: np.ndarray, censored: np.ndarray, caps: np.ndarray, weights: np.ndarray | None = None
) -> LogNormalFit | None:
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


@dataclass(frozen=True)
class WeibullFit:
    """Weibull lengths: P(L > t) = exp(-(t / scale)^shape), L in tokens."""

    scale: float
    shape: float

    def survival(self, tokens: float) -> float:
        """P(L > tokens)."""
        return math.exp(-((max(tokens, 1e-9) / self.scale) ** self.shape))


def _censored_parts(tokens, censored, caps, weights):
    w = np.ones(len(tokens)) if weights is None else weights
    unc = ~censored
    logs = np.log(np.maximum(tokens[unc], 1.0))
    cap_counts: Counter = Counter()
    for cap, weight in zip(np.log(caps[censored]), w[censored]):
        cap_counts[float(cap)] += float(weight)
    return logs, w[unc], np.array(list(cap_counts.keys())), np.array(list(cap_counts.values()))


def fit_censored_weibull(
    tokens: np.ndarray, censored: np.ndarray, caps: np.ndarray, weights: np.ndarray | None = None
) -> tuple[WeibullFit, float] | None:
    """Maximum-likelihood Weibull fit to right-censored lengths (grid search on log scale and log shape).

    In log length y = ln L the Weibull is a minimum-Gumbel: with z = shape * (y - ln scale), an uncensored
    row adds ln(shape) + z - e^z and a row censored at cap adds -e^z(cap).

    Returns:
        ``(fit, loglik)`` (loglik of ln L, comparable with :func:`censored_loglik` of a log-normal), or
        None with fewer than 2 uncensored rows.
    """
    logs, wu, log_caps, cap_w = _censored_parts(tokens, censored, caps, weights)
    if wu.sum() < 2:
        return None
    mean = float((wu * logs).sum() / wu.sum())
    std = math.sqrt(max(float((wu * logs**2).sum() / wu.sum()) - mean**2, 1e-6))
    loc_lo, loc_hi = mean - 2, mean + 4
    ls_lo, ls_hi = math.log(math.pi / (std * math.sqrt(6))) - 2, math.log(math.pi / (std * math.sqrt(6))) + 2
    best, best_ll = (mean, 1.0), -math.inf
    n_u, s1 = float(wu.sum()), float((wu * logs).sum())
    for _ in range(5):
        locs = np.linspace(loc_lo, loc_hi, 41)[:, None]
        shapes = np.exp(np.linspace(ls_lo, ls_hi, 41))[None, :]
        # sum_i w_i e^{z_i} = e^{-k (loc - mean)} * sum_i w_i e^{k (y_i - mean)}:
        # O(shapes x rows), not O(locs x shapes x rows)
        with np.errstate(over="ignore", invalid="ignore"):  # far grid corners overflow to -inf: never the argmax
            moments = (wu[None, :] * np.exp(np.minimum(shapes[0, :, None] * (logs[None, :] - mean), 700))).sum(-1)[
                None, :
            ]
            ll = (
                n_u * np.log(shapes)
                + shapes * (s1 - locs * n_u)
                - np.exp(np.minimum(-shapes * (locs - mean), 700)) * moments
            )
            for lc, cw in zip(log_caps, cap_w):
                ll = ll - cw * np.exp(np.minimum(shapes * (lc - locs), 700))
            ll = np.where(np.isnan(ll), -np.inf, ll)
        i, j = np.unravel_index(np.argmax(ll), ll.shape)
        best, best_ll = (float(locs[i, 0]), float(shapes[0, j])), float(ll[i, j])
        loc_step, ls_step = (loc_hi - loc_lo) / 40, (ls_hi - ls_lo) / 40
        loc_lo, loc_hi = best[0] - 2 * loc_step, best[0] + 2 * loc_step
        ls_lo, ls_hi = math.log(best[1]) - 2 * ls_step, math.log(best[1]) + 2 * ls_step
    return WeibullFit(scale=math.exp(best[0]), shape=best[1]), best_ll


def censored_loglik(
    fit: LogNormalFit, tokens: np.ndarray, censored: np.ndarray, caps: np.ndarray, weights: np.ndarray | None = None
) -> float:
    """Log-likelihood of ln L under a log-normal ``fit`` for right-censored rows (normal density of the
    log length for uncensored rows, survival at the cap for censored ones)."""
    logs, wu, log_caps, cap_w = _censored_parts(tokens, censored, caps, weights)
    z = (logs - fit.mu) / fit.sigma
    ll = float((wu * (-math.log(fit.sigma) - 0.5 * math.log(2 * math.pi) - 0.5 * z**2)).sum())
    if len(log_caps):
        ll += float((cap_w * _log_survival((log_caps - fit.mu) / fit.sigma)).sum())
    return ll


def fit_families(
    tokens: np.ndarray, censored: np.ndarray, caps: np.ndarray, weights: np.ndarray | None = None
) -> list[tuple[LogNormalFit | WeibullFit, float]]:
    """Log-normal and Weibull fits with their likelihood weights (``exp(loglik)`` normalized; both
    families have 2 parameters, so these are also their Akaike weights). Empty with < 2 uncensored rows."""
    lognormal = fit_censored_lognormal(tokens, censored, caps, weights)
    weibull = fit_censored_weibull(tokens, censored, caps, weights)
    if lognormal is None or weibull is None:
        return []
    lls = np.array([censored_loglik(lognormal, tokens, censored, caps, weights), weibull[1]])
    p = np.exp(lls - lls.max())
    p /= p.sum()
    return [(lognormal, float(p[0])), (weibull[0], float(p[1]))]


def fit_from_dict(fit: dict) -> LogNormalFit | WeibullFit:
    """The fit stored in a report's ``advice.fit`` (a report written before Weibull existed has no family)."""
    fields = {k: v for k, v in fit.items() if k != "family"}
    return WeibullFit(**fields) if fit.get("family") == "weibull" else LogNormalFit(**fields)


def predict_cap(fit: LogNormalFit | WeibullFit, cap: int, observed_rate: float, n_truncated: int, new_cap: int) -> dict:
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
