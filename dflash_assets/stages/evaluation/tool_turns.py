"""Tau on the turns where the target calls a tool, apart from its other turns (issue 43 item 6).

An agent's drafter is judged where the agent works: a tool-call turn (JSON arguments inside the template's
``<tool_call>`` markup) drafts very differently from prose. A prompt counts as a tool-call turn when the
target's own greedy output for it holds :data:`~dflash_assets.generation.rows.records.TOOL_CALL_OPEN`; speculative
decoding is lossless, so the engine's output for that prompt is the same and both figures group the same prompts.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from dflash_assets.generation.rows.records import holds_tool_call


def _mean(values: Sequence[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def tool_call_turns(report: dict, decode: Callable[[list[int]], str]) -> dict[str, dict]:
    """Per dataset, tau on the prompts whose greedy output calls a tool and on the others.

    Args:
        report: ``report.json``'s content: ``datasets.<name>.trained`` with ``plain_output_ids`` (per prompt, the
            target's greedy new tokens) and ``per_prompt_tau``; optionally ``engine.requests`` (records with
            ``dataset``, ``position`` within it and ``tau``).
        decode: token ids -> text, special tokens kept (a tool-call tag may be one added token).

    Returns:
        ``{dataset: {"tool_call": group, "other": group}}``, each group ``{"prompts": n, "positions": [...],
        "tau_in_process": mean of per-prompt tau or None, "tau_engine": the engine's mean over the same prompts
        or None, "difference": engine - in process or None}``. Datasets without per-prompt outputs are left out.
    """
    requests = (report.get("engine") or {}).get("requests") or []
    out: dict[str, dict] = {}
    for name, dataset in (report.get("datasets") or {}).items():
        trained = dataset.get("trained") or {}
        outputs, taus = trained.get("plain_output_ids"), trained.get("per_prompt_tau")
        if outputs is None or taus is None:
            continue
        calls = [holds_tool_call(decode(list(ids))) for ids in outputs]
        engine_tau = {
            r.get("position"): r.get("tau") for r in requests if r.get("dataset") == name and r.get("tau") is not None
        }
        groups = {}
        for label, flag in (("tool_call", True), ("other", False)):
            positions = [i for i, called in enumerate(calls) if called == flag]
            in_process = _mean([taus[i] for i in positions if i < len(taus) and taus[i] is not None])
            engine = _mean([engine_tau[i] for i in positions if i in engine_tau]) if engine_tau else None
            groups[label] = {
                "prompts": len(positions),
                "positions": positions,
                "tau_in_process": in_process,
                "tau_engine": engine,
                "difference": None if in_process is None or engine is None else round(engine - in_process, 4),
            }
        out[name] = groups
    return out


def tool_turn_line(name: str, groups: dict, engine_name: str) -> str:
    """One log / summary line: ``name: tool-call turns n of N prompts, tau x in process, y in <engine>``."""
    calls, other = groups["tool_call"], groups["other"]
    total = calls["prompts"] + other["prompts"]
    if not calls["prompts"]:
        return f"{name}: tool-call turns 0 of {total} prompts (the target called no tool on them)"
    text = f"{name}: tool-call turns {calls['prompts']} of {total} prompts, tau {calls['tau_in_process']} in process"
    if calls["tau_engine"] is not None:
        text += f", {calls['tau_engine']} in {engine_name}"
    if other["prompts"]:
        text += f"; other turns tau {other['tau_in_process']}"
    return text
