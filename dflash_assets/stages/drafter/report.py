"""What a drafter run reports: its outcome sentence and its materialization metadata (plain values)."""

import json
import math
import os

from dflash_assets.orchestration.metadata import png_markdown


def outcome_of(summary: dict, reused: bool) -> tuple[str, str]:
    """``(outcome, sentence)`` for metadata and the summary: trained / resumed / reused."""
    steps, start, tokens = summary["step"], summary.get("resumed_from_step", 0), summary["train_tokens"]
    if reused or (start and start >= steps):
        return "reused", f"reused because nothing changed ({steps} steps on {tokens} tokens)"
    if start:
        return "resumed", f"resumed at step {start} of the same run, trained to step {steps} on {tokens} tokens"
    return "trained", f"trained {steps} steps on {tokens} tokens"


def count_params(safetensors_path: str) -> int:
    """Number of parameters in a safetensors file, from its header alone (8-byte little-endian header
    length, then JSON ``{name: {"shape": [...]}}``): the weights are never read.

    Raises:
        ValueError: the file is not safetensors (header length past the file, or not JSON).
    """
    with open(safetensors_path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > os.fstat(f.fileno()).st_size:
            raise ValueError(f"{safetensors_path}: not a safetensors file (header of {size} bytes)")
        header = json.loads(f.read(size))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def drafter_metadata(
    summary: dict,
    plan,
    data,
    config,
    outcome: tuple[str, str],
    weights: str,
    png: bytes,
    wall_s: float,
    offline_subset: dict,
    templates: list[str] | None = None,
) -> dict:
    """The ``dflash_drafter`` materialization's metadata (plain values; the asset adds the export path).

    Args:
        weights: path of the export's ``model.safetensors``.
        plan: the run's :class:`~dflash_assets.stages.drafter.run.RunPlan`; ``data``: its
            :class:`~dflash_assets.stages.drafter.run.TrainingData`; ``config``: the asset's ``DrafterConfig``.
        templates: SHA-256 (hex) of the chat templates the rows trained on were rendered with (recorded as
            ``template_sha256``; the evaluation's parity check compares its own rendering with them).
    """
    draft_cfg = summary["draft_config"]
    evaluation = summary.get("eval") or {}
    acc = evaluation.get("acc_per_position") or []
    return {
        "parameters": count_params(weights),
        "train_rows": summary["train_rows"],
        "train_tokens": summary["train_tokens"],
        "steps": summary["step"],
        "total_steps": summary.get("total_steps"),
        "max_steps": config.max_steps,  # set: the schedule's length, whatever the data's size
        "outcome": outcome[0],
        "outcome_text": outcome[1],
        "run_id": plan.run_id,
        "resumed_from_step": summary.get("resumed_from_step", 0),
        "steps_this_run": 0 if plan.reused else summary["step"] - summary.get("resumed_from_step", 0),
        "warm_start_from": plan.run["parent"],
        "data_fingerprint": plan.data_fp,
        "config_fingerprint": plan.config_fp,
        "final_loss": summary["final_loss"],
        "tokens_per_s": round(summary["tokens_per_s"], 1),
        "world_size": summary["world_size"],
        "heldout_loss": evaluation.get("loss"),
        "heldout_rows": evaluation.get("rows"),
        "heldout_acc_per_position": [None if a != a else round(a, 4) for a in acc],
        "heldout_tau_estimate": evaluation.get("tau_estimate"),
        "partitions_used": len(data.used),
        "partitions_held": sorted(data.held),  # a blocking check holds them: not trained on
        "features": data.mode,
        "features_reason": data.reason,
        "target_forwards": summary.get("target_forwards", 0),
        "target_kernels": summary.get("target_kernels") or "",
        "offline_subset": offline_subset,
        "template_sha256": templates or [],  # the rows' chat templates: the evaluation renders with one of them
        "seed": config.seed,
        "eval_fraction": config.eval_fraction,
        "max_length": config.max_length,
        "block_size": draft_cfg.get("block_size"),
        "mask_token_id": draft_cfg.get("mask_token_id"),
        "target_layer_ids": draft_cfg.get("target_layer_ids"),
        "wall_s": round(wall_s, 1),
        "loss_curve": png_markdown(png, "loss") if png else "",
    }
