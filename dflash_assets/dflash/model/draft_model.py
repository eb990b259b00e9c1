"""DFlash draft model: a few Qwen3-style decoder layers conditioned on target hidden states.

Architecture (paper arXiv 2602.06036; reference inference code z-lab/dflash ``dflash/model.py``):

* the target's hidden states from ``len(target_layer_ids)`` layers are concatenated per token
  (``[T, n*H]``) and projected by ``fc`` (Linear(n*H -> H, no bias)) then ``hidden_norm`` (RMSNorm);
* every draft layer's attention takes queries from the block tokens only, and keys/values from
  ``[projected context features ; block tokens]`` (the context is *not* passed through the layer's
  ``input_layernorm``; ``k_norm`` is applied to both parts, as in the reference);
* attention is non-causal (bidirectional inside a block) in ``full_attention`` layers; a
  ``sliding_attention`` layer (``DFlashConfig.layer_types``, window ``sliding_window``) is causal and sees
  only keys at positions ``p`` with ``q - sliding_window < p <= q`` for a query at position ``q`` (the
  Hugging Face convention, the window counting the query itself; z-lab/dflash ``Qwen3DFlashAttention``
  and SGLang's DFlash loader, which maps such layers to causal attention with ``window_left =
  sliding_window - 1``);
* at inference the context's per-layer keys/values depend only on the target features and their
  positions, so :class:`ContextCache` keeps them and each step projects only the newly accepted
  positions (:meth:`DFlashDraftModel.extend_context`, :meth:`DFlashDraftModel.forward_block`);
* the token embedding and the LM head are the target's, frozen, and never saved with the drafter:
  they are held as non-persistent buffers, so ``state_dict()`` holds only ``layers.*``, ``fc.weight``,
  ``hidden_norm.weight`` and ``norm.weight`` -- the tensor names SGLang's ``DFlashDraftModel`` loads.

Block layout at inference: ``[last accepted token, MASK x (block_size-1)]`` at positions
``start .. start+block_size-1``; the context is the target's features at positions ``< start``; the
output at block position ``k >= 1`` predicts the token at ``start + k`` (no extra shift).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_assets.dflash.model.draft_config import (  # the config lived here; imported from here by many
    DFlashConfig,
)


def sliding_window_mask(position_ids: torch.Tensor, num_queries: int, window: int) -> torch.Tensor:
    """bool [B, 1, Q, K] (True = may attend) of a ``sliding_attention`` layer, from absolute positions.

    ``position_ids`` [B, K] are the keys' positions (context then block); the queries are the last
    ``num_queries``. A query at ``q`` sees a key at ``p`` iff ``p <= q`` and ``q - p < window``.
    """
    kpos = position_ids[:, None, :]
    qpos = position_ids[:, -num_queries:, None]
    return ((kpos <= qpos) & (qpos - kpos < window))[:, None]


def _combine_masks(base: torch.Tensor | None, allowed: torch.Tensor) -> torch.Tensor:
    """``base`` (bool, additive float or None) restricted to ``allowed`` (bool), in ``base``'s form."""
    if base is None:
        return allowed
    if base.dtype == torch.bool:
        return base & allowed
    return base.masked_fill(~allowed, float("-inf"))


class ContextCache:
    """Keys and values of the drafter's context, per draft layer, for incremental speculative decoding.

    ``keys[l]`` / ``values[l]``: [1, num_key_value_heads, C, head_dim] for layer ``l`` (RoPE applied to
    the keys), for context positions ``0 .. C-1``; ``length`` is C. Filled by
    :meth:`DFlashDraftModel.extend_context`.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32: ``x / sqrt(mean(x^2) + eps) * weight``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` normalised, scaled by ``weight`` (default: this norm's own)."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight if weight is None else weight) * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Default (neox-style) RoPE tables for ``position_ids`` [B, L] -> cos, sin [B, L, head_dim]."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    )
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from [context ; block]; Qwen3 q/k RMSNorm; RoPE; no causal mask."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        # The k_norm weight the context's keys take instead of k_norm's, [head_dim]; None: k_norm's (the model).
        # Set only to replay an engine that computes otherwise (engine_replay.with_context_k_norm_of_layer0).
        self.register_buffer("context_k_norm_weight", None, persistent=False)

    def kv(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, RoPE) and values of ``h`` [B, L, H] at the positions of ``cos``/``sin`` [B, L, head_dim]:
        two [B, num_key_value_heads, L, head_dim] tensors. ``context``: ``h`` is the projected context (its keys
        take ``context_k_norm_weight`` when set)."""
        b, n, _ = h.shape
        weight = self.context_k_norm_weight if context else None
        k = self.k_norm(self.k_proj(h).view(b, n, self.num_kv_heads, self.head_dim), weight).transpose(1, 2)
        v = self.v_proj(h).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return k * cos[:, None] + _rotate_half(k) * sin[:, None], v

    def forward(self, x, context, cos, sin, attention_mask, context_kv=None):
        """``x`` [B, Q, H] block; ``context`` [B, C, H] projected context, or None with ``context_kv``
        (its cached keys/values, :meth:`kv`); ``cos``/``sin`` [B, C+Q, head_dim]; mask [B|1, 1, Q, C+Q] or None."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        cq, sq = cos[:, None, -q_len:], sin[:, None, -q_len:]
        q = q * cq + _rotate_half(q) * sq
        kx, vx = self.kv(x, cos[:, -q_len:], sin[:, -q_len:])
        kc, vc = context_kv if context_kv is not None else self.kv(context, cos[:, :-q_len], sin[:, :-q_len], True)
        k, v = torch.cat([kc, kx], dim=2), torch.cat([vc, vx], dim=2)
        if self.num_kv_heads != self.num_heads:
            # Expanded explicitly so that SDPA can pick its masked memory-efficient kernel.
            rep = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x), context)`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x, context, cos, sin, attention_mask, context_kv=None):
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, attention_mask, context_kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """The DFlash drafter. Trainable state: ``layers.*``, ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``.

    The target's embedding ``[vocab, H]`` and LM head ``[vocab, H]`` are attached with
    :meth:`attach_target` as non-persistent buffers: they follow ``.to(device)``, receive no gradient,
    and are absent from ``state_dict()`` and ``parameters()``.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.num_context_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("target_embed_weight", None, persistent=False)
        self.register_buffer("target_lm_head_weight", None, persistent=False)
        self.reset_parameters()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def reset_parameters(self, std: float = 0.02, seed: int | None = None) -> None:
        """Normal(0, std) linear weights, zero biases, unit norm weights (Qwen3 ``initializer_range``)."""
        gen = None
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    w = torch.empty(module.weight.shape).normal_(0.0, std, generator=gen)
                    module.weight.copy_(w)
                    if module.bias is not None:
                        module.bias.zero_()
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def attach_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None) -> DFlashDraftModel:
        """Attach the target's frozen embedding and LM head (``[vocab_size, hidden_size]`` each).

        ``lm_head_weight`` defaults to ``embed_weight`` (tied embeddings). Tensors are detached and
        moved to this model's parameter device.

        Raises:
            ValueError: a shape does not match ``[vocab_size, hidden_size]``.
        """
        lm_head_weight = embed_weight if lm_head_weight is None else lm_head_weight
        expect = (self.config.vocab_size, self.config.hidden_size)
        for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if tuple(w.shape) != expect:
                raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {expect}")
        device = self.fc.weight.device
        self.target_embed_weight = embed_weight.detach().to(device)
        self.target_lm_head_weight = lm_head_weight.detach().to(device)
        return self

    def _require_target(self) -> None:
        if self.target_embed_weight is None:
            raise RuntimeError("call attach_target(embed_weight, lm_head_weight) first")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Target embedding lookup: ``input_ids`` [B, Q] int -> [B, Q, H] (buffer dtype)."""
        self._require_target()
        return F.embedding(input_ids, self.target_embed_weight)

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(target_hidden))``: [B, C, n*H] -> [B, C, H]."""
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Draft hidden states of the block tokens.

        Args:
            input_ids: [B, Q] block token ids (anchor token then ``mask_token_id``), or ``inputs_embeds``
                [B, Q, H].
            target_hidden: [B, C, n*H] concatenated target features of the context tokens
                (any float dtype; cast to the parameter dtype).
            position_ids: [B, C + Q] absolute positions of the context tokens then the block tokens
                (RoPE for keys uses all, for queries the last Q).
            attention_mask: bool [B or 1, 1, Q, C + Q] (True = may attend) or additive float; ``None``
                lets every query see every key.

        Returns:
            [B, Q, H] hidden states after the final ``norm`` (feed to :meth:`compute_logits`).
        """
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("pass input_ids or inputs_embeds")
            inputs_embeds = self.embed(input_ids)
        dtype = self.fc.weight.dtype
        x = inputs_embeds.to(dtype)
        context = self.project_context(target_hidden)
        if position_ids.shape[-1] != context.shape[1] + x.shape[1]:
            raise ValueError(
                f"position_ids covers {position_ids.shape[-1]} tokens, expected C+Q={context.shape[1] + x.shape[1]}"
            )
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, torch.float32)
        masks = self._layer_masks(attention_mask, position_ids, x.shape[1])
        for layer, mask in zip(self.layers, masks):
            x = layer(x, context, cos, sin, mask)
        return self.norm(x)

    def _layer_masks(self, attention_mask, position_ids: torch.Tensor, num_queries: int) -> list:
        """The mask of each layer: ``attention_mask`` for full layers, restricted to the window for sliding ones."""
        sliding = None
        out = []
        for kind in self.config.layer_types:
            if kind == "sliding_attention":
                if sliding is None:
                    window = sliding_window_mask(position_ids, num_queries, self.config.sliding_window)
                    sliding = _combine_masks(attention_mask, window)
                out.append(sliding)
            else:
                out.append(attention_mask)
        return out

    def new_context_cache(self) -> ContextCache:
        """An empty :class:`ContextCache` for this drafter."""
        return ContextCache(len(self.layers))

    @torch.no_grad()
    def extend_context(self, cache: ContextCache, target_hidden: torch.Tensor) -> ContextCache:
        """Append the next ``c`` context positions (``cache.length .. cache.length + c - 1``) to ``cache``.

        ``target_hidden`` [1, c, n*H]: their target features. Projects them once (``fc``, ``hidden_norm``)
        and stores each layer's keys/values; earlier positions are not recomputed.
        """
        c = target_hidden.shape[1]
        if c == 0:
            return cache
        context = self.project_context(target_hidden)
        positions = torch.arange(cache.length, cache.length + c, device=context.device)[None]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, torch.float32)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(context, cos, sin, context=True)
            cache.keys[i] = k if cache.keys[i] is None else torch.cat([cache.keys[i], k], dim=2)
            cache.values[i] = v if cache.values[i] is None else torch.cat([cache.values[i], v], dim=2)
        cache.length += c
        return cache

    @torch.no_grad()
    def forward_block(self, input_ids: torch.Tensor, cache: ContextCache) -> torch.Tensor:
        """Draft hidden states [1, Q, H] of one block at positions ``cache.length ..`` over the cached context.

        Same result as :meth:`forward` with the features of positions ``< cache.length`` as
        ``target_hidden`` and ``position_ids = arange(cache.length + Q)``.
        """
        x = self.embed(input_ids).to(self.fc.weight.dtype)
        q_len = x.shape[1]
        positions = torch.arange(cache.length + q_len, device=x.device)[None]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, torch.float32)
        masks = self._layer_masks(None, positions, q_len)
        empty = x.new_zeros(1, self.config.num_key_value_heads, 0, self.config.head_dim)
        for i, (layer, mask) in enumerate(zip(self.layers, masks)):
            kv = (cache.keys[i], cache.values[i]) if cache.keys[i] is not None else (empty, empty)
            x = layer(x, None, cos, sin, mask, kv)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target LM head: [..., H] -> [..., vocab_size] logits."""
        self._require_target()
        w = self.target_lm_head_weight
        if not torch.is_autocast_enabled(hidden.device.type):
            w = w.to(hidden.dtype)
        return F.linear(hidden, w)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """``state_dict()`` (already without target buffers): the tensors an export writes."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("target_")}


def load_target_head(model_dir: str, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Read only the embedding and LM head of an HF target checkpoint (safetensors), not the whole model.

    Looks for tensors named ``*embed_tokens.weight`` and ``lm_head.weight`` (any prefix, e.g.
    ``model.language_model.``); a missing LM head means tied embeddings.

    Returns:
        (embed_weight, lm_head_weight), each [vocab_size, hidden_size].

    Raises:
        FileNotFoundError: no safetensors files or no embedding tensor in ``model_dir``.
    """
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    embed = head = None
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict; keys() is its listing
                if key.endswith("embed_tokens.weight") and "mtp" not in key and embed is None:
                    embed = f.get_tensor(key)
                elif key.endswith("lm_head.weight") and "mtp" not in key and head is None:
                    head = f.get_tensor(key)
    if embed is None:
        raise FileNotFoundError(f"no *embed_tokens.weight tensor in {model_dir}")
    head = embed if head is None else head
    if dtype is not None:
        embed, head = embed.to(dtype), head.to(dtype)
    return embed, head


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters (target buffers excluded)."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "ContextCache",
    "DFlashDraftModel",
    "RMSNorm",
    "count_parameters",
    "load_target_head",
    "rope_cos_sin",
    "sliding_window_mask",
]
