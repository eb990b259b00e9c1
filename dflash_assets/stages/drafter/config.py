"""``ops.dflash_drafter.config``: the drafter asset's settings, read by the run's steps in this package."""

from typing import Literal

import dagster as dg
from pydantic import Field

from dflash_assets.dflash.training.config import TrainSettings


class DrafterConfig(dg.Config, TrainSettings):
    """The training settings (:class:`~dflash_assets.dflash.training.config.TrainSettings`, declared and defaulted
    there, once, for the asset and the library alike), plus what only the asset decides: the process layout,
    the feature source, the drafter's shape (None = the target's) and warm starts."""

    nproc: int = Field(
        default=1,
        ge=1,
        description="Processes per node (torchrun, gloo on CPU / nccl on GPU); 1 with nnodes 1 = in this process.",
    )
    nnodes: int = Field(
        default=1,
        ge=1,
        description="Nodes (torchrun --nnodes); >1 with DFLASH_CELERY_BROKER set: the other nodes' ranks run as tasks "
        "on idle workers of other nodes; without: run dflash_drafter/runs/<id>/launch_other_nodes.sh on each other "
        "node.",
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
    # the drafter's shape (dflash.model.draft_config.DRAFT_SHAPE_FIELDS); None = the target's. hidden_size is always
    # the target's.
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
