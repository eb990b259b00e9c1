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


def verdict(drafter: float | None, ngram: float | None) -> tuple[str | None, str | None]:
    """``(winner, sentence)``: winner ``"drafter"`` (strictly more tokens per forward), ``"ngram"`` or ``"tie"``
    (equal to 2 decimals: what the sentence shows); ``(None, None)`` when either figure is missing."""
    if drafter is None or ngram is None:
        return None, None
    d, n = round(drafter, 2), round(ngram, 2)
    winner = "tie" if d == n else ("drafter" if drafter > ngram else "ngram")
    outcome = {"drafter": "the drafter wins", "ngram": "the drafter loses", "tie": "a tie"}[winner]
    text = f"DFlash {d:.2f} vs n-gram lookup {n:.2f} tokens per forward (no training): {outcome} on these prompts"
    return winner, text


def compare_methods(
    in_process_datasets: Mapping[str, Mapping[str, Any]] | None, engine_section: Mapping[str, Any] | None
) -> dict[str, dict[str, Any]]:
    """Per dataset, tokens per target forward of every method measured, and who wins.

    Args:
        in_process_datasets: the report's in-process ``datasets`` (``[name]["trained"]["accepted_lengths"]`` and
            ``block_size``), or None.
        engine_section: the report's ``engine`` section (a real vLLM one: ``datasets[name]["forwards"]`` and
            ``ngram.datasets``), or None.

    Returns:
        ``{dataset: {"plain": 1.0, "drafter_engine", "drafter_in_process", "ngram": figures or None,
        "drafter": the drafter's pooled figure the verdict uses (the engine's, else the in-process one),
        "drafter_source", "ngram_tokens_per_forward", "margin" (drafter - n-gram), "winner", "verdict"}}``.
    """
    engine = engine_section or {}
    real_vllm = engine.get("kind") == "vllm" and not engine.get("simulated")
    drafter_engine = {n: d.get("forwards") for n, d in (engine.get("datasets") or {}).items()} if real_vllm else {}
    ngram = {n: d.get("forwards") for n, d in ((engine.get("ngram") or {}).get("datasets") or {}).items()}
    local = {}
    for name, d in (in_process_datasets or {}).items():
        run = d.get("trained") or {}
        if run.get("accepted_lengths") is not None:
            local[name] = in_process_forward_figures(run["accepted_lengths"], int(run["block_size"]))
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys([*local, *drafter_engine, *ngram]):
        eng, loc, ng = drafter_engine.get(name), local.get(name), ngram.get(name)
        source = "engine" if eng and eng.get("tokens_per_forward") is not None else ("in-process" if loc else None)
        drafter = (eng if source == "engine" else loc or {}).get("tokens_per_forward")
        ngram_value = (ng or {}).get("tokens_per_forward")
        winner, sentence = verdict(drafter, ngram_value)
        out[name] = {
            "plain": PLAIN,
            "drafter_engine": eng,
            "drafter_in_process": loc,
            "ngram": ng,
            "drafter": drafter,
            "drafter_source": source,
            "ngram_tokens_per_forward": ngram_value,
            "margin": None if winner is None else drafter - ngram_value,
            "winner": winner,
            "verdict": sentence,
        }
    return out


def baseline_check(comparison: Mapping[str, Mapping[str, Any]], why_not: str | None = None) -> dict[str, Any]:
    """The non-blocking check: the trained drafter makes more tokens per target forward than n-gram lookup on
    every dataset where both were measured. ``{"passed", "reasons", "compared"}`` (+ ``why`` when nothing was
    compared: ``why_not``, or no dataset with both figures)."""
    rows = {n: c for n, c in comparison.items() if c.get("winner") is not None}
    if not rows:
        return {"passed": True, "reasons": [], "compared": False, "why": why_not or "no n-gram baseline measured"}
    reasons = [f"{n}: {c['verdict']}" for n, c in rows.items() if c["winner"] != "drafter"]
    return {"passed": not reasons, "reasons": reasons, "compared": True}


def ngram_lossless(
    ngram_records: Sequence[Mapping[str, Any]], expected: Mapping[str, Sequence[Sequence[int]]]
) -> list[str]:
    """One line per dataset where the engine's n-gram output differs from ``expected`` (dataset -> plain greedy
    output ids per prompt position, None where unknown), naming the prompt and the generated token."""
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
            reasons.append(
                f"{name}: the engine's n-gram output differs from plain greedy decoding at prompt "
                f"{ok[where['prompt']]['position']}, generated token {where['token']} (expected id "
                f"{where['expected']}, got {where['actual']})"
            )
    return reasons


def comparison_table(comparison: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown: per dataset, tokens per target forward of plain, n-gram, the drafter (engine, in process)."""

    def f(fig):
        if not fig or fig.get("tokens_per_forward") is None:
            return "-"
        return f"{fig['tokens_per_forward']:.3f} +- {fig['tokens_per_forward_stderr']:.3f}"

    rows = "".join(
        f"| {n} | 1.000 | {f(c['ngram'])} | {f(c['drafter_engine'])} | {f(c['drafter_in_process'])} | "
        f"{c['winner'] or '-'} |\n"
        for n, c in comparison.items()
    )
    return (
        "tokens per target forward (pooled, +- standard error across prompts)\n\n"
        "| dataset | plain | n-gram lookup (engine) | DFlash (engine) | DFlash (in process) | winner |\n"
        "|---|---|---|---|---|---|\n" + rows
    )


__all__ = [
    "CHECK_BASELINE",
    "PLAIN",
    "baseline_check",
    "compare_methods",
    "comparison_table",
    "engine_forward_figures",
    "in_process_forward_figures",
    "ngram_lossless",
    "tokens_per_forward",
    "verdict",
]
