"""Training/serving parity: the engine's acceptance length and output against the in-process evaluation's.

The in-process evaluation decodes the drafter as it was trained (the training run's ``target_layer_ids``,
``block_size`` and ``mask_token_id``); the engine decodes the export as written. They agree when the export and
the engine's DFlash path match training: the same prompts give the same tau (within :data:`TAU_TOLERANCE`) and
the engine's greedy output equals plain greedy decoding (speculative decoding is lossless). The most common
complaint of DFlash users, high training accuracy but low serving tau, shows here as a failed check that names
where the two part.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dflash_assets.dflash.decoding.evaluation import first_divergence

TAU_TOLERANCE = 0.05
#: Least share of a dataset's prompts the engine must have measured for parity (and the engine's lossless
#: verdict) to count. 90%: a transient loss of a few prompts (6 of the demo's 64) passes, while a verdict resting
#: on a minority of prompts, or a systematic loss (every long prompt's reply rejected) that could bias tau, fails;
#: at 90% tau's standard error is at most 1/sqrt(0.9) = 1.05 times that of all prompts.
MIN_MEASURED_SHARE = 0.9
CHECK_PARITY = "engine_parity"
CHECK_LOSSLESS = "lossless"
_DRAFT_FIELDS = ("target_layer_ids", "block_size", "mask_token_id")


def export_vs_trained(export_config: Mapping[str, Any], trained: Mapping[str, Any]) -> list[str]:
    """One line per DFlash setting where the export's ``config.json`` differs from what training used
    (``trained``: the drafter's materialization metadata, keys ``target_layer_ids``, ``block_size``,
    ``mask_token_id``; a key it lacks is not compared)."""
    dfc = export_config.get("dflash_config") or {}
    lines = []
    for key in _DRAFT_FIELDS:
        want = trained.get(key)
        got = dfc.get(key, export_config.get(key))
        if want is not None and got != want:
            lines.append(f"the export's {key} {got!r} is not the {want!r} the drafter trained with")
    return lines


def engine_parity(
    engine_section: Mapping[str, Any],
    in_process_datasets: Mapping[str, Mapping[str, Any]],
    trained: Mapping[str, Any],
    export_config: Mapping[str, Any],
    engine_name: str = "vLLM",
) -> dict[str, Any]:
    """Compare the engine's decoding with the in-process one, prompt by prompt.

    Args:
        engine_section: the report's ``engine`` section (``requests``: one record per prompt with ``dataset``,
            ``position``, ``output_ids``, ``tau`` or ``error``; ``datasets``: per dataset figures).
        in_process_datasets: the report's in-process ``datasets`` (``[name]["trained"]`` with ``per_prompt_tau``
            and ``plain_output_ids``, one per prompt position).
        trained: the training run's draft settings (see :func:`export_vs_trained`).
        export_config: the export's ``config.json``.

    Returns:
        ``passed`` (on every dataset: at least :data:`MIN_MEASURED_SHARE` of its prompts measured by both, tau
        within :data:`TAU_TOLERANCE`, the engine lossless, the engine drafting ``block_size - 1`` tokens),
        ``reasons`` (one line per failure, naming the dataset, prompt and token, or how many prompts were
        measured), ``by_dataset`` (``engine_tau``, ``in_process_tau`` over the prompts both measured,
        ``difference``, ``prompts``, ``prompts_compared``, ``outputs_compared``, ``prompts_needed``, ``lossless``,
        ``first_mismatch``), ``export_vs_trained`` (likely causes).
    """
    reasons: list[str] = []
    by_dataset: dict[str, dict[str, Any]] = {}
    block = trained.get("block_size")
    for name, local in in_process_datasets.items():
        records = [r for r in engine_section.get("requests", []) if r.get("dataset") == name]
        trained_run = local["trained"]
        per_prompt = trained_run.get("per_prompt_tau") or []
        plain = trained_run.get("plain_output_ids") or []
        ok = [r for r in records if "error" not in r]
        both = [r for r in ok if r.get("tau") is not None and r["position"] < len(per_prompt)]
        engine_tau = sum(r["tau"] for r in both) / len(both) if both else None
        local_tau = sum(per_prompt[r["position"]] for r in both) / len(both) if both else None
        mismatch = first_divergence([plain[r["position"]] for r in ok], [r["output_ids"] for r in ok])
        if mismatch is not None:
            mismatch["prompt"] = ok[mismatch["prompt"]]["position"]
        needed = min_measured(len(records))
        row = {
            "engine_tau": engine_tau,
            "in_process_tau": local_tau,
            "difference": None if engine_tau is None else engine_tau - local_tau,
            "prompts": len(records),
            "prompts_compared": len(both),
            "outputs_compared": len(ok),
            "prompts_needed": needed,
            "prompts_lost": len(records) - len(ok),
            "lossless": mismatch is None,
            "first_mismatch": mismatch,
        }
        by_dataset[name] = row
        first_error = next((r["error"] for r in records if "error" in r), None)
        lost = f"; the first lost: {first_error[:200]}" if first_error else ""
        if not both:
            reasons.append(f"{name}: no prompt measured by both {engine_name} and the in-process evaluation{lost}")
        elif len(both) < needed:
            reasons.append(
                f"{name}: {engine_name} tau measured on {len(both)} of {len(records)} prompts, fewer than the "
                f"{needed} needed ({MIN_MEASURED_SHARE:.0%}){lost}"
            )
        elif abs(row["difference"]) > TAU_TOLERANCE:
            reasons.append(
                f"{name}: {engine_name} tau {engine_tau:.3f} vs in-process {local_tau:.3f} over {len(both)} prompts "
                f"(difference {row['difference']:+.3f}, tolerance {TAU_TOLERANCE})"
            )
        if mismatch is not None:
            reasons.append(
                f"{name}: {engine_name}'s output with the drafter differs from plain greedy decoding at prompt "
                f"{mismatch['prompt']}, generated token {mismatch['token']} (expected id {mismatch['expected']}, "
                f"got {mismatch['actual']})"
            )
        drafted = (engine_section.get("datasets", {}).get(name) or {}).get("num_speculative_tokens")
        if block and drafted and drafted != block - 1:
            reasons.append(
                f"{name}: {engine_name} drafted {drafted} tokens per step; the drafter trained on blocks of {block} "
                f"({block - 1} drafted)"
            )
    causes = export_vs_trained(export_config, trained)
    if reasons and causes:
        reasons.append("likely cause: " + "; ".join(causes))
    elif causes:
        reasons.append("the export disagrees with training: " + "; ".join(causes))
    return {"passed": not reasons, "reasons": reasons, "by_dataset": by_dataset, "export_vs_trained": causes}


def min_measured(prompts: int) -> int:
    """Prompts of ``prompts`` the engine must have measured: ``ceil(MIN_MEASURED_SHARE * prompts)``."""
    return math.ceil(MIN_MEASURED_SHARE * prompts - 1e-9)


def lossless_summary(in_process_datasets: Mapping[str, Mapping[str, Any]], parity: Mapping[str, Any] | None) -> dict:
    """The ``lossless`` check: every speculative decoding (in process, the trained drafter and the untrained one
    when it ran; the engine when it ran) equals plain greedy decoding, the engine's on at least
    :data:`MIN_MEASURED_SHARE` of each dataset's prompts. Returns ``passed`` and ``reasons`` (dataset, drafter,
    prompt, token; or how many outputs were compared)."""
    reasons = []
    for name, local in in_process_datasets.items():
        for who in ("trained", "untrained"):
            run = local.get(who) or {}
            if not run.get("lossless", True):
                where = run.get("first_mismatch") or {}
                reasons.append(
                    f"{name}: in-process speculative decoding with the {who} drafter differs from plain greedy "
                    f"decoding at prompt {where.get('prompt')}, generated token {where.get('token')}"
                )
    for name, row in ((parity or {}).get("by_dataset") or {}).items():
        compared, prompts = row.get("outputs_compared"), row.get("prompts")
        if compared is not None and prompts is not None and compared < min_measured(prompts):
            reasons.append(
                f"{name}: the engine's output was compared with plain greedy decoding on {compared} of {prompts} "
                f"prompts, fewer than the {min_measured(prompts)} needed ({MIN_MEASURED_SHARE:.0%})"
            )
        if not row["lossless"]:
            where = row["first_mismatch"]
            reasons.append(
                f"{name}: the engine's output differs from plain greedy decoding at prompt {where['prompt']}, "
                f"generated token {where['token']}"
            )
    return {"passed": not reasons, "reasons": reasons}


def parity_table(parity: Mapping[str, Any], engine_name: str) -> str:
    """Markdown: per dataset, engine tau beside in-process tau, the difference and lossless."""
    rows = "".join(
        f"| {n} | {_f(d['engine_tau'])} | {_f(d['in_process_tau'])} | {_f(d['difference'], '+.3f')} | "
        f"{d['prompts_compared']} of {d.get('prompts', '-')} | {'yes' if d['lossless'] else 'NO'} |\n"
        for n, d in parity["by_dataset"].items()
    )
    return (
        f"| dataset | {engine_name} tau | in-process tau | difference | prompts | lossless |\n"
        "|---|---|---|---|---|---|\n" + rows
    )


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


__all__ = [
    "CHECK_LOSSLESS",
    "CHECK_PARITY",
    "MIN_MEASURED_SHARE",
    "TAU_TOLERANCE",
    "engine_parity",
    "export_vs_trained",
    "lossless_summary",
    "parity_table",
]
