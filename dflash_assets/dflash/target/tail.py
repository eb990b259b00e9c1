"""The target's own next-token distribution at every position of a training row, from its stored features (plain
torch + transformers; no Dagster imports): what the drafter is distilled to with the training settings
``distill_weight`` and ``loss_positions: all``.

Why: the drafter is judged by greedy verification, which accepts a draft when it equals the target's argmax, while
its training labels are sampled tokens (temperature 0.6 in the demo) and cover only the generated part of a row.
The target's distribution gives (a) soft labels at the same positions (knowledge distillation, Hinton et al. 2015,
arXiv 1503.02531; DistillSpec, Zhou et al. 2023, arXiv 2310.08461, aligns a draft model with its target this way
and reports higher acceptance) and (b) labels at the context's positions too, where no token of the target's own
exists: the target's argmax there is what greedy decoding would have produced.

How, without a second full target forward: the shards hold the outputs of ``target_layer_ids``; the deepest of
them, ``s``, is the input of decoder layer ``s + 1``. :class:`TargetTail` runs the target's layers ``s+1 .. L-1``
over the whole row (causal attention, positions ``0..T-1``), its final norm and its LM head, and keeps the top-``k``
log-probabilities. For SmolLM2-135M (features [1, 8, 14, 20, 27] of 30 layers) that is 2 of 30 layers plus the LM
head; on bf16-stored features its argmax equals the full forward's at 99.6-100% of positions (measured on the demo's
shards). When ``s`` is the last layer its stored output is already normalised (HF ``hidden_states[L]``): only the
LM head runs. :class:`WithTargetDistribution` gives a training dataset's rows that distribution.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash_assets.dflash.target.features import find_decoder_layers

__all__ = ["TargetTail", "WithTargetDistribution"]

EMPTY_LOGPROB = -1e4  # the log-probability of a row with no distribution (position 0: never a label)


class TargetTail:
    """Top-``k`` next-token log-probabilities of the target at every position of a row, from its stored features.

    Args:
        model_dir: the target's HF directory; the causal LM is loaded frozen (``dtype``, ``device``) and only the
            decoder layers after the deepest feature layer, the final norm and the LM head are kept.
        target_layer_ids: the feature layers of the shards, in their stored order.
        topk: log-probabilities kept per position.
        device, dtype: where and in what precision the tail runs (float32 on CPU by default).

    Raises:
        TypeError: a model whose decoder layers cannot be found
            (:func:`~dflash_assets.dflash.target.features.find_decoder_layers`).
    """

    def __init__(
        self,
        model_dir: str | Path,
        target_layer_ids: list[int],
        topk: int = 20,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        base, layers = find_decoder_layers(model)
        self.feature_layer = max(target_layer_ids)
        self.slot = list(target_layer_ids).index(self.feature_layer)
        self.tail = nn.ModuleList(layers[self.feature_layer + 1 :])
        self.norm = getattr(base, "norm", None)
        self.rotary = getattr(base, "rotary_emb", None)
        self.head = model.get_output_embeddings()
        self.hidden_size = int(self.head.weight.shape[1])
        self.topk = int(topk)
        self.device = torch.device(device)
        self.dtype = dtype
        for module in (self.tail, self.norm, self.rotary, self.head):
            if module is not None:
                module.to(self.device).eval()
                for p in module.parameters():
                    p.requires_grad_(False)

    @torch.no_grad()
    def __call__(self, features: torch.Tensor, chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's distribution over one row.

        Args:
            features: [T, n*H] the row's stored features (any float dtype; the slot of the deepest layer is read).
            chunk: positions per LM-head call (bounds the [chunk, V] logits in memory).

        Returns:
            ``(ids, logprobs)``: int32 [T, k] token ids and float16 [T, k] natural-log probabilities, best first, on
            the CPU. Row ``t >= 1`` is the target's distribution of token ``t`` (computed at position ``t - 1``);
            row 0 is empty (ids 0, log-probabilities ``EMPTY_LOGPROB``: a label is never at position 0).
        """
        h, t = self.hidden_size, features.shape[0]
        x = features[:, self.slot * h : (self.slot + 1) * h].to(self.device, self.dtype)[None]
        if self.tail:
            positions = torch.arange(t, device=self.device)[None]
            rotary = self.rotary(x, positions) if self.rotary is not None else None
            for layer in self.tail:
                out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary)
                x = out[0] if isinstance(out, (tuple, list)) else out
            if self.norm is not None:
                x = self.norm(x)
        x = x[0]
        ids = torch.zeros(t, self.topk, dtype=torch.int32)
        logprobs = torch.full((t, self.topk), EMPTY_LOGPROB, dtype=torch.float16)
        for lo in range(0, t - 1, chunk):
            hi = min(t - 1, lo + chunk)
            top = torch.log_softmax(self.head(x[lo:hi]).float(), dim=-1).topk(self.topk, dim=-1)
            ids[lo + 1 : hi + 1] = top.indices.to(torch.int32).cpu()
            logprobs[lo + 1 : hi + 1] = top.values.to(torch.float16).cpu()
        return ids, logprobs


class WithTargetDistribution:
    """A training dataset (:class:`~dflash_assets.dflash.shards.dataset.HiddenStateShards`) whose rows also carry the
    target's distribution (:class:`TargetTail`, computed once per row and kept: ``6 * topk`` bytes per token), as
    ``target_ids`` int32 [T, k] and ``target_logprobs`` float16 [T, k].

    ``all_positions``: every position but the first becomes a label position (``loss_mask`` all ones after
    position 0), so anchors and labels may lie in the context too; the loss then takes the target's argmax as the
    hard label (``target_labels``), since the context's tokens are not the target's own. Every other attribute is
    the wrapped dataset's.
    """

    def __init__(self, dataset, tail: TargetTail, all_positions: bool = False) -> None:
        self.dataset = dataset
        self.tail = tail
        self.all_positions = all_positions
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str):
        if name == "dataset":  # not set yet (unpickling): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, i: int) -> dict:
        """Row ``i`` of the wrapped dataset with ``target_ids`` and ``target_logprobs`` added (and its
        ``loss_mask`` all ones after position 0 with ``all_positions``)."""
        sample = dict(self.dataset[i])
        if i not in self._cache:
            self._cache[i] = self.tail(sample["hidden_states"])
        sample["target_ids"], sample["target_logprobs"] = self._cache[i]
        if self.all_positions:
            mask = torch.ones_like(sample["loss_mask"])
            mask[0] = 0
            sample["loss_mask"] = mask
        return sample
