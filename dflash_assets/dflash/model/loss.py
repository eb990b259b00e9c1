"""Decay-weighted block cross-entropy of DFlash and per-position accuracy.

Block position ``k`` predicts the token at ``anchor + k`` (labels at the same positions as the block,
no extra shift). Position 0 is the anchor itself and gets no loss. The weight of position ``k >= 1`` is
``exp(-(k - 1) / gamma)`` (DFlash paper, arXiv 2602.06036; gamma = 7 for block size 16), so early
positions, which gate the acceptance of all later ones, count most. Only positions whose label token
has ``loss_mask == 1`` count.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """gamma for a block size: 7 for 16 (paper); otherwise ``7 * block_size / 16`` (same decay per block)."""
    return DEFAULT_GAMMA.get(block_size, 7.0 * block_size / 16.0)


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """float32 [block_size]: 0 at position 0, ``exp(-(k-1)/gamma)`` at position k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1.0) / gamma)
    w[0] = 0.0
    return w


def dflash_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    label_mask: torch.Tensor,
    block_size: int,
    gamma: float | None = None,
) -> dict[str, torch.Tensor]:
    """Weighted CE over blocks.

    Args:
        logits: [..., Q, V] with Q a multiple of ``block_size`` (blocks laid out contiguously).
        labels: [..., Q] int64 token at ``anchor + k``.
        label_mask: [..., Q] bool, False for position 0, padding, and labels with loss_mask 0.
        gamma: decay; default :func:`default_gamma`.

    Returns:
        dict: ``loss`` (scalar, ``sum(w*ce) / sum(w)`` over counted positions; 0 with grad if none),
        ``correct`` float [block_size] (argmax hits per position), ``count`` float [block_size]
        (counted positions per position), ``weight_sum`` (scalar, ``sum(w)``).
    """
    gamma = default_gamma(block_size) if gamma is None else gamma
    v = logits.shape[-1]
    flat_logits = logits.reshape(-1, v)
    flat_labels = labels.reshape(-1)
    flat_mask = label_mask.reshape(-1)
    q = flat_labels.shape[0]
    if q % block_size:
        raise ValueError(f"{q} block tokens is not a multiple of block_size {block_size}")
    pos = torch.arange(q, device=flat_labels.device) % block_size
    flat_mask = flat_mask.bool() & (pos > 0)  # the anchor position never counts
    w = position_weights(block_size, gamma, device=flat_labels.device)[pos] * flat_mask.float()
    sel = torch.nonzero(flat_mask, as_tuple=False).flatten()
    correct = torch.zeros(block_size, device=flat_labels.device)
    count = torch.zeros(block_size, device=flat_labels.device)
    if sel.numel() == 0:
        zero = flat_logits.sum() * 0.0
        return {"loss": zero, "correct": correct, "count": count, "weight_sum": w.sum()}
    sel_logits = flat_logits[sel].float()
    ce = F.cross_entropy(sel_logits, flat_labels[sel], reduction="none")
    ws = w[sel]
    loss = (ce * ws).sum() / ws.sum()
    with torch.no_grad():
        hit = (sel_logits.argmax(-1) == flat_labels[sel]).float()
        correct.index_add_(0, pos[sel], hit)
        count.index_add_(0, pos[sel], torch.ones_like(hit))
    return {"loss": loss, "correct": correct, "count": count, "weight_sum": ws.sum()}


def _chunk_ce(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor):
    # under autocast F.linear casts itself; casting a bf16 LM head to fp32 here would copy it per chunk
    w = head_weight if torch.is_autocast_enabled(hidden.device.type) else head_weight.to(hidden.dtype)
    logits = F.linear(hidden, w).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    hit = (logits.detach().argmax(-1) == labels).float()
    return ce, hit


def _chunk_distill(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    target_ids: torch.Tensor,
    target_logprobs: torch.Tensor,
    weight: float,
):
    """``(1 - weight) * CE(label) + weight * CE(target top-k, renormalised)`` per position, and the argmax hits."""
    w = head_weight if torch.is_autocast_enabled(hidden.device.type) else head_weight.to(hidden.dtype)
    logits = F.linear(hidden, w).float()
    logp = torch.log_softmax(logits, dim=-1)
    ce = -logp.gather(1, labels[:, None])[:, 0]
    soft = -(torch.softmax(target_logprobs.float(), dim=-1) * logp.gather(1, target_ids)).sum(-1)
    hit = (logits.detach().argmax(-1) == labels).float()
    return (1.0 - weight) * ce + weight * soft, hit


def distillation_terms(
    labels: torch.Tensor,
    target_ids: torch.Tensor | None,
    target_logprobs: torch.Tensor | None,
    distill_weight: float,
    target_labels: bool,
) -> tuple[torch.Tensor, bool]:
    """The hard labels the loss uses (the target's argmax, ``target_ids[..., 0]``, when ``target_labels``) and
    whether the soft term is on.

    Args:
        labels: int64 [..., Q] the data's labels; target_ids: int64 [..., Q, k] the target's top-k token ids of each
            label, best first, and target_logprobs: float [..., Q, k] their natural-log probabilities (both None
            without the target's distribution); distill_weight: the soft term's weight in [0, 1]; target_labels:
            replace the labels with the target's argmax.

    Returns:
        ``(labels, soft)``: int64 [..., Q] the labels to use (``labels`` itself unless ``target_labels``) and
        whether ``distill_weight > 0``.

    Raises:
        ValueError: ``distill_weight`` outside [0, 1], or distillation asked for without the target's distribution.
    """
    if not 0.0 <= distill_weight <= 1.0:
        raise ValueError(f"distill_weight must be in [0, 1], got {distill_weight}")
    if (distill_weight > 0 or target_labels) and (target_ids is None or target_logprobs is None):
        raise ValueError("distillation needs the target's distribution per label (dflash.target.tail)")
    if target_labels:
        labels = target_ids[..., 0].to(labels.dtype)
    return labels, distill_weight > 0


def dflash_loss_from_hidden(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    label_mask: torch.Tensor,
    block_size: int,
    gamma: float | None = None,
    logits_budget: int = 2**28,
    *,
    target_ids: torch.Tensor | None = None,
    target_logprobs: torch.Tensor | None = None,
    distill_weight: float = 0.0,
    target_labels: bool = False,
) -> dict[str, torch.Tensor]:
    """Same result as :func:`dflash_loss` but computes logits only at counted positions, in chunks.

    Logits for a chunk of ``logits_budget // vocab_size`` positions are built, reduced and dropped;
    when there is more than one chunk each is recomputed in backward (activation checkpointing), so
    peak memory stays about ``logits_budget * 4`` bytes however many blocks are trained at once.

    Distillation (off by default): with the target's top-k distribution of each label, ``target_ids`` int64 and
    ``target_logprobs`` float [..., Q, k] (:mod:`~dflash_assets.dflash.target.tail`), each counted position's term
    is ``(1 - distill_weight) * CE(label) + distill_weight * CE(p_target)``, ``p_target`` the softmax of the top-k
    log-probabilities (renormalised over those k tokens; Hinton et al. 2015, arXiv 1503.02531), weighted over the
    block as before; ``target_labels`` makes the label the target's argmax (``target_ids[..., 0]``), the token
    greedy verification accepts, and the accuracy is counted against it.

    Args:
        hidden: [..., Q, H] draft hidden states; head_weight: [V, H] target LM head;
        labels, label_mask: [..., Q] as in :func:`dflash_loss`.
    """
    gamma = default_gamma(block_size) if gamma is None else gamma
    labels, soft = distillation_terms(labels, target_ids, target_logprobs, distill_weight, target_labels)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    flat_mask = label_mask.reshape(-1)
    q = flat_labels.shape[0]
    if q % block_size:
        raise ValueError(f"{q} block tokens is not a multiple of block_size {block_size}")
    device = flat_labels.device
    pos = torch.arange(q, device=device) % block_size
    flat_mask = flat_mask.bool() & (pos > 0)  # the anchor position never counts
    correct = torch.zeros(block_size, device=device)
    count = torch.zeros(block_size, device=device)
    sel = torch.nonzero(flat_mask, as_tuple=False).flatten()
    if sel.numel() == 0:
        zero = flat_hidden.sum() * 0.0
        return {"loss": zero, "correct": correct, "count": count, "weight_sum": zero.detach()}
    ws = position_weights(block_size, gamma, device=device)[pos[sel]]
    h, y = flat_hidden[sel], flat_labels[sel]
    if soft:
        k = target_ids.shape[-1]
        t_ids, t_lp = target_ids.reshape(-1, k)[sel], target_logprobs.reshape(-1, k)[sel]
    chunk = max(1, logits_budget // head_weight.shape[0])
    ces, hits = [], []
    for start in range(0, h.shape[0], chunk):
        part = slice(start, start + chunk)
        fn, args = _chunk_ce, (h[part], head_weight, y[part])
        if soft:
            fn, args = _chunk_distill, (*args, t_ids[part], t_lp[part], float(distill_weight))
        if h.shape[0] > chunk and torch.is_grad_enabled():
            ce, hit = torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
        else:
            ce, hit = fn(*args)
        ces.append(ce)
        hits.append(hit)
    ce, hit = torch.cat(ces), torch.cat(hits)
    loss = (ce * ws).sum() / ws.sum()
    correct.index_add_(0, pos[sel], hit.detach())
    count.index_add_(0, pos[sel], torch.ones_like(hit))
    return {"loss": loss, "correct": correct, "count": count, "weight_sum": ws.sum()}


def accuracy_per_position(correct: torch.Tensor, count: torch.Tensor) -> list[float]:
    """``correct / count`` per block position (NaN where nothing was counted, e.g. position 0)."""
    return [float(c / n) if n > 0 else math.nan for c, n in zip(correct.tolist(), count.tolist())]


def expected_acceptance_length(acc: list[float]) -> float:
    """Rough tau from per-position accuracies: ``1 + sum_k prod_{j<=k} acc_j`` over positions 1...

    Treats positions as independent (an approximation; the real tau is measured by speculative
    decoding). Counts the bonus token, so 1 <= tau <= block_size.
    """
    tau, run = 1.0, 1.0
    for a in acc[1:]:
        if math.isnan(a):
            break
        run *= a
        tau += run
    return tau


__all__ = [
    "accuracy_per_position",
    "default_gamma",
    "dflash_loss",
    "dflash_loss_from_hidden",
    "distillation_terms",
    "expected_acceptance_length",
    "position_weights",
]
