"""Online target features: the frozen target computes each training batch's features; nothing is stored.

Plain torch + transformers; no Dagster imports. Offline training reads features from hidden-state
shards (:class:`~dflash_assets.dflash.shards.dataset.HiddenStateShards`); online training reads the tokenized
rows (:class:`TokenizedRows`, same row order, held-out split, truncation and dropping rules) and runs
the target over the context of each batch (:class:`OnlineTargetFeatures`, built on
:class:`~dflash_assets.dflash.target.features.TargetFeatureExtractor`). The features are cast to the
dtype the shards store (bf16), so online and offline training see the same numbers up to the
target's own batch-shape rounding.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from dflash_assets.dflash.model.masks import valid_anchor_positions
from dflash_assets.dflash.shards.dataset import RowRef, heldout_fraction_of
from dflash_assets.dflash.target.features import TargetFeatureExtractor

__all__ = ["OnlineTargetFeatures", "TokenizedRows", "load_frozen_target", "read_tokenized_rows"]


def read_tokenized_rows(paths: Sequence[str | os.PathLike]) -> list[dict]:
    """Rows ``{index, input_ids, loss_mask}`` of tokenized_sequences parquet files, each file sorted by
    ``index`` (the order hidden-state shards store them in), files in the given order.

    ``input_ids`` / ``loss_mask`` are numpy views into the files' decoded Arrow buffers (int32 / int8),
    not Python lists: a few bytes per token, which is what lets a rank hold billions of tokens.

    Raises:
        FileNotFoundError: a file is missing. KeyError: a file lacks ``index``/``input_ids``/``loss_mask``.
    """
    import numpy as np
    import polars as pl

    rows: list[dict] = []
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(path)
        df = pl.read_parquet(path, columns=["index", "input_ids", "loss_mask"]).sort("index")
        # one writable buffer per file (torch wants writable memory); rows are views into it
        ids = np.array(df["input_ids"].cast(pl.List(pl.Int32)).explode().to_numpy(), dtype=np.int32)
        masks = np.array(df["loss_mask"].cast(pl.List(pl.Int8)).explode().to_numpy(), dtype=np.int8)
        lengths = df["input_ids"].list.len().to_numpy()
        if not np.array_equal(lengths, df["loss_mask"].list.len().to_numpy()):
            bad = df["index"].to_numpy()[lengths != df["loss_mask"].list.len().to_numpy()][:5].tolist()
            raise ValueError(f"{path}: rows {bad} have loss_mask and input_ids of different lengths")
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
        for k, index in enumerate(df["index"].to_list()):
            lo, hi = offsets[k], offsets[k + 1]
            rows.append({"index": index, "input_ids": ids[lo:hi], "loss_mask": masks[lo:hi]})
    return rows


class TokenizedRows:
    """Training rows from tokenized sequences, indexed like :class:`HiddenStateShards` of the same rows.

    Same rules as the shards: key ``idx:<prompt index>``, held out when ``heldout_fraction_of(key) <
    eval_fraction``, truncated to ``max_length`` tokens, dropped when no anchor fits. Row order is the
    order of ``rows`` (pass them sorted by index within each partition, partitions in shard order).

    ``__getitem__`` returns ``input_ids`` int64 [T], ``loss_mask`` int8 [T], ``key``, and
    ``hidden_states`` [T, D]: computed by ``features`` for that row when it is set (evaluation), else a
    zero-width [T, 0] placeholder that the training loop replaces with batched features.

    Args:
        rows: dicts ``{index, input_ids, loss_mask}``.
        features: optional :class:`OnlineTargetFeatures` (sets ``feature_dim`` / ``target_layer_ids``).
    """

    def __init__(
        self,
        rows: Sequence[dict],
        *,
        split: str = "train",
        eval_fraction: float = 0.0,
        max_length: int = 3072,
        block_size: int = 16,
        features: OnlineTargetFeatures | None = None,
    ) -> None:
        if split not in ("train", "eval", "all"):
            raise ValueError(f"split must be train/eval/all, got {split!r}")
        self.split, self.eval_fraction, self.max_length, self.block_size = split, eval_fraction, max_length, block_size
        self.features = features
        self.feature_dim: int | None = features.feature_size if features is not None else None
        self.target_layer_ids: list[int] | None = list(features.target_layer_ids) if features is not None else None
        self.dropped_rows = 0
        self._ids: list[torch.Tensor] = []
        self._masks: list[torch.Tensor] = []
        self.rows: list[RowRef] = []
        for r in rows:
            ids = torch.as_tensor(r["input_ids"], dtype=torch.int32).reshape(-1)  # int32 kept: 4 bytes per token
            mask = torch.as_tensor(r["loss_mask"], dtype=torch.int8).reshape(-1)
            if ids.numel() != mask.numel():
                raise ValueError(f"row {r['index']}: loss_mask has {mask.numel()} entries, input_ids {ids.numel()}")
            key = f"idx:{int(r['index'])}"
            held_out = heldout_fraction_of(key) < eval_fraction
            if (split == "train" and held_out) or (split == "eval" and not held_out):
                continue
            length = min(ids.numel(), max_length)
            if valid_anchor_positions(mask[:length], block_size).numel() == 0:
                self.dropped_rows += 1
                continue
            self.rows.append(RowRef(len(self._ids), 0, 0, ids.numel(), key, length))
            self._ids.append(ids[:length])
            self._masks.append(mask[:length])

    def attach(self, features: OnlineTargetFeatures) -> None:
        """Use ``features`` for the feature width / layer ids (and per-row features in ``__getitem__``)."""
        self.features = features
        self.feature_dim = features.feature_size
        self.target_layer_ids = list(features.target_layer_ids)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        ref = self.rows[i]
        ids, mask = self._ids[ref.shard].to(torch.long), self._masks[ref.shard]
        if self.features is not None and getattr(self, "_per_row", True):
            hidden = self.features(ids.unsqueeze(0), torch.tensor([ids.numel()]))[0].cpu()
        else:
            hidden = torch.empty(ids.numel(), 0, dtype=torch.bfloat16)
        return {"input_ids": ids, "loss_mask": mask, "hidden_states": hidden, "key": ref.key}

    def tokens_only(self) -> TokenizedRows:
        """A view whose ``__getitem__`` never runs the target (the training loop batches the features)."""
        view = object.__new__(TokenizedRows)
        view.__dict__.update(self.__dict__)
        view._per_row = False
        return view

    @property
    def num_tokens(self) -> int:
        """Tokens over all kept rows after truncation."""
        return sum(r.length for r in self.rows)


def load_frozen_target(
    model_path: str | os.PathLike, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """The target causal LM, frozen: ``eval()``, ``requires_grad_(False)``, on ``device``.

    ``dtype`` default: bf16 on CUDA, float32 on CPU (CPU bf16 matmuls are slow and less exact).
    """
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    return freeze(model.to(device))


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in eval mode with every parameter's ``requires_grad`` off (returned for chaining)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class OnlineTargetFeatures:
    """Batched target features of right-padded context tokens, computed on the fly.

    Args:
        model: frozen HF target (see :func:`load_frozen_target`).
        target_layer_ids: decoder layer ids, as for the shards.
        dtype: dtype of the returned features; bf16 = what the shards store (online equals offline).

    Attributes:
        forwards: number of target forward passes run (tests count them).
        tokens: real (unpadded) context tokens processed.
        kernels: which linear-attention kernels the target runs, when the trainer recorded it
            (:func:`~dflash_assets.dflash.target.kernels.linear_attention_kernels` summary), else None.
    """

    def __init__(
        self, model: torch.nn.Module, target_layer_ids: Sequence[int], dtype: torch.dtype = torch.bfloat16
    ) -> None:
        self.model = freeze(model)
        self.extractor = TargetFeatureExtractor(model, target_layer_ids)
        self.target_layer_ids = list(self.extractor.target_layer_ids)
        self.feature_size = self.extractor.feature_size
        self.dtype = dtype
        self.forwards = 0
        self.tokens = 0
        self.kernels: str | None = None
        try:
            self.device = next(model.parameters()).device
        except StopIteration:
            self.device = torch.device("cpu")

    def __call__(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Features ``[B, C, len(target_layer_ids) * H]`` (``self.dtype``, on the target's device) of
        ``input_ids`` int [B, C] whose row ``b`` holds ``lengths[b]`` real tokens then padding; padded
        positions are zero, as in a collated offline batch. A normal tensor (not an inference tensor),
        so the drafter can backpropagate through its own use of it."""
        batch, c = input_ids.shape
        if c == 0 or batch == 0:
            return torch.zeros(batch, c, self.feature_size, dtype=self.dtype, device=self.device)
        lengths = lengths.to(torch.long).cpu()
        positions = torch.arange(c)
        attention = (positions.unsqueeze(0) < lengths.unsqueeze(1)).to(torch.long)
        ids = input_ids.to(self.device, dtype=torch.long)
        feats = self.extractor(ids, attention.to(self.device), dtype=self.dtype)  # inference_mode inside
        self.forwards += 1
        self.tokens += int(lengths.clamp(max=c).sum())
        out = feats.clone()  # outside inference mode: a tensor autograd may save
        out.masked_fill_(attention.to(self.device).eq(0).unsqueeze(-1), 0)
        return out
