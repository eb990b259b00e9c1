"""The drafter against the free baseline: generated tokens per target forward for plain decoding, the engine's
n-gram (prompt lookup) speculation and the trained drafter, on the same prompts, and who wins.

Why this unit and not tau: tau (``1 + accepted / drafts``) counts only the steps that drafted, and n-gram lookup
drafts nothing where the context holds no match, so its tau would leave those steps out. Tokens per target
forward counts every forward, prefill included: ``generated tokens / target forwards``, 1.0 for plain decoding
(one token per forward) and, for a drafter that drafts at every step, ``(1 + sum L) / (1 + steps)`` with ``L``
the accepted length of each verification step. Per dataset the headline is pooled (all tokens / all forwards,
what throughput sees), with the mean of per-prompt values beside it, each with its standard error across prompts
(:func:`~dflash_assets.dflash.decoding.tau.tau_from_sums`).

Acceptance per draft position, for every method in one unit: the share of decode forwards (forwards after the
prefill) whose k-th drafted token was accepted; a step that drafted nothing counts as not accepted. vLLM's own
per-position rate (accepted / drafts) is kept beside it as ``acceptance_per_position``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from dflash_assets.dflash.decoding.evaluation import first_divergence
from dflash_assets.dflash.decoding.tau import tau_from_sums

CHECK_BASELINE = "drafter_beats_ngram"
PLAIN = 1.0  # plain decoding: one token per target forward, by definition


def _clean(x):
    return None if isinstance(x, float) and math.isnan(x) else x


def tokens_per_forward(pairs: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """Tokens per target forward of a dataset from ``(generated tokens, target forwards)`` per prompt (forwards
    counting the prefill, so >= 1; a pair with 0 forwards is left out).

    Returns:
        ``tokens_per_forward`` (pooled: sum of tokens / sum of forwards) and ``tokens_per_forward_stderr`` (the
        ratio estimator's, clustered by prompt), ``tokens_per_forward_mean`` (mean of per-prompt ratios) and its
        ``..._stderr``, ``prompts``, ``generated_tokens``, ``target_forwards``; figures None without a prompt.
    """
    kept = [(float(t), int(f)) for t, f in pairs if f > 0]
    sums = tau_from_sums(kept)
    return {
        "tokens_per_forward": _clean(sums["tau_pooled"]),
        "tokens_per_forward_stderr": sums["tau_pooled_stderr"] if kept else None,
        "tokens_per_forward_mean": _clean(sums["tau"]),
        "tokens_per_forward_mean_stderr": sums["tau_stderr"] if kept else None,
        "prompts": len(kept),
        "generated_tokens": int(sum(t for t, _ in kept)),
        "target_forwards": int(sum(f for _, f in kept)),
    }


def engine_forward_figures(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """:func:`tokens_per_forward` of one dataset's engine records (vLLM's: ``completion_tokens``, ``forwards``,
    ``drafts``, ``accepted_per_position``; records with an ``error`` or no ``forwards`` left out), plus
    ``decode_forwards`` (forwards after each prompt's prefill), ``draft_rate`` (decode forwards that drafted) and
    ``accepted_per_decode_step`` (per draft position: accepted / decode forwards)."""
    ok = [r for r in records if "error" not in r and r.get("forwards")]
    out = tokens_per_forward([(r["completion_tokens"], r["forwards"]) for r in ok])
    decode = sum(r["forwards"] - 1 for r in ok)
    width = max((len(r.get("accepted_per_position") or []) for r in ok), default=0)
    accepted = [sum((r.get("accepted_per_position") or [0] * width)[k] for r in ok) for k in range(width)]
    out["decode_forwards"] = decode
    out["draft_rate"] = sum(r.get("drafts") or 0 for r in ok) / decode if decode else None
    out["accepted_per_decode_step"] = [a / decode for a in accepted] if decode else []
    return out


def in_process_forward_figures(accepted_lengths: Sequence[Sequence[int]], block_size: int) -> dict[str, Any]:
    """:func:`tokens_per_forward` of one dataset decoded in process, from each prompt's accepted lengths per
    verification step (``L`` in ``[1, block_size]``, the bonus token counted; the prefill's token and forward
    are not listed): tokens ``1 + sum L``, forwards ``1 + len(L)`` (a hybrid target's rollback passes, which run
    only its linear-attention mixers, are not counted). Plus ``decode_forwards`` and ``accepted_per_decode_step``
    (draft position k accepted iff ``L >= k + 2``, over all steps)."""
    out = tokens_per_forward([(1 + sum(v), 1 + len(v)) for v in accepted_lengths])
    steps = [int(x) for v in accepted_lengths for x in v]
    out["decode_forwards"] = len(steps)
    out["draft_rate"] = 1.0 if steps else None
    out["accepted_per_decode_step"] = (
        [sum(1 for x in steps if x >= k + 2) / len(steps) for k in range(block_size - 1)] if steps else []
    )
    return out


#: the drafter beats n-gram lookup when its pooled tokens-per-forward ratio exceeds 1 by this many paired
#: standard errors (and loses when it falls short of 1 by as many)
MARGIN_IN_STDERR = 2.0
#: context-length buckets of the split, in prompt tokens (upper bounds; the last is open)
CONTEXT_BUCKETS = (512, 1024, 2048)


def paired_ratio(pairs: Sequence[tuple[float, float, float, float]]) -> dict[str, Any]:
    """Method A against method B on the same prompts, from ``(tokens_a, forwards_a, tokens_b, forwards_b)`` per
    prompt (pairs with a zero forward count left out).

    The verdict's statistic is the ratio of the pooled (token-weighted) tokens per target forward,
    ``R = (sum t_a / sum f_a) / (sum t_b / sum f_b)``; its standard error is the paired one, by the delta method on
    ``log R`` clustered by prompt (Cochran, *Sampling Techniques*, 6.3, applied to each ratio estimator and their
    difference): ``Var(log R) = m/(m-1) * sum_i z_i^2`` with ``z_i = (t_ai - tau_a f_ai) / sum t_a - (t_bi - tau_b
    f_bi) / sum t_b``, so a prompt both methods find easy or hard moves both and cancels. Beside it, the mean of
    per-prompt differences of tokens per forward and its standard error.

    Returns:
        ``ratio``, ``ratio_stderr``, ``ratio_z`` (``(R - 1) / stderr``), ``a``, ``b`` (pooled tokens per forward),
        ``mean_difference``, ``mean_difference_stderr``, ``prompts``; figures None without a prompt.
    """
    kept = [tuple(float(x) for x in p) for p in pairs if p[1] > 0 and p[3] > 0]
    m = len(kept)
    if not m:
        return {"ratio": None, "ratio_stderr": None, "ratio_z": None, "a": None, "b": None, "prompts": 0,
                "mean_difference": None, "mean_difference_stderr": None}  # fmt: skip
    ta, fa = sum(p[0] for p in kept), sum(p[1] for p in kept)
    tb, fb = sum(p[2] for p in kept), sum(p[3] for p in kept)
    tau_a, tau_b = ta / fa, tb / fb
    ratio = tau_a / tau_b
    z = [(t1 - tau_a * f1) / ta - (t2 - tau_b * f2) / tb for t1, f1, t2, f2 in kept]
    se = ratio * math.sqrt(m / (m - 1) * sum(x * x for x in z)) if m > 1 else 0.0
    diffs = [t1 / f1 - t2 / f2 for t1, f1, t2, f2 in kept]
    md = sum(diffs) / m
    md_se = math.sqrt(sum((d - md) ** 2 for d in diffs) / (m - 1) / m) if m > 1 else 0.0
    return {
        "ratio": ratio,
        "ratio_stderr": se,
        "ratio_z": (ratio - 1.0) / se if se > 0 else None,
        "a": tau_a,
        "b": tau_b,
        "mean_difference": md,
        "mean_difference_stderr": md_se,
        "prompts": m,
    }


def context_bucket(tokens: int) -> str:
    """The context-length bucket of a prompt of ``tokens`` tokens: ``<=512``, ``513-1024``, ... ``>2048``."""
    low = 0
    for high in CONTEXT_BUCKETS:
        if tokens <= high:
            return f"<={high}" if low == 0 else f"{low + 1}-{high}"
        low = high
    return f">{CONTEXT_BUCKETS[-1]}"


def paired_engine_figures(
    drafter: Sequence[Mapping[str, Any]],
    ngram: Sequence[Mapping[str, Any]],
    groups: Mapping[tuple[str, int], Mapping[str, str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per dataset, the drafter's engine records against n-gram lookup's on the same prompts (records with
    ``dataset``, ``position``, ``completion_tokens``, ``forwards``; errors left out): :func:`paired_ratio` with
    the drafter as A, plus ``by_<split>`` for every split ``groups`` gives each prompt (``{(dataset, position):
    {"turn kind": "tool call", "context tokens": "<=512"}}``): the same figures per group."""
    theirs = {(r["dataset"], r["position"]): r for r in ngram if "error" not in r and r.get("forwards")}
    pairs: dict[str, list[tuple[tuple[str, int], tuple]]] = {}
    for r in drafter:
        key = (r["dataset"], r["position"])
        if "error" in r or not r.get("forwards") or key not in theirs:
            continue
        other = theirs[key]
        row = (r["completion_tokens"], r["forwards"], other["completion_tokens"], other["forwards"])
        pairs.setdefault(r["dataset"], []).append((key, row))
    out = {}
    for name, rows in pairs.items():
        figures = paired_ratio([row for _, row in rows])
        for split in dict.fromkeys(s for key, _ in rows for s in (groups or {}).get(key, {})):
            by: dict[str, list] = {}
            for key, row in rows:
                by.setdefault((groups or {}).get(key, {}).get(split, "-"), []).append(row)
            figures[f"by {split}"] = {g: paired_ratio(v) for g, v in sorted(by.items())}
        out[name] = figures
    return out


def verdict(paired: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """``(winner, sentence)`` from :func:`paired_ratio`'s figures (the drafter as A, n-gram lookup as B): winner
    ``"drafter"`` when the pooled ratio exceeds 1 by more than :data:`MARGIN_IN_STDERR` paired standard errors,
    ``"ngram"`` when it falls short of 1 by as many, ``"tie"`` within the noise; ``(None, None)`` without a paired
    prompt."""
    if not paired or paired.get("ratio") is None:
        return None, None
    r, se, k = paired["ratio"], paired["ratio_stderr"] or 0.0, MARGIN_IN_STDERR
    winner = "drafter" if r - k * se > 1 else ("ngram" if r + k * se < 1 else "tie")
    outcome = {
        "drafter": f"the drafter wins by more than {k:g} standard errors",
        "ngram": f"the drafter loses by more than {k:g} standard errors",
        "tie": f"within {k:g} standard errors of a tie",
    }[winner]
    text = (
        f"DFlash {paired['a']:.2f} vs n-gram lookup {paired['b']:.2f} tokens per forward (no training), pooled over "
        f"{paired['prompts']} prompts in one vLLM run each: {r:.2f}x +- {se:.2f} (paired standard error): {outcome}"
    )
    return winner, text


def compare_methods(
    in_process_datasets: Mapping[str, Mapping[str, Any]] | None,
    engine_section: Mapping[str, Any] | None,
    groups: Mapping[tuple[str, int], Mapping[str, str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per dataset, tokens per target forward of every method measured, and who wins.

    Args:
        in_process_datasets: the report's in-process ``datasets`` (``[name]["trained"]["accepted_lengths"]`` and
            ``block_size``), or None.
        engine_section: the report's ``engine`` section (a real vLLM one: ``datasets[name]["forwards"]``,
            ``requests`` and the ``ngram`` / ``plain`` sections), or None.
        groups: each prompt's groups for the splits (see :func:`paired_engine_figures`).

    Returns:
        ``{dataset: {"plain": 1.0, "plain_engine", "drafter_engine", "drafter_in_process", "ngram": figures or None,
        "drafter": the drafter's pooled figure (the engine's, else the in-process one), "drafter_source",
        "ngram_tokens_per_forward", "paired" (:func:`paired_engine_figures`: the verdict's statistic and the
        splits), "statistic" (what the verdict uses), "margin" (drafter - n-gram), "winner", "verdict"}}``.
    """
    engine = engine_section or {}
    real_vllm = engine.get("kind") == "vllm" and not engine.get("simulated")
    drafter_engine = {n: d.get("forwards") for n, d in (engine.get("datasets") or {}).items()} if real_vllm else {}
    ngram = {n: d.get("forwards") for n, d in ((engine.get("ngram") or {}).get("datasets") or {}).items()}
    plain = {n: d.get("forwards") for n, d in ((engine.get("plain") or {}).get("datasets") or {}).items()}
    paired = (
        paired_engine_figures(engine.get("requests") or [], (engine.get("ngram") or {}).get("requests") or [], groups)
        if real_vllm
        else {}
    )
    local = {}
    for name, d in (in_process_datasets or {}).items():
        run = d.get("trained") or {}
        if run.get("accepted_lengths") is not None:
            lengths = [v for v in run["accepted_lengths"] if v is not None]
            local[name] = in_process_forward_figures(lengths, int(run["block_size"]))
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys([*local, *drafter_engine, *ngram]):
        eng, loc, ng = drafter_engine.get(name), local.get(name), ngram.get(name)
        source = "engine" if eng and eng.get("tokens_per_forward") is not None else ("in-process" if loc else None)
        drafter = (eng if source == "engine" else loc or {}).get("tokens_per_forward")
        ngram_value = (ng or {}).get("tokens_per_forward")
        winner, sentence = verdict(paired.get(name))
        out[name] = {
            "plain": PLAIN,
            "plain_engine": plain.get(name),
            "drafter_engine": eng,
            "drafter_in_process": loc,
            "ngram": ng,
            "drafter": drafter,
            "drafter_source": source,
            "ngram_tokens_per_forward": ngram_value,
            "paired": paired.get(name),
            "statistic": "pooled (token-weighted) tokens per target forward, DFlash / n-gram lookup on the same "
            f"prompts, with its paired standard error; a win needs the ratio above 1 by {MARGIN_IN_STDERR:g} of them",
            "margin": None if drafter is None or ngram_value is None else drafter - ngram_value,
            "winner": winner,
            "verdict": sentence,
        }
    return out


def baseline_check(comparison: Mapping[str, Mapping[str, Any]], why_not: str | None = None) -> dict[str, Any]:
    """The non-blocking check: the trained drafter makes more tokens per target forward than n-gram lookup, by more
    than :data:`MARGIN_IN_STDERR` paired standard errors (:func:`verdict`), on every dataset where both were
    measured. ``{"passed", "reasons", "compared"}`` (+ ``why`` when nothing was compared: ``why_not``, or no
    dataset with both figures)."""
    rows = {n: c for n, c in comparison.items() if c.get("winner") is not None}
    if not rows:
        return {"passed": True, "reasons": [], "compared": False, "why": why_not or "no n-gram baseline measured"}
    reasons = [f"{n}: {c['verdict']}" for n, c in rows.items() if c["winner"] != "drafter"]
    return {"passed": not reasons, "reasons": reasons, "compared": True}


def ngram_lossless(
    ngram_records: Sequence[Mapping[str, Any]], expected: Mapping[str, Sequence[Sequence[int]]], method: str = "ngram"
) -> list[str]:
    """One line per dataset where the engine's output of ``method`` (``ngram``: its n-gram lookup; ``plain``: plain
    decoding) differs from ``expected`` (dataset -> greedy output ids per prompt position, None where unknown),
    naming the prompt and the generated token."""
    reasons = []
    for name, plain in expected.items():
        ok = [
            r
            for r in ngram_records
            if r.get("dataset") == name
            and "error" not in r
            and r["position"] < len(plain)
            and plain[r["position"]] is not None
        ]
        where = first_divergence([plain[r["position"]] for r in ok], [r["output_ids"] for r in ok])
        if where is not None:
            what = "n-gram output" if method == "ngram" else "plain decoding output"
            reasons.append(
                f"{name}: the engine's {what} differs from the greedy output at prompt "
                f"{ok[where['prompt']]['position']}, generated token {where['token']} (expected id "
                f"{where['expected']}, got {where['actual']})"
            )
    return reasons


def comparison_table(comparison: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown: per dataset, tokens per target forward of plain decoding, n-gram lookup and the drafter (engine, in
    process), DFlash / n-gram with its paired standard error and the winner; then the splits (turn kind, context
    length) of each dataset."""

    def f(fig):
        if not fig or fig.get("tokens_per_forward") is None:
            return "-"
        return f"{fig['tokens_per_forward']:.3f} +- {fig['tokens_per_forward_stderr']:.3f}"

    def ratio(p):
        return "-" if not p or p.get("ratio") is None else f"{p['ratio']:.3f} +- {p['ratio_stderr']:.3f}"

    rows = "".join(
        f"| {n} | {(c.get('paired') or {}).get('prompts', '-')} | 1.000 | {f(c['ngram'])} | {f(c['drafter_engine'])} "
        f"| {f(c['drafter_in_process'])} | {ratio(c.get('paired'))} | {c['winner'] or '-'} |\n"
        for n, c in comparison.items()
    )
    splits = ""
    for n, c in comparison.items():
        for split, by in ((k, v) for k, v in (c.get("paired") or {}).items() if k.startswith("by ")):
            splits += (
                f"\n{n}, {split}:\n\n| group | prompts | n-gram | DFlash | DFlash / n-gram |\n|---|---|---|---|---|\n"
            )
            splits += "".join(
                f"| {g} | {p['prompts']} | {_num(p['b'])} | {_num(p['a'])} | {ratio(p)} |\n" for g, p in by.items()
            )
    return (
        "tokens per target forward (pooled, +- standard error across prompts); DFlash / n-gram: the ratio of the "
        "pooled figures with its paired standard error (the verdict's statistic)\n\n"
        "| dataset | prompts | plain | n-gram lookup (engine) | DFlash (engine) | DFlash (in process) "
        "| DFlash / n-gram | winner |\n|---|---|---|---|---|---|---|---|\n" + rows + splits
    )


def _num(x) -> str:
    return "-" if x is None else f"{x:.3f}"


__all__ = [
    "CHECK_BASELINE",
    "CONTEXT_BUCKETS",
    "MARGIN_IN_STDERR",
    "PLAIN",
    "baseline_check",
    "compare_methods",
    "comparison_table",
    "context_bucket",
    "engine_forward_figures",
    "in_process_forward_figures",
    "ngram_lossless",
    "paired_engine_figures",
    "paired_ratio",
    "tokens_per_forward",
    "verdict",
]
