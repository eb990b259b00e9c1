"""Anchors, block inputs, labels and the training attention mask of DFlash.

Training mirrors inference (z-lab/dflash ``dflash_generate``): for an anchor ``a`` the block input is
``[input_ids[a], MASK x (block_size-1)]`` at positions ``a .. a+block_size-1``; the context is the
target's features at positions ``< a`` (strictly before the anchor: at inference the anchor token was
just sampled and its target features do not exist yet); block position ``k`` predicts
``input_ids[a + k]`` (no extra shift), and position 0 (the anchor itself) has no loss.

Many blocks of one sequence are trained at once: the queries are all blocks' tokens, the keys are
``[all context tokens ; all blocks' tokens]``, and the mask gives each block its own prefix and itself.
"""

from __future__ import annotations

import torch


def valid_anchor_positions(loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """Positions ``a`` with ``loss_mask[a] == 1`` and room for a full block (``a + block_size <= T``).

    Same rule as SpecForge's DFlash trainer (``max_anchor = seq_len - block_size``).

    Args:
        loss_mask: [T] int/bool, 1 on the model's own generated tokens.

    Returns:
        int64 [N] ascending.
    """
    t = loss_mask.shape[0]
    last = t - block_size
    if last < 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.nonzero(loss_mask[: last + 1].bool(), as_tuple=False).flatten().to(torch.long)


def sample_anchors(
    loss_mask: torch.Tensor, block_size: int, max_anchors: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Up to ``max_anchors`` distinct anchors drawn uniformly without replacement from the valid positions.

    Deterministic for a given ``generator`` state (a CPU ``torch.Generator``). Returns int64 [M]
    ascending, ``M = min(max_anchors, #valid)`` (0 when the sequence has no room for a block).
    """
    valid = valid_anchor_positions(loss_mask.cpu(), block_size)
    if valid.numel() <= max_anchors:
        return valid
    pick = torch.randperm(valid.numel(), generator=generator)[:max_anchors]
    return valid[pick].sort().values


def block_inputs(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> dict[str, torch.Tensor]:
    """Block token ids, positions and labels for the anchors of one sequence.

    Args:
        input_ids: [T] int token ids; loss_mask: [T] 0/1; anchors: int64 [M] with ``a + block_size <= T``.

    Returns:
        dict of [M*block_size] tensors (block ``b`` occupies ``b*block_size .. (b+1)*block_size-1``):
        ``block_input_ids`` int64 (``input_ids[a]`` then ``mask_token_id``), ``block_position_ids``
        int64 (``a + k``), ``labels`` int64 (``input_ids[a + k]``), ``label_mask`` bool
        (``k >= 1`` and ``loss_mask[a + k] == 1``).

    Raises:
        ValueError: an anchor leaves no room for a block.
    """
    m = anchors.numel()
    t = input_ids.shape[0]
    if m and int(anchors.max()) + block_size > t:
        raise ValueError(f"anchor {int(anchors.max())} + block_size {block_size} exceeds sequence length {t}")
    offsets = torch.arange(block_size, dtype=torch.long)
    pos = (anchors.to(torch.long)[:, None] + offsets[None, :]).reshape(-1)
    ids = input_ids.to(torch.long)
    block_ids = torch.full((m, block_size), int(mask_token_id), dtype=torch.long)
    block_ids[:, 0] = ids[anchors.to(torch.long)]
    labels = ids[pos]
    label_mask = loss_mask.to(torch.bool)[pos].view(m, block_size).clone()
    label_mask[:, 0] = False
    return {
        "block_input_ids": block_ids.reshape(-1),
        "block_position_ids": pos,
        "labels": labels,
        "label_mask": label_mask.reshape(-1),
    }


def dflash_training_mask(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """Boolean attention mask (True = may attend) for all blocks of one sequence.

    Query ``b*block_size + k`` (block ``b``, position ``k``) sees context key ``j`` iff
    ``j < anchors[b]`` and block key ``b'*block_size + k'`` iff ``b' == b`` (bidirectional inside the
    block, never other blocks). Every query sees at least its own block, so no softmax row is empty.

    Args:
        anchors: int64 [M]; block_size: tokens per block; context_len: C context keys (positions 0..C-1).

    Returns:
        bool [M*block_size, C + M*block_size].
    """
    m = anchors.numel()
    q = m * block_size
    block_of_query = torch.arange(q) // block_size
    ctx = torch.arange(context_len)[None, :] < anchors.to(torch.long)[block_of_query][:, None]
    own = block_of_query[:, None] == block_of_query[None, :]
    return torch.cat([ctx, own], dim=1)


def dflash_training_mask_additive(anchors: torch.Tensor, block_size: int, context_len: int, dtype=torch.float32):
    """The same mask as :func:`dflash_training_mask` in additive form (0 visible, -inf hidden)."""
    allowed = dflash_training_mask(anchors, block_size, context_len)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))


__all__ = [
    "block_inputs",
    "dflash_training_mask",
    "dflash_training_mask_additive",
    "sample_anchors",
    "valid_anchor_positions",
]
