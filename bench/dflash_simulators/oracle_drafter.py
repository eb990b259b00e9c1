"""A scripted drafter that knows the target's greedy continuation: speculative decoding with chosen rejections.

Shared by the tests and bench/gpu_check.py: it proposes the known continuation and makes wrong drafts where
a script says, so a run has acceptances of known lengths (partial ones included, which an untrained drafter
almost never gives), and it records the context it was given.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["OracleDrafter"]


class OracleDrafter(nn.Module):
    """Proposes ``reference`` (prompt + the target's greedy continuation), wrong where ``corrupt`` says.

    The interface of :func:`~dflash_assets.dflash.decoding.speculative.dflash_generate`'s drafter without a context
    cache: ``forward(input_ids [1, Q], target_hidden=[1, C, F], position_ids=[1, C+Q]) -> logits [1, Q, V]``
    (one-hot of the proposed tokens; ``compute_logits`` is the identity).

    Args:
        reference: token ids; the draft at position ``p`` is ``reference[p]`` (0 past its end).
        config: any object with ``vocab_size``, ``mask_token_id``, ``block_size`` and ``target_layer_ids``
            (a :class:`~dflash_assets.dflash.model.draft_model.DFlashConfig`).
        corrupt: for the ``i``-th call, the 1-based draft made wrong (``+1 mod vocab``), or None for none:
            that step then accepts ``corrupt[i]`` tokens (``corrupt[i] - 1`` drafts + the bonus), or the
            whole block when None. Calls past the list make no error.

    Attributes:
        calls: ``(start position, context features clone)`` per call.

    Raises:
        AssertionError (in ``forward``): the block is not ``[last accepted token, MASK ...]`` at consecutive
            positions from 0, i.e. the decoder broke its own layout.
    """

    def __init__(self, reference: Sequence[int], config, corrupt: Sequence[int | None] = ()) -> None:
        super().__init__()
        self.config = config
        self.reference = list(reference)
        self.corrupt = list(corrupt)
        self.calls: list[tuple[int, torch.Tensor]] = []
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the module a device

    def forward(self, input_ids, *, target_hidden, position_ids, attention_mask=None):
        q = input_ids.shape[1]
        start = int(position_ids[0, -q])
        assert position_ids[0].tolist() == list(range(start + q))
        assert int(input_ids[0, 0]) == self.reference[start]  # the anchor is the last accepted token
        assert (input_ids[0, 1:] == self.config.mask_token_id).all()
        bad = self.corrupt[len(self.calls)] if len(self.calls) < len(self.corrupt) else None
        self.calls.append((start, target_hidden.clone()))
        logits = torch.zeros(1, q, self.config.vocab_size, device=input_ids.device)
        for k in range(1, q):
            tok = self.reference[start + k] if start + k < len(self.reference) else 0
            if k == bad:
                tok = (tok + 1) % self.config.vocab_size
            logits[0, k, tok] = 1.0
        return logits

    def compute_logits(self, hidden):
        return hidden
