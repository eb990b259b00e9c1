"""Target-model hidden states for DFlash: layer choice, early-stopping capture, batching, disk budget.

Plain torch + transformers; no Dagster imports. The drafter is conditioned on the outputs of a few
target decoder layers, concatenated along the feature axis (DFlash, z-lab/dflash
``extract_context_feature``: ``torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)``).
``TargetFeatureExtractor`` computes exactly those features without keeping every layer's output and
without running the decoder layers after the last needed one or the LM head.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from dflash_assets.dflash.target.layers import text_config

__all__ = [
    "InsufficientDiskSpaceError",
    "TargetFeatureExtractor",
    "bytes_per_token",
    "check_free_space",
    "estimate_bytes",
    "find_decoder_layers",
    "iter_batches_by_token_budget",
]

# Bytes a shard stores per token besides the hidden states: input_ids (int32) + loss_mask (int8).
TOKEN_SIDE_BYTES = 4 + 1
# Bytes a shard stores per row: cu_seqlens (int64, one extra per shard) + row_index (int64).
ROW_BYTES = 8 + 8
# Upper bound on the per-shard safetensors header (JSON + 8-byte length + padding) and index entry.
SHARD_OVERHEAD_BYTES = 4096


def find_decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """Return ``(base_model, decoder_layers)`` of an HF decoder-only model.

    Accepts a ``*ForCausalLM`` (layers at ``model.model.layers``, Llama/Qwen/Mistral style), the
    bare base model (``model.layers``) or a multimodal wrapper whose text decoder is
    ``model.model.language_model``. Calling ``base_model`` skips the LM head.

    Raises:
        TypeError: no ``layers`` ModuleList is found.
    """
    inner = getattr(model, "model", None)
    # Causal LMs keep the decoder at .model; multimodal wrappers (e.g. Qwen3.5/3.6
    # *ForConditionalGeneration) at .model.language_model.
    for base in (inner, model, getattr(inner, "language_model", None), getattr(model, "language_model", None)):
        layers = getattr(base, "layers", None) if base is not None else None
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return base, layers
    raise TypeError(f"cannot find decoder layers (model.model.layers or model.layers) in {type(model).__name__}")


class _StopForward(Exception):
    """Raised by the hook of the last needed layer to end the forward pass early."""


class TargetFeatureExtractor:
    """Capture the outputs of ``target_layer_ids`` and stop the forward after the last of them.

    Forward hooks are registered on the needed decoder layers for the duration of one call only (the
    model is left unmodified). Each hook copies its layer's output straight into its slice of the
    result, cast to the requested dtype, so no list of all layers' hidden states is ever held. The hook
    of the deepest needed layer then raises a private exception that ``__call__`` catches: the layers
    after it, the final norm and the LM head are never computed. The KV cache is disabled.

    Matches HF exactly: for ``i < L - 1`` HF ``hidden_states[i + 1]`` is the raw output of decoder layer
    ``i``; for ``i == L - 1`` transformers replaces it with the final-norm output, so the extractor
    applies the base model's ``norm`` for that id too.

    Args:
        model: HF decoder-only model (see ``find_decoder_layers``); put it in ``eval()`` mode first.
        target_layer_ids: 0-based decoder layer ids, concatenated in the given order (duplicates allowed).

    Raises:
        ValueError: empty ids or an id outside ``[0, num_layers)``.
    """

    def __init__(self, model: nn.Module, target_layer_ids: Sequence[int]):
        self.model = model
        self.base_model, self.layers = find_decoder_layers(model)
        self.num_layers = len(self.layers)
        self.target_layer_ids = [int(i) for i in target_layer_ids]
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside [0, {self.num_layers}) for this model")
        self.hidden_size = int(text_config(model).hidden_size)
        self.last_layer_id = max(self.target_layer_ids)
        self.final_norm = getattr(self.base_model, "norm", None)

    @property
    def feature_size(self) -> int:
        """Features per token in the output: ``len(target_layer_ids) * hidden_size``."""
        return len(self.target_layer_ids) * self.hidden_size

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """Target features of a (right-)padded batch.

        Args:
            input_ids: int tensor ``[B, T]`` on the model's device.
            attention_mask: ``[B, T]``, 1 for real tokens, 0 for padding (pad on the right so that
                positions ``0..len-1`` get position ids ``0..len-1``, as in an unpadded forward).
            dtype: dtype of the result (``torch.bfloat16`` for storage).

        Returns:
            ``[B, T, len(target_layer_ids) * hidden_size]`` on the model's device; slice ``k`` along the
            last axis is layer ``target_layer_ids[k]``. Values at padded positions are unspecified.

        Raises:
            RuntimeError: a needed layer did not run (unexpected model structure).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        batch, seq_len = input_ids.shape
        hidden = self.hidden_size
        out = torch.empty(batch, seq_len, self.feature_size, dtype=dtype, device=input_ids.device)
        slots: dict[int, list[int]] = {}
        for k, layer_id in enumerate(self.target_layer_ids):
            slots.setdefault(layer_id, []).append(k)
        seen: set[int] = set()

        def make_hook(layer_id: int):
            def hook(module, args, output):
                states = output[0] if isinstance(output, (tuple, list)) else output
                if layer_id == self.num_layers - 1 and self.final_norm is not None:
                    states = self.final_norm(states)  # HF ties hidden_states[L] to the normed output
                for k in slots[layer_id]:
                    out[..., k * hidden : (k + 1) * hidden].copy_(states)
                seen.add(layer_id)
                if layer_id == self.last_layer_id:
                    raise _StopForward

            return hook

        handles = [self.layers[i].register_forward_hook(make_hook(i)) for i in slots]
        try:
            self.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        if seen != set(slots):
            raise RuntimeError(f"layers {sorted(set(slots) - seen)} did not run; unsupported model structure")
        return out


def iter_batches_by_token_budget(lengths: Sequence[int], max_tokens_per_batch: int) -> Iterator[list[int]]:
    """Group rows into padded batches of at most ``max_tokens_per_batch`` tokens (``B * max_len``).

    Rows are taken longest first (ties by position, so the plan is deterministic), which keeps
    lengths within a batch close (little padding) and puts the largest batch first (an out-of-memory
    shows up at once). A row longer than the budget forms a batch of its own.

    Args:
        lengths: tokens per row.
        max_tokens_per_batch: budget in padded tokens (>= 1).

    Yields:
        Lists of positions into ``lengths``; every position appears exactly once.
    """
    if max_tokens_per_batch < 1:
        raise ValueError(f"max_tokens_per_batch must be >= 1, got {max_tokens_per_batch}")
    order = sorted(range(len(lengths)), key=lambda p: (-int(lengths[p]), p))
    batch: list[int] = []
    batch_max = 0
    for pos in order:
        length = int(lengths[pos])
        new_max = max(batch_max, length)
        if batch and (len(batch) + 1) * new_max > max_tokens_per_batch:
            yield batch
            batch, new_max = [], length
        batch.append(pos)
        batch_max = new_max
    if batch:
        yield batch


def bytes_per_token(n_layers: int, hidden_size: int, dtype_bytes: int = 2) -> int:
    """Shard bytes per token: ``n_layers * hidden_size * dtype_bytes`` hidden-state bytes plus 5 bytes
    of ``input_ids`` (int32) and ``loss_mask`` (int8). Qwen3.6-27B, 5 layers: 5*5120*2 + 5 = 51,205."""
    return n_layers * hidden_size * dtype_bytes + TOKEN_SIDE_BYTES


def estimate_bytes(
    num_tokens: int,
    n_layers: int,
    hidden_size: int,
    dtype_bytes: int = 2,
    num_rows: int = 0,
    num_shards: int = 0,
) -> int:
    """Bytes the shards of ``num_tokens`` tokens take on disk (an upper bound when rows/shards are given).

    ``num_tokens * bytes_per_token(...) + num_rows * 16 + num_shards * 4104`` (row_index and
    cu_seqlens are int64; each shard has one extra cu_seqlens entry and a header under 4 KiB).
    """
    return (
        int(num_tokens) * bytes_per_token(n_layers, hidden_size, dtype_bytes)
        + int(num_rows) * ROW_BYTES
        + int(num_shards) * (SHARD_OVERHEAD_BYTES + 8)
    )


class InsufficientDiskSpaceError(OSError):
    """Not enough free space for the planned hidden-state shards."""

    def __init__(self, path: str, needed_bytes: int, free_bytes: int, margin: float):
        self.path, self.needed_bytes, self.free_bytes, self.margin = path, needed_bytes, free_bytes, margin
        super().__init__(
            f"not enough disk space at {path}: need {needed_bytes:,} bytes ({needed_bytes / 2**30:.2f} GiB) "
            f"plus a {margin:.0%} margin, but only {free_bytes:,} bytes ({free_bytes / 2**30:.2f} GiB) are free; "
            "free space, write fewer rows (a subset), or point the output elsewhere"
        )


def check_free_space(path: str | os.PathLike, needed_bytes: int, margin: float = 0.05) -> int:
    """Check that the filesystem holding ``path`` has ``needed_bytes * (1 + margin)`` bytes free.

    ``path`` need not exist yet: its nearest existing ancestor is checked. Free bytes are those
    available to this user (``shutil.disk_usage(...).free``, i.e. ``statvfs`` ``f_bavail``).

    Returns:
        The free bytes found.

    Raises:
        InsufficientDiskSpaceError: naming the path, the bytes needed and the bytes free.
    """
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed_bytes * (1.0 + margin) > free:
        raise InsufficientDiskSpaceError(str(path), int(needed_bytes), int(free), margin)
    return free
