"""The drafter's loss on a batch and its held-out evaluation (loss, accuracy per block position, tau estimate)."""

from __future__ import annotations

import math

import torch

from dflash_assets.dflash.model.draft_model import DFlashDraftModel
from dflash_assets.dflash.model.loss import accuracy_per_position, dflash_loss_from_hidden, expected_acceptance_length
from dflash_assets.dflash.shards.dataset import HiddenStateShards, TrainingBatch
from dflash_assets.dflash.training.batches import build_batch


@torch.no_grad()
def evaluate(
    model: DFlashDraftModel,
    dataset: HiddenStateShards,
    *,
    max_anchors: int = 512,
    batch_size: int = 1,
    seed: int = 0,
    gamma: float | None = None,
    max_rows: int | None = None,
    device: torch.device | str | None = None,
    distill_weight: float = 0.0,
    target_labels: bool = False,
) -> dict:
    """Loss and per-position accuracy of ``model`` on ``dataset`` with fixed (seeded) anchors (``distill_weight`` and
    ``target_labels`` as in training: :func:`batch_loss`).

    Returns:
        ``{"loss", "acc_per_position": [block_size floats, NaN at 0], "tau_estimate", "rows"}``.
    """
    was_training = model.training
    model.eval()
    device = torch.device(device) if device is not None else model.fc.weight.device
    bs = model.config.block_size
    n = len(dataset) if max_rows is None else min(len(dataset), max_rows)
    correct = torch.zeros(bs, device=device)
    count = torch.zeros(bs, device=device)
    loss_sum = weight_sum = 0.0
    for lo in range(0, n, batch_size):
        batch = build_batch(
            dataset, list(range(lo, min(n, lo + batch_size))), 0, seed, bs, max_anchors, model.config.mask_token_id
        )
        batch = batch.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = batch_loss(model, model, batch, gamma, distill_weight, target_labels)
        loss_sum += float(out["loss"]) * float(out["weight_sum"])
        weight_sum += float(out["weight_sum"])
        correct += out["correct"]
        count += out["count"]
    model.train(was_training)
    acc = accuracy_per_position(correct.cpu(), count.cpu())
    return {
        "loss": loss_sum / weight_sum if weight_sum else math.nan,
        "acc_per_position": acc,
        "tau_estimate": expected_acceptance_length(acc),
        "rows": n,
    }


def batch_loss(
    model_call,
    model: DFlashDraftModel,
    batch: TrainingBatch,
    gamma: float | None,
    distill_weight: float = 0.0,
    target_labels: bool = False,
) -> dict:
    """:func:`~dflash_assets.dflash.model.loss.dflash_loss_from_hidden` of one batch through ``model_call`` (the model,
    or its DDP wrapper), with the frozen LM head of ``model`` (and the batch's target distribution when
    ``distill_weight > 0`` or ``target_labels``)."""
    hidden = model_call(
        batch.block_input_ids,
        target_hidden=batch.context_hidden,
        position_ids=batch.position_ids,
        attention_mask=batch.attention_mask,
    )
    return dflash_loss_from_hidden(
        hidden,
        model.target_lm_head_weight,
        batch.labels,
        batch.label_mask,
        model.config.block_size,
        gamma,
        target_ids=batch.target_ids,
        target_logprobs=batch.target_logprobs,
        distill_weight=distill_weight,
        target_labels=target_labels,
    )
