"""Random-init target models of stated sizes for the benches and the GPU check (no weights from anywhere).

Sizes (Qwen3-style decoder, ``transformers.Qwen3Config``):

* ``tiny``: hidden 64, 4 layers, vocab 512 (a smoke run in seconds on CPU).
* ``cpu``: hidden 512, 8 layers, intermediate 1536, vocab 8192 (~34M parameters; a CPU bench).
* ``qwen3-4b``: Qwen3-4B's shape: hidden 2560, 36 layers, intermediate 9728, 32 heads / 8 KV heads,
  head_dim 128, vocab 151,936 (~4.0B parameters, ~8 GB in bf16; one GPU).
"""

from __future__ import annotations

import torch

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, vocab_size=512),
    "cpu": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                head_dim=64, vocab_size=8192),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
}


def random_target(size: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """A frozen, random-init Qwen3 causal LM of ``size`` on ``device`` in ``dtype`` (built there directly)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SIZES[size], max_position_embeddings=8192, tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its final dtype: no fp32 copy of a 4B model
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
