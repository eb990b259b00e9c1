"""Random-init target models of stated sizes for the benches and the GPU check (no weights from anywhere).

Dense sizes (Qwen3-style decoder, ``transformers.Qwen3Config``):

* ``tiny``: hidden 64, 4 layers, vocab 512 (a smoke run in seconds on CPU).
* ``cpu``: hidden 512, 8 layers, intermediate 1536, vocab 8192 (~34M parameters; a CPU bench).
* ``qwen3-4b``: Qwen3-4B's shape: hidden 2560, 36 layers, intermediate 9728, 32 heads / 8 KV heads,
  head_dim 128, vocab 151,936 (~4.0B parameters, ~8 GB in bf16; one GPU).

Hybrid sizes (Qwen3.5/3.6 text decoder, ``transformers.Qwen3_5ForCausalLM``: 3 linear-attention (Gated
DeltaNet) layers then 1 full-attention layer, repeating; gated attention, partial rotary 0.25):

* ``hybrid-tiny``: hidden 64, 8 layers, vocab 512 (CPU smoke run).
* ``hybrid-cpu``: hidden 256, 8 layers, intermediate 768, vocab 4096 (~12M parameters; a CPU bench).
* ``qwen36-27b``: Qwen3.6-27B's text decoder: hidden 5,120, FFN 17,408, 64 layers, full attention 24 heads /
  4 KV heads / head_dim 256, vocab 248,320, rope theta 1e7 (TARGET.md); linear attention 16 key heads, 48
  value heads, key/value head_dim 128, conv kernel 4 (from public copies of the Qwen3.5/3.6-27B config.json
  in several third-party repositories, which agree; the hub file itself was not read here). ~26.9B
  parameters, ~54 GB in bf16; ``num_layers`` keeps the width and cuts the depth.
"""

from __future__ import annotations

import torch

SIZES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
    ),
    "cpu": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=8192,
    ),
    "qwen3-4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
}
HYBRID_SIZES = {
    "hybrid-tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        vocab_size=512,
    ),
    "hybrid-cpu": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        vocab_size=4096,
    ),
    "qwen36-27b": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        vocab_size=248320,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    ),
}
ALL_SIZES = sorted(SIZES) + sorted(HYBRID_SIZES)


def hybrid_layer_types(num_layers: int) -> list[str]:
    """Qwen3.5/3.6's pattern: every 4th layer full attention, the others linear attention."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]


def target_config(size: str, num_layers: int | None = None):
    """The HF config of ``size`` (``num_layers`` overrides the depth)."""
    if size in HYBRID_SIZES:
        from transformers import Qwen3_5TextConfig

        values = dict(HYBRID_SIZES[size])
        if num_layers is not None:
            values["num_hidden_layers"] = num_layers
        values["layer_types"] = hybrid_layer_types(values["num_hidden_layers"])
        return Qwen3_5TextConfig(**values, max_position_embeddings=8192, tie_word_embeddings=False, rms_norm_eps=1e-6)
    from transformers import Qwen3Config

    values = dict(SIZES[size])
    if num_layers is not None:
        values["num_hidden_layers"] = num_layers
    return Qwen3Config(**values, max_position_embeddings=8192, tie_word_embeddings=False, rms_norm_eps=1e-6)


def _model_class(size: str):
    if size in HYBRID_SIZES:
        from transformers import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM


def parameter_bytes(size: str, num_layers: int, dtype_bytes: int = 2) -> int:
    """Bytes of the weights of ``size`` cut to ``num_layers`` layers (built on the meta device: nothing allocated)."""
    with torch.device("meta"):
        model = _model_class(size)(target_config(size, num_layers))
    return num_parameters(model) * dtype_bytes


def layers_that_fit(size: str, budget_bytes: int, dtype_bytes: int = 2) -> int:
    """The most layers (a multiple of 4 for hybrid sizes, at most the real depth) whose weights fit ``budget_bytes``."""
    full = target_config(size).num_hidden_layers
    step = 4 if size in HYBRID_SIZES else 1
    fixed = parameter_bytes(size, step, dtype_bytes)  # embeddings, head and one group of layers
    per_group = parameter_bytes(size, 2 * step, dtype_bytes) - fixed
    groups = 1 + max(0, (budget_bytes - fixed) // max(per_group, 1))
    return int(min(full, groups * step))


def random_target(
    size: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_layers: int | None = None,
):
    """A frozen, random-init causal LM of ``size`` on ``device`` in ``dtype`` (built there directly)."""
    config = target_config(size, num_layers)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its final dtype: no fp32 copy of a large model
    try:
        with torch.device(device):
            model = _model_class(size)(config)
    finally:
        torch.set_default_dtype(default)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
