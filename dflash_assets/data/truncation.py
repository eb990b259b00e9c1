"""Truncation statistics and cap advice over completions tables (no Dagster imports).

Lengths of truncated rows are right-censored: a ``length`` row only says ``L >= cap``. The tail beyond the
cap is estimated by fits to the censored sample (:mod:`dflash_assets.data.length_fits`). The prediction at a
candidate cap C' > cap is anchored to the observed truncation rate: P(L > C') = P(L > cap)_observed * S(C')
/ S(cap), so the fit only decides how the tail thins out.

The tail beyond the cap is never observed, so the family matters: a log-normal and a Weibull are both
fitted; the one with the higher censored likelihood (same number of parameters) gives the prediction.
The 90% interval is a predictive interval for what re-running the same prompts at C' shows: a Poisson
bootstrap of the rows in which each replicate refits BOTH families and contributes both (the data below
the cap rarely rules either out, e.g. when most rows are truncated), then draws how many of the
truncated rows run past C' (binomial, the replicate's S(C')/S(cap) each). Its 2.5-97.5 percentiles are
reported as the 90% interval: the 5-95 percentiles covered only 0.83 in back-tests. Back-tests (predict cap 2c from
the rows at cap c, bench/bench_cap_advice.py) check that it covers the actual >= 90% of the time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import polars as pl

from dflash_assets.common.figures import figure_png_bytes, new_figure
from dflash_assets.data.length_fits import LogNormalFit, fit_families, predict_cap
from dflash_assets.generation.rows.records import PROMPT_TOO_LONG

# Percentiles of the bootstrap predictive taken as the "90%" interval: the plain 5/95 covered 0.83 of
# the back-tests (bench/bench_cap_advice.py; bootstrap intervals of a tail extrapolation run narrow).
INTERVAL_PERCENTILES = (2.5, 97.5)
# Fewer rows that stopped below the cap than this and no family is fitted (2-3 points fit anything).
MIN_FINISHED_ROWS = 4

#: The completions columns the report and the cap advice read: never the reasoning / answer text or the
#: token ids, which are nearly all of a partition's bytes (about 6 KB of text per row for the user's model).
REPORT_COLUMNS = (
    "source",
    "finish_reason",
    "completion_tokens",
    "max_output_tokens",
    "error",
    "truncated_in_reasoning",
    "empty_answer",
    "prompt_tokens",
    "context_length",
    "turn_kind",
    "tool_call",
)
#: The truncation report's turn kinds (issue 43): what the regenerated turn did, else what its context was.
TURN_KINDS = {
    "tool_call": "tool-call turn",  # the turn called a tool, whatever came before
    "after_tool": "answer after tools",  # the context ends with a tool result, the turn answered in text
    "follow_up": "conversation turn",  # a user request with tools offered, or after earlier turns
    "prompt": "single-turn prompt",  # one user message (rows made before turn kinds were kept count here)
}


def read_report_columns(store, *parts: str, columns: tuple[str, ...] = REPORT_COLUMNS) -> pl.DataFrame:
    """Only ``columns`` of a Parquet file under a :class:`~dflash_assets.storage.store.Storage` (those present).

    Reads the column chunks of those columns alone (on S3: ranged GETs), so memory and transfer scale
    with the few small columns, not the text. Remote reads are retried like every storage call.
    Raises FileNotFoundError when the file is missing.
    """
    return store.read_parquet(*parts, columns=columns)


#: How :func:`cap_advice` predicts, as its result says.
ADVICE_METHOD = (
    "censored MLE of a log-normal and a Weibull, the likelier one predicts, tail anchored at the "
    "observed rate; 90% predictive interval: Poisson bootstrap refitting both families, and a "
    "binomial draw of the truncated rows"
)


def _fit_summary(fit) -> dict:
    """A fitted family's parameters as the advice reports them."""
    if isinstance(fit, LogNormalFit):
        return {"family": "lognormal", "mu": fit.mu, "sigma": fit.sigma}
    return {"family": "weibull", "scale": fit.scale, "shape": fit.shape}


def _bootstrap_fits(tokens, censored, caps, bootstrap: int, rng: np.random.Generator) -> list[tuple[object, float]]:
    """``(fit, truncated share)`` of both families in each of ``bootstrap`` Poisson-weighted replicates (the data
    below the cap rarely rules one family out)."""
    boot_fits = []
    for _ in range(bootstrap):
        w = rng.poisson(1.0, len(tokens)).astype(float)
        fams = fit_families(tokens, censored, caps, w) if w.sum() > 0 else []
        for f, _ in fams:
            boot_fits.append((f, float((w * censored).sum() / w.sum())))
    return boot_fits


def cap_advice(
    frame: pl.DataFrame,
    cap: int,
    multipliers=(1.25, 1.5, 2.0),
    bootstrap: int = 100,
    seed: int = 0,
    target_rate: float = 0.05,
    max_cap: int = 32768,
    prompt_lengths: np.ndarray | None = None,
    room_at: Callable[[int], int | None] | None = None,
) -> dict:
    """Advice for candidate caps: predicted truncation rate (with 90% bootstrap interval) and tokens, and how
    many prompts each cap leaves no room for under the servers' context.

    Candidates are ``cap * m`` for each multiplier; while the largest one's predicted truncation rate is
    still above ``target_rate``, the cap is doubled again (the last step clipped to ``max_cap``), so a
    heavily truncated run (say 75% at 128 tokens) is shown a cap that fixes it, not only 2x.

    Args:
        frame: completions rows without errors (``completion_tokens``, ``finish_reason``, ``max_output_tokens``).
        cap: the current cap (tokens).
        target_rate: stop doubling once a candidate's predicted truncation rate is at or below this share.
        max_cap: largest cap offered by doubling (tokens; e.g. the model's context length).
        prompt_lengths: templated prompt tokens of every prompt whose length is known (generated rows and rows
            set aside as too long); with ``room_at``, each candidate (and the current cap) gets
            ``prompts_over_context``: how many of them would be set aside at that cap.
        room_at: ``room_at(cap)``, the longest prompt that fits with that cap (tokens), None when the context is
            unknown (:meth:`~dflash_assets.common.settings.GenerationSettings.prompt_room`).

    Returns:
        ``current_cap``, ``observed_truncation_rate``, ``truncated_rows``, ``method``, ``fit`` ({family, mu, sigma} or
        {family, scale, shape}, or None), ``candidates`` (dicts of :func:`predict_cap` plus ``truncation_rate_90ci``),
        and ``note`` when there is nothing to advise or ``max_cap`` still leaves more than ``target_rate`` truncated.
    """
    tokens = frame["completion_tokens"].to_numpy().astype(float)
    censored = (frame["finish_reason"] == "length").to_numpy()
    caps = frame["max_output_tokens"].to_numpy().astype(float)
    n, n_trunc = len(tokens), int(censored.sum())
    observed = n_trunc / n if n else 0.0
    families = fit_families(tokens, censored, caps)
    result = {
        "current_cap": cap,
        "observed_truncation_rate": observed,
        "truncated_rows": n_trunc,
        "method": ADVICE_METHOD,
        "fit": None,
        "candidates": [],
    }

    def over(at_cap: int) -> dict:
        room = room_at(at_cap) if room_at is not None and prompt_lengths is not None else None
        return {} if room is None else {"prompts_over_context": int((prompt_lengths > room).sum())}

    result.update(over(cap))
    if not families or n_trunc == 0 or n - n_trunc < MIN_FINISHED_ROWS:
        result["note"] = (
            "no truncated rows: every completion stopped on its own"
            if n_trunc == 0
            else f"too few finished rows to fit ({n - n_trunc}; at least {MIN_FINISHED_ROWS} needed): "
            f"at a larger cap truncation is somewhere in 0-{observed:.0%}"
        )
        return result
    fit = max(families, key=lambda fw: fw[1])[0]
    result["fit"] = _fit_summary(fit)
    result["family_weights"] = {"lognormal": families[0][1], "weibull": families[1][1]}
    rng = np.random.default_rng(seed)
    boot_fits = _bootstrap_fits(tokens, censored, caps, bootstrap, rng)
    draws = rng.random((len(boot_fits), n_trunc))  # one uniform per truncated row and replicate: binomial draws

    def candidate(new_cap: int) -> dict:
        pred = {**predict_cap(fit, cap, observed, n_trunc, new_cap), **over(new_cap)}
        rates = []
        for (f, r), u in zip(boot_fits, draws):
            if new_cap > cap:
                # of the n_trunc rows cut at cap, each runs past new_cap with the replicate's S(new_cap)/S(cap)
                q = min(f.survival(new_cap) / max(f.survival(cap), 1e-12), 1.0)
                rates.append(float((u < q).sum()) / n)
            else:
                rates.append(predict_cap(f, cap, r, n_trunc, new_cap)["truncation_rate"])
        if rates:
            pred["truncation_rate_90ci"] = [
                float(np.percentile(rates, INTERVAL_PERCENTILES[0])),
                float(np.percentile(rates, INTERVAL_PERCENTILES[1])),
            ]
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
        ``(ok, counts)``: ``ok`` is ``frame`` filtered to ``error`` null and to rows that were generated (not
        set aside as too long for the context, :data:`PROMPT_TOO_LONG`); ``counts`` holds, in this order,
        ``rows`` (all rows), ``finish_reasons`` (finish_reason -> rows without an error, set-aside ones included,
        sorted by reason, a missing one counted as ``"none"``), ``errors`` (rows with an error),
        ``prompt_too_long`` (rows set aside, never sent), ``truncated_in_reasoning`` and ``empty_answer`` (rows of
        ``ok`` flagged so).
    """
    no_error = frame.filter(pl.col("error").is_null())
    ok = no_error.filter(pl.col("finish_reason").ne_missing(PROMPT_TOO_LONG))
    return ok, {
        "rows": frame.height,
        "finish_reasons": dict(sorted(Counter(no_error["finish_reason"].fill_null("none").to_list()).items())),
        "errors": frame.height - no_error.height,
        "prompt_too_long": no_error.height - ok.height,
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


def turn_kind_labels(frame: pl.DataFrame) -> pl.Series:
    """Each row's :data:`TURN_KINDS` label: ``tool-call turn`` where ``tool_call`` is true, else by ``turn_kind``
    (a null or missing one, a row made before turn kinds were kept, counts as a single-turn prompt)."""
    n = frame.height
    called = frame["tool_call"].fill_null(False) if "tool_call" in frame.columns else pl.Series([False] * n)
    kind = frame["turn_kind"].fill_null("prompt") if "turn_kind" in frame.columns else pl.Series(["prompt"] * n)
    labels = [TURN_KINDS["tool_call"] if c else TURN_KINDS.get(k, k) for c, k in zip(called.to_list(), kind.to_list())]
    return pl.Series("turn", labels, dtype=pl.String)


def _rate(frame: pl.DataFrame, column: str, value: str) -> dict | None:
    rows = frame.filter(pl.col(column) == value)
    if not rows.height:
        return None
    truncated = int((rows["finish_reason"] == "length").sum())
    return {"rows": rows.height, "truncated": truncated, "rate": truncated / rows.height}


def truncation_stats(frame: pl.DataFrame) -> dict:
    """Counts and percentiles over completions rows (errors counted apart).

    Returns the :func:`row_counts` counts, ``truncation_rate`` (share of ``length`` among finished rows),
    ``per_partition``/``per_source`` rates, ``per_turn_kind`` (by :func:`turn_kind_labels`, kinds with rows) and
    ``per_source_turn_kind`` (``"<source> / <label>"``) rates, and ``completion_tokens`` (:func:`token_summary`).
    """
    ok, counts = row_counts(frame)
    n = ok.height

    def rates(by: str) -> dict:
        g = ok.group_by(by).agg(rows=pl.len(), truncated=(pl.col("finish_reason") == "length").sum()).sort(by)
        return {
            r[by]: {"rows": r["rows"], "truncated": r["truncated"], "rate": r["truncated"] / r["rows"]}
            for r in g.iter_rows(named=True)
        }

    kinds = ok.with_columns(turn=turn_kind_labels(ok))
    per_kind = {}
    for r in (
        kinds.group_by("source", "turn")
        .agg(rows=pl.len(), truncated=(pl.col("finish_reason") == "length").sum())
        .sort("source", "turn")
        .iter_rows(named=True)
    ):
        per_kind[f"{r['source']} / {r['turn']}"] = {
            "rows": r["rows"],
            "truncated": r["truncated"],
            "rate": r["truncated"] / r["rows"],
        }
    return {
        **counts,
        "truncation_rate": float((ok["finish_reason"] == "length").sum() / n) if n else 0.0,
        "per_partition": rates("partition") if "partition" in ok.columns else {},
        "per_source": rates("source"),
        "per_turn_kind": {
            label: stats for label, stats in ((lab, _rate(kinds, "turn", lab)) for lab in TURN_KINDS.values()) if stats
        },
        "per_source_turn_kind": per_kind,
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


def turn_kind_markdown(per_source_turn_kind: dict[str, dict]) -> str:
    """A Markdown table of rows and truncation per source and turn kind (``truncation_stats``'
    ``per_source_turn_kind``)."""
    lines = ["| source / turn kind | rows | truncated | rate |", "|---|---|---|---|"]
    for key, v in per_source_turn_kind.items():
        lines.append(f"| {key} | {v['rows']} | {v['truncated']} | {v['rate']:.1%} |")
    return "\n".join(lines)


def cap_advice_markdown(advice: dict) -> str:
    """The cap advice (:func:`cap_advice`) as a markdown table for the UI: per candidate cap, the predicted
    truncation rate and its 90% interval, requests, tokens to generate and extra tokens; the note when
    there is no candidate."""
    if not advice["candidates"]:
        return advice.get("note", "")

    def interval(c: dict) -> str:
        if "truncation_rate_90ci" not in c:
            return "-"
        low, high = (100 * x for x in c["truncation_rate_90ci"])
        return f"{low:.2f}%\u2013{high:.2f}%"  # an en dash between the bounds, as the report writes them

    context = "prompts_over_context" in advice  # the servers' context is known: each cap's set-aside prompts
    rows = "\n".join(
        f"| {c['cap']} | {c['truncation_rate']:.2%} | {interval(c)} | "
        f"{c['requests']} | {c['tokens_to_generate']:.0f} | {c['extra_output_tokens']:.0f} |"
        + (f" {c.get('prompts_over_context', '-')} |" if context else "")
        for c in advice["candidates"]
    )
    return (
        f"Method: {advice['method']}.\n\n| cap | predicted truncation | 90% interval | requests | tokens to generate, "
        "whole | extra tokens (to generate, continued) |"
        + (" prompts over the context |" if context else "")
        + "\n|---|---|---|---|---|---|"
        + ("---|" if context else "")
        + "\n"
        + rows
    )
