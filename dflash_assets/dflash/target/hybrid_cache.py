"""The target's cache after a speculative verify step: back to exactly the accepted tokens, hybrid targets included.

A verify forward feeds the target ``[x_s, d_1 .. d_k]`` on top of its cache; when only ``[x_s, d_1 .. d_j]``
(``j < k``) are accepted the cache must forget the rest. Attention layers keep one key/value per token,
so cropping them is exact. Linear-attention layers (Gated DeltaNet in Qwen3.5/3.6, transformers'
``LinearAttentionCacheLayerMixin``) keep a short conv state and a recurrent state that have absorbed
every verified token and cannot be cropped: transformers' ``DynamicCache.crop`` raises on them, and its
``activate_past_recording`` keeps enough history to roll back the conv state only, not the recurrent
one. :class:`VerifyRollback` therefore snapshots those layers' states before the verify forward and, on
a partial acceptance, restores them and advances them over the accepted tokens:

* ``mixers`` (when every linear-attention decoder layer has its token mixer at ``.linear_attn``, as in
  transformers' Qwen3.5/3.6 and Qwen3-Next): a forward pre-hook keeps the input each mixer received in
  the verify forward; the rollback re-runs only the mixers, on their inputs at the accepted positions.
  Exact, since in a causal model the input of every layer at positions ``<= s + j`` does not depend on
  the later (rejected) tokens. Cost: each mixer's projections, conv and recurrence over ``j + 1`` tokens;
  no MLP, no full-attention layer, no LM head.
* ``forward`` (any other hybrid model): the attention layers are cropped back to ``s`` too and the whole
  target re-runs over the ``j + 1`` accepted tokens.
* ``none``: no linear-attention layer (Llama, Qwen3, SmolLM2): crop only, no snapshot, no hook (what
  plain models always cost).

SGLang instead keeps a state per draft position (``--mamba-scheduler-strategy extra_buffer``), which needs
kernels that write them; here the price is the re-run, counted in ``forwards`` / ``tokens``.

Plain torch + transformers; no Dagster.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from dflash_assets.dflash.target.features import find_decoder_layers

__all__ = ["ROLLBACK_MODES", "VerifyRollback", "crop_attention_layers"]

ROLLBACK_MODES = ("none", "mixers", "forward")


def _linear_layer_class():
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return LinearAttentionCacheLayerMixin


def crop_attention_layers(cache, keep: int) -> None:
    """Keep the first ``keep`` positions of every attention (key/value) layer of ``cache``; linear-attention
    layers are left as they are. A cache without linear-attention layers is cropped whole (``cache.crop``)."""
    linear = _linear_layer_class()
    remove = cache.get_seq_length() - keep
    if remove <= 0:
        return
    layers = getattr(cache, "layers", None)
    if not layers or not any(isinstance(layer, linear) for layer in layers):
        cache.crop(-remove)  # a negative value removes that many tokens (transformers 5)
        return
    for layer in layers:
        if not isinstance(layer, linear):
            layer.crop(-remove)


def _cache_kwarg_of(module: nn.Module) -> str | None:
    params = inspect.signature(module.forward).parameters
    for name in ("cache", "cache_params"):  # transformers 5 renames cache_params -> cache (old name until 5.40)
        if name in params:
            return name
    return None


class VerifyRollback:
    """Keeps a target's cache equal to its state after exactly the accepted tokens, step after step.

    Use as a context manager around one generation (it holds the mixers' pre-hooks), and around each
    verify forward call :meth:`before_verify` then :meth:`after_verify`.

    Args:
        target: the HF causal LM (or multimodal wrapper) being decoded.
        cache: its ``DynamicCache`` (built with the target's config, so the layer types are known).
        mode: ``"auto"`` (``mixers`` when the mixers are found, else ``forward``) or one of
            :data:`ROLLBACK_MODES`; a cache without linear-attention layers always uses ``none``.

    Attributes:
        mode: the mode in use.
        forwards: rollbacks run (each a pass of the linear-attention mixers, or a whole target forward).
        tokens: tokens those rollbacks re-ran.

    Raises:
        ValueError: an unknown mode, ``mixers`` without mixers, ``none`` with linear-attention layers, or a
            cache layer that is both linear attention and attention (not used by any target here; refused
            rather than handled wrongly).
    """

    def __init__(self, target: nn.Module, cache, mode: str = "auto") -> None:
        linear = _linear_layer_class()
        layers = list(getattr(cache, "layers", []) or [])
        self.cache = cache
        self.linear_ids = [i for i, layer in enumerate(layers) if isinstance(layer, linear)]
        both = [i for i in self.linear_ids if hasattr(layers[i], "keys")]
        if both:
            raise ValueError(f"cache layers {both} hold both a linear-attention state and keys/values: not supported")
        self.mixers: dict[int, nn.Module] = {}
        self.mixer_kwarg: dict[int, str] = {}
        if self.linear_ids:
            _, decoder_layers = find_decoder_layers(target)
            for i in self.linear_ids:
                mixer = getattr(decoder_layers[i], "linear_attn", None) if i < len(decoder_layers) else None
                kwarg = _cache_kwarg_of(mixer) if mixer is not None else None
                if kwarg is not None:
                    self.mixers[i], self.mixer_kwarg[i] = mixer, kwarg
        found = bool(self.linear_ids) and len(self.mixers) == len(self.linear_ids)
        if mode != "auto" and mode not in ROLLBACK_MODES:
            raise ValueError(f"rollback mode {mode!r} unknown: use auto or one of {ROLLBACK_MODES}")
        if not self.linear_ids:
            mode = "none"  # nothing to roll back: cropping is exact and free
        elif mode == "auto":
            mode = "mixers" if found else "forward"
        if mode == "mixers" and not found:
            raise ValueError(
                "rollback mode 'mixers' needs every linear-attention decoder layer's mixer at .linear_attn"
            )
        if mode == "none" and self.linear_ids:
            raise ValueError(
                f"the target has linear-attention layers {self.linear_ids}: rollback mode 'none' would not be lossless"
            )
        self.mode = mode
        self.forwards = 0
        self.tokens = 0
        self._snapshot: list[tuple[dict, dict]] | None = None
        self._inputs: dict[int, torch.Tensor] = {}
        self._capturing = False
        self._handles: list = []

    # -- hooks -------------------------------------------------------------------------------------

    def _pre_hook(self, layer_id: int):
        def hook(module, args, kwargs):
            if self._capturing:
                self._inputs[layer_id] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        return hook

    def __enter__(self) -> VerifyRollback:
        if self.mode == "mixers":
            for i, mixer in self.mixers.items():
                self._handles.append(mixer.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._inputs.clear()
        self._snapshot = None

    # -- the step ----------------------------------------------------------------------------------

    def before_verify(self, num_tokens: int) -> None:
        """Call right before a verify forward of ``num_tokens`` tokens: snapshots the linear-attention
        states (clones; nothing when ``num_tokens == 1``, which is always accepted, or without such layers)."""
        self._snapshot = None
        if self.mode == "none" or num_tokens <= 1:
            return
        snapshot = []
        for i in self.linear_ids:
            layer = self.cache.layers[i]
            conv = {k: v.clone() for k, v in layer.conv_states.items() if v is not None}
            recurrent = {k: v.clone() for k, v in layer.recurrent_states.items() if v is not None}
            snapshot.append((conv, recurrent))
        self._snapshot = snapshot
        self._capturing = self.mode == "mixers"

    def after_verify(
        self, start: int, num_verified: int, num_accepted: int, replay: Callable[[int], None] | None = None
    ) -> None:
        """Make the cache hold exactly positions ``< start + num_accepted`` after a verify forward that fed
        ``num_verified`` tokens at positions ``start ..``.

        Args:
            replay: ``replay(n)`` runs the target forward over the first ``n`` verified tokens at
                ``start ..`` on the cache (needed by mode ``forward`` only).

        Raises:
            ValueError: ``num_accepted`` outside ``1 .. num_verified``, or mode ``forward`` without ``replay``.
        """
        self._capturing = False
        if not 1 <= num_accepted <= num_verified:
            raise ValueError(f"num_accepted {num_accepted} outside 1..{num_verified}")
        keep = start + num_accepted
        if self.mode == "none" or num_accepted == num_verified or self._snapshot is None:
            crop_attention_layers(self.cache, keep)  # the linear states already hold exactly the accepted tokens
            self._snapshot, self._inputs = None, {}
            return
        for i, (conv, recurrent) in zip(self.linear_ids, self._snapshot):
            layer = self.cache.layers[i]
            for k, v in conv.items():
                layer.conv_states[k].copy_(v)  # in place: the cache keeps its tensors (static addresses)
            for k, v in recurrent.items():
                layer.recurrent_states[k].copy_(v)
        if self.mode == "mixers":
            crop_attention_layers(self.cache, keep)
            for i in self.linear_ids:
                self.mixers[i](
                    hidden_states=self._inputs[i][:, :num_accepted],
                    attention_mask=None,
                    **{self.mixer_kwarg[i]: self.cache},
                )
        else:
            if replay is None:
                raise ValueError("rollback mode 'forward' needs replay")
            crop_attention_layers(self.cache, start)
            replay(num_accepted)
        self.forwards += 1
        self.tokens += num_accepted
        self._snapshot, self._inputs = None, {}
