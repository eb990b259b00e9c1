"""A random-init tiny Llama target saved as an HF directory (no weights from anywhere), for fast tests."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, HIDDEN, LAYERS = 96, 32, 6
LAYER_IDS = [1, 3, 5]


def make_target(root: Path, seed: int = 0):
    """``(model, directory)``: 6 layers, hidden 32, vocab 96, untied LM head, float32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    path = Path(root) / "target"
    model.save_pretrained(path)
    return model, path


def make_rows(n: int = 10, seed: int = 1, first_index: int = 100) -> list[dict]:
    """``n`` rows ``{index, input_ids, loss_mask}`` of 24..39 random tokens, loss on all but the first 8."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        t = 24 + 5 * (i % 4)
        ids = torch.randint(0, VOCAB - 1, (t,), generator=g).tolist()
        rows.append({"index": first_index + i, "input_ids": ids, "loss_mask": [0] * 8 + [1] * (t - 8)})
    return rows
