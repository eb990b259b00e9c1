"""``ops.dflash_drafter.config``: the drafter asset's settings, read by the run's steps in this package."""

from typing import Literal

import dagster as dg
from pydantic import Field


class DrafterConfig(dg.Config):
    """Training settings (defaults follow the DFlash recipe: 5 layers, block 16, lr 6e-4, 6 epochs, max length 3072)."""

    num_hidden_layers: int = Field(default=5, ge=1, description="Draft decoder layers.")
    block_size: int = Field(default=16, ge=2)
    mask_token_id: int | None = Field(
        default=None,
        ge=0,
        description="MASK token filling block positions 1..: an id below the target's vocab_size that it never "
        "generates; "
        "None = chosen from the tokenizer (see dflash.model.default_mask_token_id).",
    )
    epochs: int = Field(default=6, ge=1)
    max_steps: int | None = Field(default=None, ge=1, description="Overrides epochs when set.")
    batch_size: int = Field(default=1, ge=1, description="Sequences per rank per step.")
    lr: float = 6e-4
    max_length: int = 3072
    max_anchors: int = Field(default=512, ge=1, description="Anchors sampled per sequence.")
    eval_fraction: float = Field(
        default=0.1, ge=0.0, lt=1.0, description="Held-out share of rows (stable hash of prompt index)."
    )
    checkpoint_every: int = Field(default=200, ge=0, description="Steps between checkpoints (0 = end only).")
    nproc: int = Field(
        default=1,
        ge=1,
        description="Processes per node (torchrun, gloo on CPU / nccl on GPU); 1 with nnodes 1 = in this process.",
    )
    nnodes: int = Field(
        default=1,
        ge=1,
        description="Nodes (torchrun --nnodes); >1: run dflash_drafter/runs/<id>/launch_other_nodes.sh on each "
        "other node.",
    )
    rdzv_endpoint: str = Field(
        default="", description="HOST:PORT of the c10d rendezvous, reachable from every node (nnodes > 1)."
    )
    rdzv_id: str = Field(default="dflash", description="Rendezvous id, the same on every node.")
    features: Literal["auto", "offline", "online"] = Field(
        default="auto",
        description="offline: train on hidden_states shards; online: the frozen target computes each batch's "
        "features from "
        "tokenized_sequences (nothing stored); auto: online when the hidden-state storage plan does not fit.",
    )
    seed: int = 0
    # the drafter's shape (dflash.model.DRAFT_SHAPE_FIELDS); None = the target's. hidden_size is always the target's.
    num_attention_heads: int | None = Field(
        default=None, ge=1, description="Draft attention query heads (default: the target's)."
    )
    num_key_value_heads: int | None = Field(
        default=None,
        ge=1,
        description="Draft attention KV heads, dividing num_attention_heads (default: the target's).",
    )
    head_dim: int | None = Field(
        default=None, ge=2, description="Draft attention head size, even (RoPE) (default: the target's)."
    )
    intermediate_size: int | None = Field(
        default=None, ge=1, description="Override the drafter MLP width (default: the target's)."
    )
    layer_types: list[str] | None = Field(
        default=None,
        description="Attention of each draft layer: full_attention (non-causal) or sliding_attention (causal, "
        "sliding_window "
        "tokens); None = all full. Exported in config.json as SGLang reads it.",
    )
    sliding_window: int | None = Field(
        default=None, ge=1, description="Window of sliding_attention layers (tokens, the query included)."
    )
    warm_start: bool = Field(
        default=False,
        description="When the training data changed: continue from the last export (dflash_drafter/export) on the new "
        "data instead of training from scratch.",
    )
