"""Reading hidden-state shards and building DFlash training batches.

Shard format (written by the ``hidden_states`` stage, one safetensors file per shard):

* ``hidden_states`` bf16 [total_tokens, n_layers * H]: target features of ``target_layer_ids``
  concatenated per token (HF ``hidden_states[i + 1]`` for each id ``i``);
* ``input_ids`` int32 [total_tokens]; ``loss_mask`` int8 [total_tokens] (1 on generated tokens);
* ``cu_seqlens`` int64 [rows + 1]: row ``r`` is tokens ``cu_seqlens[r] : cu_seqlens[r+1]``;
* optional ``row_index`` / ``prompt_index`` int64 [rows]: the rows' global prompt indices, used as the
  stable key of the held-out split (otherwise the key is ``<file name>:<row>``);
* optional metadata ``target_layer_ids`` (JSON list): checked to agree across shards and with the
  drafter.

Tensors are read lazily per row (safetensors slices are memory-mapped), so a shard is never loaded
whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_assets.dflash.model.masks import block_inputs, dflash_training_mask, valid_anchor_positions

REQUIRED_TENSORS = ("hidden_states", "input_ids", "loss_mask", "cu_seqlens")
INDEX_TENSORS = ("row_index", "prompt_index")


def heldout_fraction_of(key: str) -> float:
    """Stable uniform number in [0, 1) from a row key (first 8 bytes of SHA-256)."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclass(frozen=True)
class RowRef:
    """One sequence: ``shard`` (index into the shard list), ``row``, token range ``[start, end)``,
    its held-out ``key``, and ``length`` after truncation to ``max_length``."""

    shard: int
    row: int
    start: int
    end: int
    key: str
    length: int


class HiddenStateShards:
    """Rows (sequence samples) of a list of hidden-state shards, split into train / eval.

    A row is in ``eval`` when ``heldout_fraction_of(key) < eval_fraction`` (key: the row's prompt index
    if the shard stores one, else ``<file name>:<row>``), so the split never changes when shards are
    added or reordered. Rows are truncated to their first ``max_length`` tokens; rows with no valid
    anchor (no loss token with room for a block) are dropped.

    Args:
        paths: shard files (local paths).
        split: ``"train"``, ``"eval"`` or ``"all"``.
        eval_fraction: expected fraction of rows held out, in [0, 1).
        max_length: tokens kept per row (default 3072, as in DFlash training).
        block_size: used to drop rows with no valid anchor.

    Raises:
        FileNotFoundError: a shard is missing. KeyError: a required tensor is missing.
        ValueError: inconsistent lengths, feature widths or target_layer_ids across shards.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        *,
        split: str = "train",
        eval_fraction: float = 0.0,
        max_length: int = 3072,
        block_size: int = 16,
    ) -> None:
        if split not in ("train", "eval", "all"):
            raise ValueError(f"split must be train/eval/all, got {split!r}")
        self.paths = [str(p) for p in paths]
        self.split, self.eval_fraction, self.max_length, self.block_size = split, eval_fraction, max_length, block_size
        self._handles: dict[int, object] = {}
        self.rows: list[RowRef] = []
        self.feature_dim: int | None = None
        self.target_layer_ids: list[int] | None = None  # from shard metadata, when recorded
        self.dropped_rows = 0
        for si, path in enumerate(self.paths):
            if not Path(path).is_file():
                raise FileNotFoundError(path)
            self._index_shard(si, path)

    def _index_shard(self, si: int, path: str) -> None:
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            missing = [k for k in REQUIRED_TENSORS if k not in keys]
            if missing:
                raise KeyError(f"{path} lacks tensors {missing}")
            cu = f.get_tensor("cu_seqlens").to(torch.long)
            loss_mask = f.get_tensor("loss_mask")
            shape = f.get_slice("hidden_states").get_shape()
            n_ids = f.get_slice("input_ids").get_shape()[0]
            index = next((f.get_tensor(k).to(torch.long) for k in INDEX_TENSORS if k in keys), None)
            meta = f.metadata() or {}
        if "target_layer_ids" in meta:
            ids = [int(i) for i in json.loads(meta["target_layer_ids"])]
            if self.target_layer_ids is not None and ids != self.target_layer_ids:
                raise ValueError(f"{path}: target_layer_ids {ids} != {self.target_layer_ids} of earlier shards")
            self.target_layer_ids = ids
        total = int(cu[-1]) if cu.numel() else 0
        if not (shape[0] == n_ids == loss_mask.shape[0] == total):
            raise ValueError(
                f"{path}: hidden_states {shape[0]}, input_ids {n_ids}, loss_mask "
                f"{loss_mask.shape[0]} and cu_seqlens[-1] {total} differ"
            )
        if self.feature_dim is None:
            self.feature_dim = int(shape[1])
        elif self.feature_dim != int(shape[1]):
            raise ValueError(f"{path}: feature dim {shape[1]} != {self.feature_dim} of earlier shards")
        name = Path(path).name
        for r in range(cu.numel() - 1):
            start, end = int(cu[r]), int(cu[r + 1])
            key = f"idx:{int(index[r])}" if index is not None else f"{name}:{r}"
            held_out = heldout_fraction_of(key) < self.eval_fraction
            if (self.split == "train" and held_out) or (self.split == "eval" and not held_out):
                continue
            length = min(end - start, self.max_length)
            if valid_anchor_positions(loss_mask[start : start + length], self.block_size).numel() == 0:
                self.dropped_rows += 1
                continue
            self.rows.append(RowRef(si, r, start, end, key, length))

    def _handle(self, si: int):
        h = self._handles.get(si)
        if h is None:
            h = safe_open(self.paths[si], framework="pt")
            self._handles[si] = h
        return h

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        """Row ``i``: ``input_ids`` int64 [T], ``loss_mask`` int8 [T], ``hidden_states`` bf16 [T, D], ``key``."""
        ref = self.rows[i]
        f = self._handle(ref.shard)
        lo, hi = ref.start, ref.start + ref.length
        return {
            "input_ids": f.get_slice("input_ids")[lo:hi].to(torch.long),
            "loss_mask": f.get_slice("loss_mask")[lo:hi].to(torch.int8),
            "hidden_states": f.get_slice("hidden_states")[lo:hi],
            "key": ref.key,
        }

    @property
    def num_tokens(self) -> int:
        """Tokens over all kept rows after truncation."""
        return sum(r.length for r in self.rows)


@dataclass
class TrainingBatch:
    """A padded batch of B sequences with M blocks each (Q = M*block_size block tokens, C context tokens).

    ``context_hidden`` [B, C, D] (D = n_layers*H), ``block_input_ids`` / ``labels`` int64 [B, Q],
    ``label_mask`` bool [B, Q], ``position_ids`` int64 [B, C+Q], ``attention_mask`` bool [B, 1, Q, C+Q],
    ``num_block_tokens`` real (unpadded) block tokens, ``num_context_tokens`` real context tokens.
    Online features (samples without stored features, width 0): ``context_input_ids`` int64 [B, C]
    (right-padded) and ``context_lengths`` int64 [B] say what the target must compute; the training
    loop then replaces ``context_hidden`` with the target's features. None for offline batches.
    ``target_ids`` int64 [B, Q, k] / ``target_logprobs`` float32 [B, Q, k]: the target's top-k distribution of each
    block position's label (:mod:`~dflash_assets.dflash.target.tail`), when the samples carry it; else None.
    """

    context_hidden: torch.Tensor
    block_input_ids: torch.Tensor
    labels: torch.Tensor
    label_mask: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    num_block_tokens: int
    num_context_tokens: int
    context_input_ids: torch.Tensor | None = None
    context_lengths: torch.Tensor | None = None
    target_ids: torch.Tensor | None = None
    target_logprobs: torch.Tensor | None = None

    def to(self, device, non_blocking: bool = False) -> TrainingBatch:
        """Copy of the batch with all tensors on ``device``."""
        kw = dict(device=device, non_blocking=non_blocking)
        return TrainingBatch(
            self.context_hidden.to(**kw),
            self.block_input_ids.to(**kw),
            self.labels.to(**kw),
            self.label_mask.to(**kw),
            self.position_ids.to(**kw),
            self.attention_mask.to(**kw),
            self.num_block_tokens,
            self.num_context_tokens,
            None if self.context_input_ids is None else self.context_input_ids.to(**kw),
            self.context_lengths,
            None if self.target_ids is None else self.target_ids.to(**kw),
            None if self.target_logprobs is None else self.target_logprobs.to(**kw),
        )

    def pin_memory(self) -> TrainingBatch:
        """Page-locked copy (for asynchronous host-to-GPU copies)."""
        return TrainingBatch(
            self.context_hidden.pin_memory(),
            self.block_input_ids.pin_memory(),
            self.labels.pin_memory(),
            self.label_mask.pin_memory(),
            self.position_ids.pin_memory(),
            self.attention_mask.pin_memory(),
            self.num_block_tokens,
            self.num_context_tokens,
            None if self.context_input_ids is None else self.context_input_ids.pin_memory(),
            self.context_lengths,
            None if self.target_ids is None else self.target_ids.pin_memory(),
            None if self.target_logprobs is None else self.target_logprobs.pin_memory(),
        )


def collate_training_batch(
    samples: Sequence[dict], anchors: Sequence[torch.Tensor], block_size: int, mask_token_id: int
) -> TrainingBatch:
    """Pad rows and their sampled anchors into one :class:`TrainingBatch`.

    The context is cut at the largest anchor of the batch (features at positions >= every anchor are
    never visible). Padding blocks have anchor 0, all labels masked, and see only themselves. Samples that carry
    the target's distribution (``target_ids`` / ``target_logprobs`` [T, k], :mod:`~dflash_assets.dflash.target.tail`)
    give the batch its per-block-position copy; padding positions get ids 0 and log-probabilities -1e4.
    """
    bsz = len(samples)
    m_max = max(max((a.numel() for a in anchors), default=0), 1)
    c_len = max((int(a.max()) for a in anchors if a.numel()), default=0)
    d = samples[0]["hidden_states"].shape[1]
    q = m_max * block_size
    ctx = torch.zeros(bsz, c_len, d, dtype=samples[0]["hidden_states"].dtype)
    block_ids = torch.full((bsz, q), int(mask_token_id), dtype=torch.long)
    labels = torch.zeros(bsz, q, dtype=torch.long)
    label_mask = torch.zeros(bsz, q, dtype=torch.bool)
    pos = torch.zeros(bsz, c_len + q, dtype=torch.long)
    pos[:, :c_len] = torch.arange(c_len)
    pos[:, c_len:] = torch.arange(q) % block_size  # padding blocks: anchor 0
    attn = torch.zeros(bsz, 1, q, c_len + q, dtype=torch.bool)
    online = d == 0  # no stored features: the target computes them from these context tokens
    ctx_ids = torch.zeros(bsz, c_len, dtype=torch.long) if online else None
    ctx_lengths = torch.zeros(bsz, dtype=torch.long) if online else None
    target_ids = target_logprobs = None  # the target's top-k per position, when the rows carry it (dflash.target.tail)
    if "target_ids" in samples[0]:
        k = samples[0]["target_ids"].shape[1]
        target_ids = torch.zeros(bsz, q, k, dtype=torch.long)
        target_logprobs = torch.full((bsz, q, k), -1e4, dtype=torch.float32)
    n_block = n_ctx = 0
    for b, (s, a) in enumerate(zip(samples, anchors)):
        m = a.numel()
        n_ctx += int(s["input_ids"].shape[0])
        c = min(c_len, s["hidden_states"].shape[0])
        ctx[b, :c] = s["hidden_states"][:c]
        if online:
            ctx_ids[b, :c] = s["input_ids"][:c]
            ctx_lengths[b] = c
        padded = torch.cat([a.to(torch.long), torch.zeros(m_max - m, dtype=torch.long)])
        attn[b, 0] = dflash_training_mask(padded, block_size, c_len)
        if m == 0:
            continue
        blk = block_inputs(s["input_ids"], s["loss_mask"], a, block_size, mask_token_id)
        n = m * block_size
        n_block += n
        block_ids[b, :n] = blk["block_input_ids"]
        labels[b, :n] = blk["labels"]
        label_mask[b, :n] = blk["label_mask"]
        pos[b, c_len : c_len + n] = blk["block_position_ids"]
        if target_ids is not None:
            target_ids[b, :n] = s["target_ids"][blk["block_position_ids"]].to(torch.long)
            target_logprobs[b, :n] = s["target_logprobs"][blk["block_position_ids"]].to(torch.float32)
    return TrainingBatch(
        ctx, block_ids, labels, label_mask, pos, attn, n_block, n_ctx, ctx_ids, ctx_lengths, target_ids, target_logprobs
    )


def iter_rows(dataset: HiddenStateShards, order: Iterable[int]):
    """Yield ``dataset[i]`` for ``i`` in ``order``."""
    for i in order:
        yield dataset[i]


__all__ = [
    "HiddenStateShards",
    "RowRef",
    "TrainingBatch",
    "collate_training_batch",
    "heldout_fraction_of",
    "iter_rows",
]
