"""Training/serving parity, judged step by step: does the engine's drafter propose what the drafter trained here
proposes, at every verification step the engine ran?

The engine decodes the export as written; this process replays the engine's outputs with the drafter as it was
trained (the training run's ``target_layer_ids``, ``block_size`` and ``mask_token_id``), at the engine's own
anchors (:mod:`~dflash_assets.stages.evaluation.replay`), computed as the engine's kernels compute it where they
are known to differ from the model (measured before the server starts:
:mod:`~dflash_assets.stages.evaluation.vllm_probe`). Each engine step's accepted count must be reproduced, except
where this drafter's two candidate tokens are within the numeric tolerance of the dtype both decode in (a tie:
float rounding, not a bug); any other difference fails. A mismatch names the dataset, prompt, step and draft
position, both accepted counts and both tokens, so a wrong target-layer map, mask token, template, loader key or
saved weight shows where it acts, however few prompts there are; it does not hang on a tolerance over a sample
mean (a per-prompt tau of a few short prompts differs by more than 0.05 from noise alone). The most common
complaint of DFlash users, high training accuracy but low serving tau, shows here as a failed check.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from dflash_assets.generation.servers.origin import UNKNOWN

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


def template_vs_trained(trained: list[str] | None, rendered: str) -> list[str]:
    """One line when the chat template the evaluation renders its prompts with (``rendered``, SHA-256 hex of its
    text) is not among the templates of the rows the drafter trained on (``trained``: the drafter's metadata
    ``template_sha256``, from the tokenized partitions' ``rows_by_template``). Rows and renders of an unknown
    template (``"unknown"``: an external server's, or rows tokenized before the hash was kept) are not compared.
    A drafter trained on another rendering of the conversation is measured on text it never saw: step parity
    cannot show it (both sides replay the same tokens), so it is checked here, before any step."""
    known = sorted({t for t in trained or [] if t and t != UNKNOWN})
    if not known or not rendered or rendered == UNKNOWN or rendered in known:
        return []
    shown = ", ".join(t[:12] for t in known)
    return [
        f"template: the drafter trained on rows rendered with chat template {shown}, the evaluation renders its "
        f"prompts with {rendered[:12]}: target_model.chat_template (or the model's own template) changed since "
        "the rows were tokenized; materialize completions and tokenized_sequences again with this template, or "
        "set target_model.chat_template back to the one the rows used"
    ]


def engine_parity(
    engine_section: Mapping[str, Any],
    in_process_datasets: Mapping[str, Mapping[str, Any]],
    trained: Mapping[str, Any],
    export_config: Mapping[str, Any],
    engine_name: str = "vLLM",
    decode: Callable[[list[int]], str] | None = None,
) -> dict[str, Any]:
    """Judge the step replay of every dataset.

    Args:
        engine_section: the report's ``engine`` section (``requests``: one record per prompt with ``dataset``,
            ``position``, ``steps`` and ``tau``, or ``error``; ``datasets``: per dataset figures).
        in_process_datasets: the report's in-process ``datasets``; ``[name]["trained"]`` from
            :func:`~dflash_assets.stages.evaluation.replay.replay_engine_datasets` (``step_parity``,
            ``per_prompt_tau``).
        trained: the training run's draft settings (see :func:`export_vs_trained`).
        export_config: the export's ``config.json``.
        decode: token ids -> text, to show the tokens of a mismatch (ids only without it).

    Returns:
        ``passed`` (on every dataset: at least :data:`MIN_MEASURED_SHARE` of its prompts measured and replayed,
        no step mismatch beyond the tolerance, the engine drafting ``block_size - 1`` tokens), ``reasons`` (one
        line per failure: dataset, prompt, step, draft position, accepted counts, tokens and margin; or how many
        prompts were measured), ``by_dataset`` (``engine_tau`` and ``in_process_tau`` over the same prompts and
        their ``difference``, for information; ``prompts``, ``prompts_compared``, ``steps_compared``,
        ``mismatches``, ``ties``, ``tolerance``, ``first_mismatch``), ``export_vs_trained`` (likely causes).
    """
    reasons: list[str] = []
    by_dataset: dict[str, dict[str, Any]] = {}
    block = trained.get("block_size")
    for name, local in in_process_datasets.items():
        records = [r for r in engine_section.get("requests", []) if r.get("dataset") == name]
        run = local.get("trained") or {}
        steps = run.get("step_parity") or {}
        per_prompt = run.get("per_prompt_tau") or []
        both = [
            r
            for r in records
            if "error" not in r
            and r.get("tau") is not None
            and r["position"] < len(per_prompt)
            and per_prompt[r["position"]] is not None
        ]
        engine_tau = sum(r["tau"] for r in both) / len(both) if both else None
        local_tau = sum(per_prompt[r["position"]] for r in both) / len(both) if both else None
        needed = min_measured(len(records))
        first = _first_mismatch(steps)
        by_dataset[name] = row = {
            "engine_tau": engine_tau,
            "in_process_tau": local_tau,
            "difference": None if engine_tau is None or local_tau is None else engine_tau - local_tau,
            "prompts": len(records),
            "prompts_compared": int(steps.get("prompts_replayed", 0)),
            "prompts_needed": needed,
            "prompts_lost": sum(1 for r in records if "error" in r),
            "steps_compared": int(steps.get("steps_compared", 0)),
            "mismatches": int(steps.get("mismatches", 0)),
            "ties": int(steps.get("ties", 0)),
            "tolerance": steps.get("tolerance"),
            "first_mismatch": first,
        }
        first_error = next((r["error"] for r in records if "error" in r), None)
        lost = f"; the first lost: {first_error[:200]}" if first_error else ""
        if not row["prompts_compared"]:
            reasons.append(f"{name}: no prompt measured by {engine_name} and replayed here{lost}")
        elif row["prompts_compared"] < needed:
            reasons.append(
                f"{name}: {engine_name} measured and replayed {row['prompts_compared']} of {len(records)} prompts, "
                f"fewer than the {needed} needed ({MIN_MEASURED_SHARE:.0%}){lost}"
            )
        if first is not None:
            reasons.append(_mismatch_line(name, row, first, engine_name, decode))
        drafted = {d for r in records for d, _ in (r.get("steps") or [])}
        if block and drafted and max(drafted) != block - 1:
            reasons.append(
                f"{name}: {engine_name} drafted at most {max(drafted)} tokens per step; the drafter trained on blocks "
                f"of {block} ({block - 1} drafted)"
            )
    causes = export_vs_trained(export_config, trained)
    if reasons and causes:
        reasons.append("likely cause: " + "; ".join(causes))
    elif causes:
        reasons.append("the export disagrees with training: " + "; ".join(causes))
    return {"passed": not reasons, "reasons": reasons, "by_dataset": by_dataset, "export_vs_trained": causes}


def _first_mismatch(steps: Mapping[str, Any]) -> dict | None:
    """The first listed mismatch (a difference beyond the numeric tolerance); when the replay counted mismatches but
    listed only ties, the largest margin; None without a mismatch."""
    listed = [d for d in steps.get("listed", []) if not d["tie"]]
    if listed:
        return listed[0]
    if int(steps.get("mismatches", 0)):
        return {"margin": (steps.get("mismatch_margins") or [None])[-1], "unlisted": True}
    return None


def _mismatch_line(name: str, row: dict, d: dict, engine_name: str, decode) -> str:
    """One reason: how many steps disagree and where the first one is."""

    def token(i: int) -> str:
        return f"id {i}" + (f" {decode([i])!r}" if decode is not None else "")

    head = (
        f"{name}: {row['mismatches']} of {row['steps_compared']} verification steps disagree beyond the numeric "
        f"tolerance ({row['tolerance']} logits; {row['ties']} ties within it)"
    )
    if d.get("unlisted"):
        return f"{head}; one by {d['margin']} logits"
    return (
        f"{head}; the first: prompt {d['prompt']}, step "
        f"{d['step']} (anchor position {d['anchor']}), draft position {d['draft_position']}: {engine_name} accepted "
        f"{d['engine_accepted']} drafts, the drafter here {d['here_accepted']} (here {token(d['here_token'])}, the "
        f"output has {token(d['output_token'])}; {d['margin']} logits apart)"
    )


def min_measured(prompts: int) -> int:
    """Prompts of ``prompts`` the engine must have measured: ``ceil(MIN_MEASURED_SHARE * prompts)``."""
    return math.ceil(MIN_MEASURED_SHARE * prompts - 1e-9)


def lossless_summary(in_process_datasets: Mapping[str, Mapping[str, Any]], parity: Mapping[str, Any] | None) -> dict:
    """The ``lossless`` check: every speculative decoding's output is the target's greedy output. In process (a
    decode here: the trained drafter's, and the untrained one's when it ran) it is compared with plain greedy
    decoding; an engine's output is replayed here teacher forced (every token the target's argmax, ties within the
    numeric tolerance allowed), on at least :data:`MIN_MEASURED_SHARE` of each dataset's prompts. Returns
    ``passed`` and ``reasons`` (dataset, drafter, prompt, token; or how many outputs were checked)."""
    reasons = []
    replayed = bool(parity)
    for name, local in in_process_datasets.items():
        for who in ("trained", "untrained"):
            run = local.get(who) or {}
            if not run.get("lossless", True):
                where = run.get("first_mismatch") or {}
                what = (
                    "the engine's output is not the target's greedy output here"
                    if "step_parity" in run
                    else f"in-process speculative decoding with the {who} drafter differs from plain greedy decoding"
                )
                reasons.append(f"{name}: {what} at prompt {where.get('prompt')}, generated token {where.get('token')}")
    for name, row in ((parity or {}).get("by_dataset") or {}).items():
        checked, prompts = row.get("prompts_compared"), row.get("prompts")
        if replayed and checked is not None and prompts is not None and checked < min_measured(prompts):
            reasons.append(
                f"{name}: the engine's output was checked against the target on {checked} of {prompts} prompts, "
                f"fewer than the {min_measured(prompts)} needed ({MIN_MEASURED_SHARE:.0%})"
            )
    return {"passed": not reasons, "reasons": reasons}


def parity_table(parity: Mapping[str, Any], engine_name: str) -> str:
    """Markdown: per dataset, the steps compared, mismatches and ties, and the two taus for information."""
    rows = "".join(
        f"| {n} | {d['prompts_compared']} of {d.get('prompts', '-')} | {d['steps_compared']} | {d['mismatches']} | "
        f"{d['ties']} | {_f(d['engine_tau'])} | {_f(d['in_process_tau'])} |\n"
        for n, d in parity["by_dataset"].items()
    )
    return (
        f"step parity: each {engine_name} verification step replayed here at its anchor\n\n"
        f"| dataset | prompts | steps | mismatches | ties | {engine_name} tau | in-process tau |\n"
        "|---|---|---|---|---|---|---|\n" + rows
    )


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


__all__ = [
    "CHECK_LOSSLESS",
    "CHECK_PARITY",
    "MIN_MEASURED_SHARE",
    "engine_parity",
    "export_vs_trained",
    "lossless_summary",
    "parity_table",
    "template_vs_trained",
]
