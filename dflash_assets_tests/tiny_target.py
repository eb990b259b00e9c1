"""A random-init tiny Llama target saved as an HF directory (no weights from anywhere), for fast tests; and a
fake target with shards of random features, for training tests that need no decoder."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_assets.dflash.training.config import TrainConfig

VOCAB, HIDDEN, LAYERS = 96, 32, 6
LAYER_IDS = [1, 3, 5]


def make_target(root: Path, seed: int = 0, layers: int = LAYERS, vocab: int = VOCAB):
    """``(model, directory)``: ``layers`` layers (6), hidden 32, ``vocab`` tokens (96), untied LM head, float32,
    eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
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


# Qwen3.5/3.6-style hybrid decoder: 3 linear-attention (Gated DeltaNet) layers then 1 full-attention layer,
# repeated; partial rotary (0.25) and gated attention as in the real config, every size scaled down.
HYBRID_LAYER_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 2
HYBRID_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=len(HYBRID_LAYER_TYPES),
    layer_types=HYBRID_LAYER_TYPES,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
HYBRID_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=HIDDEN,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
)


def make_hybrid_target(root: Path | None = None, *, wrapper: bool = False, seed: int = 0):
    """``(model, directory or None)``: a random-init hybrid target, float32, eval mode, 8 layers, hidden 32.

    ``wrapper``: the multimodal ``Qwen3_5ForConditionalGeneration`` (decoder at ``model.language_model``,
    a one-block vision tower) instead of ``Qwen3_5ForCausalLM``. Saved under ``root/hybrid`` when given.
    """
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    torch.manual_seed(seed)
    if wrapper:
        model = Qwen3_5ForConditionalGeneration(
            Qwen3_5Config(text_config=HYBRID_TEXT, vision_config=HYBRID_VISION, tie_word_embeddings=False)
        )
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**HYBRID_TEXT))
    model.eval()
    path = None
    if root is not None:
        path = Path(root) / ("hybrid-wrapper" if wrapper else "hybrid")
        model.save_pretrained(path)
    return model, path


def project_config_with_layers(directory: Path, layer_ids: list[int]) -> Path:
    """A project config file (point ``DFLASH_CONFIG`` at it) whose ``ops.hidden_states.config.target_layer_ids``
    is ``layer_ids``: the one setting every stage, the drafter included, resolves its target layers from."""
    path = Path(directory) / "project.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"ops:\n  hidden_states:\n    config:\n      target_layer_ids: {list(layer_ids)}\n")
    return path


# A fake target for training alone: config.json and the embedding / LM head, no decoder weights, and shards
# of random features of N_FEATS layers (the resume, DDP and drafter-identity tests).

N_FEATS = len(LAYER_IDS)


def write_rows_shard(
    path: Path, rows: list[dict], row_index: list[int] | None = None, metadata: dict | None = None
) -> Path:
    """Write rows ({input_ids, loss_mask, hidden_states}) in the hidden-state shard format."""
    lengths = [len(r["input_ids"]) for r in rows]
    cu = torch.zeros(len(rows) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    tensors = {
        "hidden_states": torch.cat([r["hidden_states"] for r in rows]).to(torch.bfloat16).contiguous(),
        "input_ids": torch.cat([torch.as_tensor(r["input_ids"]) for r in rows]).to(torch.int32),
        "loss_mask": torch.cat([torch.as_tensor(r["loss_mask"]) for r in rows]).to(torch.int8),
        "cu_seqlens": cu,
    }
    if row_index is not None:
        tensors["row_index"] = torch.tensor(row_index, dtype=torch.int64)
    save_file(tensors, str(path), metadata=metadata)
    return path


def make_feature_target(root: Path) -> tuple[Path, list[str]]:
    """A fake target dir (config.json + embedding/LM head) and 2 shards of random features."""
    g = torch.Generator().manual_seed(0)
    target = root / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": HIDDEN,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 8,
                "intermediate_size": 64,
                "vocab_size": VOCAB,
                "num_hidden_layers": 8,
                "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0,
                "max_position_embeddings": 512,
            }
        )
    )
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
            "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g),
        },
        str(target / "model.safetensors"),
    )
    shards = []
    for s in range(2):
        rows = []
        for r in range(5):
            t = 30 + 7 * r
            ids = torch.randint(0, VOCAB - 1, (t,), generator=g)
            mask = torch.zeros(t, dtype=torch.int8)
            mask[10:] = 1
            rows.append(
                {"input_ids": ids, "loss_mask": mask, "hidden_states": torch.randn(t, N_FEATS * HIDDEN, generator=g)}
            )
        shards.append(str(write_rows_shard(root / f"shard-{s}.safetensors", rows, [s * 5 + r for r in range(5)])))
    return target, shards


def tiny_train_config(target: Path, shards: list[str], out: Path, **kw) -> TrainConfig:
    """A short deterministic run on :func:`make_feature_target`'s shards; ``kw`` overrides any field."""
    values = dict(
        shards=shards,
        out_dir=str(out),
        target_model_path=str(target),
        num_hidden_layers=2,
        num_context_features=N_FEATS,
        block_size=4,
        mask_token_id=VOCAB - 1,
        max_anchors=6,
        batch_size=2,
        lr=1e-2,
        max_steps=12,
        checkpoint_every=3,
        eval_fraction=0.0,
        log_every=1,
        seed=7,
        device="cpu",
    )  # CPU kernels are deterministic: resume must match exactly
    values.update(kw)
    return TrainConfig(**values)
