"""The drafter's configuration (:class:`DFlashConfig`): derived from the target's config.json, with the
drafter's own shape where a run sets it, and the MASK token that fills a block."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dflash_assets.dflash.target.layers import resolve_target_layer_ids, text_config

# Special tokens of SmolLM2/StarCoder-style vocabularies used only in code pretraining
# (Jupyter/GitHub markup): a chat model never emits them, so they are safe MASK tokens.
_NEVER_GENERATED_SPECIAL_TOKENS = ("<|MASK|>", "<empty_output>", "<jupyter_script>", "<issue_closed>")


def default_mask_token_id(tokenizer: Any, vocab_size: int) -> int:
    """Choose a MASK token id the target never produces.

    Order of preference:
    1. a ``<|MASK|>`` token already in the tokenizer (SGLang's default mask token string);
    2. the first embedding row past the tokenizer (``len(tokenizer)`` when it is ``< vocab_size``):
       padding rows no text ever maps to. This is what z-lab's Qwen3 DFlash checkpoints use
       (``mask_token_id`` 151669 = ``len(tokenizer)`` of Qwen3, whose embedding has 151936 rows);
    3. a special token from code pretraining that a chat model never generates -- for SmolLM2
       (vocab 49152, no padding rows) this is ``<empty_output>`` (id 16), a Jupyter-notebook marker.

    Raises:
        ValueError: none of the above exists.
    """
    vocab = tokenizer.get_vocab()
    if "<|MASK|>" in vocab:
        return int(vocab["<|MASK|>"])
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    for token in _NEVER_GENERATED_SPECIAL_TOKENS[1:]:
        if token in vocab:
            return int(vocab[token])
    raise ValueError("no unused MASK token found: pass mask_token_id explicitly")


def _rope_theta(target_config: Any, default: float = 10000.0) -> float:
    # transformers 5 keeps it in rope_parameters; older configs have rope_theta at top level.
    params = _get(target_config, "rope_parameters", None) or {}
    if isinstance(params, Mapping) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(_get(target_config, "rope_theta", default))


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


@dataclass
class DFlashConfig:
    """Hyper-parameters of the draft model (sizes in elements, ``rope_theta`` in radians base).

    ``hidden_size`` must equal the target's (context features and the target's embedding/LM head are
    used directly). ``target_layer_ids`` index target decoder layers (HF ``hidden_states[i+1]``);
    ``num_target_layers`` is the target's layer count; ``mask_token_id`` fills block positions 1..
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    num_hidden_layers: int = 5
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    block_size: int = 16
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] | None = None  # per draft layer: "full_attention" | "sliding_attention"; None = all full
    sliding_window: int | None = None  # tokens a sliding layer's query sees, itself included (HF convention)

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.layer_types = [str(t) for t in self.layer_types]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} draft layers: "
                "give one per layer"
            )
        bad_types = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad_types:
            raise ValueError(f"layer_types {bad_types} unknown: use {list(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and (self.sliding_window is None or int(self.sliding_window) < 1):
            raise ValueError("sliding_attention layers need sliding_window >= 1 (tokens, the query included)")
        if self.sliding_window is not None:
            self.sliding_window = int(self.sliding_window)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (RoPE rotates half of each head)")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must be non-empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for {self.num_target_layers} layers")
        if not 0 <= int(self.mask_token_id) < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target's vocabulary (vocab_size "
                f"{self.vocab_size}): set mask_token_id to an id in 0..{self.vocab_size - 1} the target never "
                "generates"
            )
        self.mask_token_id = int(self.mask_token_id)
        if self.hidden_act != "silu":
            raise ValueError("only hidden_act='silu' is supported (SGLang's DFlash loader has the same limit)")

    @property
    def num_context_features(self) -> int:
        """Number of concatenated target layers ``n`` (context features are ``[T, n*hidden_size]``)."""
        return len(self.target_layer_ids)

    def to_dict(self) -> dict:
        """Plain-JSON dict of all fields (round-trips through ``DFlashConfig(**d)``)."""
        return asdict(self)

    @classmethod
    def from_target_config(
        cls,
        target_hf_config: Any,
        *,
        mask_token_id: int,
        num_hidden_layers: int = 5,
        num_context_features: int = 5,
        target_layer_ids: Sequence[int] | None = None,
        block_size: int = 16,
        **overrides: Any,
    ) -> DFlashConfig:
        """Build a drafter config from the target's HF config (object or dict).

        Hidden size, heads, head_dim, intermediate size, norm eps, RoPE base, vocab and max positions
        are the target's (as in z-lab's Qwen3 drafters); ``overrides`` replaces any field, e.g. the
        attention shape of :data:`DRAFT_SHAPE_FIELDS` (SpecForge's Qwen3.6-27B drafter: 32 heads, 8 KV
        heads, head_dim 128 where the target has 24 / 4 / 256). Multimodal configs with a
        ``text_config`` use that. ``target_layer_ids``: see
        :func:`~dflash_assets.dflash.target.layers.resolve_target_layer_ids` (None = the default rule).

        Raises:
            ValueError: a field is invalid (see ``__post_init__``), e.g. ``mask_token_id >= vocab_size``.
        """
        text = text_config(target_hf_config)
        num_target_layers = int(_get(text, "num_hidden_layers"))
        hidden = int(_get(text, "hidden_size"))
        heads = int(_get(text, "num_attention_heads"))
        values = dict(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(_get(text, "num_key_value_heads", None) or heads),
            head_dim=int(_get(text, "head_dim", None) or hidden // heads),
            intermediate_size=int(_get(text, "intermediate_size")),
            vocab_size=int(_get(text, "vocab_size")),
            rms_norm_eps=float(_get(text, "rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(text),
            max_position_embeddings=int(_get(text, "max_position_embeddings", 32768)),
            num_target_layers=num_target_layers,
            target_layer_ids=resolve_target_layer_ids(text, target_layer_ids, num_context_features),
            num_hidden_layers=num_hidden_layers,
            block_size=block_size,
            mask_token_id=int(mask_token_id),
        )
        values.update(overrides)
        return cls(**values)


LAYER_TYPES = ("full_attention", "sliding_attention")

# Fields of DFlashConfig a run config may set (the rest follow the target): the drafter's attention shape,
# MLP width and per-layer attention kind. The drafter asset's settings of these names become overrides.
DRAFT_SHAPE_FIELDS = (
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "layer_types",
    "sliding_window",
)
