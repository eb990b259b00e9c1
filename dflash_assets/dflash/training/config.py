"""A training run's settings (:class:`TrainSettings`, the ones a user sets, declared once; :class:`TrainConfig`,
a whole run), what it returns (:class:`TrainResult`) and the files it writes in its output directory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dflash_assets.dflash.model.draft_model import DFlashDraftModel

LOG_FILE = "train_log.jsonl"
SUMMARY_FILE = "summary.json"


class TrainSettings(BaseModel):
    """The training settings a user sets: declared once, here, with one default each (the DFlash recipe: 5
    layers, block 16, lr 6e-4, 6 epochs, max length 3072). The ``dflash_drafter`` asset's config
    (:class:`~dflash_assets.stages.drafter.config.DrafterConfig`, ``ops.dflash_drafter.config``) and the library's
    :class:`TrainConfig`, which torchrun's worker reads back from JSON, both derive from it."""

    model_config = ConfigDict(extra="forbid")

    num_hidden_layers: int = Field(default=5, ge=1, description="Draft decoder layers.")
    block_size: int = Field(default=16, ge=2, description="Tokens per draft block (the anchor + block_size - 1 masks).")
    mask_token_id: int | None = Field(
        default=None,
        ge=0,
        description="MASK token filling block positions 1..: an id below the target's vocab_size that it never "
        "generates; None = chosen from the tokenizer (see dflash.model.draft_config.default_mask_token_id).",
    )
    epochs: int = Field(default=6, ge=1, description="Passes over the training rows.")
    max_steps: int | None = Field(default=None, ge=1, description="Overrides epochs when set.")
    batch_size: int = Field(default=1, ge=1, description="Sequences per rank per step.")
    lr: float = Field(default=6e-4, gt=0.0, description="AdamW learning rate (cosine schedule with warmup).")
    max_length: int = Field(default=3072, ge=1, description="Longest training sequence, tokens.")
    max_anchors: int = Field(default=512, ge=1, description="Anchors sampled per sequence.")
    eval_fraction: float = Field(
        default=0.1, ge=0.0, lt=1.0, description="Held-out share of rows (stable hash of prompt index)."
    )
    checkpoint_every: int = Field(default=200, ge=0, description="Steps between checkpoints (0 = end only).")
    seed: int = Field(default=0, description="Initialisation, data order and anchors.")
    distill_weight: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Weight of the target's own next-token distribution (top-20, from its layers after the deepest "
        "feature layer run on the stored features: dflash.target.tail) in each label's loss, beside 1 - this on the "
        "hard label; 0 = the recipe's hard labels only. Offline features only.",
    )
    loss_positions: Literal["generated", "all"] = Field(
        default="generated",
        description="generated: anchors and labels on the target's own tokens (loss_mask); all: at every position of "
        "a row, the context included, with the target's argmax as the label everywhere (what greedy verification "
        "accepts; the context's tokens are not the target's). Needs the target's distribution like distill_weight.",
    )
    init_from_target: bool = Field(
        default=False,
        description="Initialise the draft layers from the target's last num_hidden_layers decoder layers, fc as the "
        "identity on the deepest feature layer below them and hidden_norm / norm from the target's norms "
        "(dflash.model.target_init), instead of at random; tensors whose shape differs are copied in part or kept "
        "random.",
    )


class TrainConfig(TrainSettings):
    """A training run: the :class:`TrainSettings` plus its data, places and the settings only the library
    has (units: tokens, steps, seconds).

    ``max_steps`` (if set) overrides ``epochs * steps_per_epoch`` as the schedule length.
    ``target_model_path`` supplies the embedding / LM head / config / tokenizer unless passed to
    :func:`train` directly. ``draft_overrides`` replaces fields of the derived :class:`DFlashConfig`
    (e.g. ``{"intermediate_size": 512}`` for tests). ``init_from`` (warm start) names an exported
    drafter directory (:func:`~dflash_assets.dflash.export.directory.export_drafter`) whose weights replace the
    random init before step 0; a checkpoint of the same run, when resuming, still takes precedence.

    ``features``: ``"offline"`` reads ``shards``; ``"online"`` reads ``tokenized`` (tokenized_sequences
    parquet files) and runs the frozen target (``target_model_path``, ``target_dtype``: default bf16 on
    CUDA, float32 on CPU) over each batch's context (:mod:`dflash_assets.dflash.training.online`).
    """

    shards: list[str]
    out_dir: str
    features: str = "offline"
    tokenized: list[str] = Field(default_factory=list)
    target_dtype: str | None = None
    target_model_path: str | None = None
    num_context_features: int = 5
    target_layer_ids: list[int] | None = None
    draft_overrides: dict = Field(default_factory=dict)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    loss_gamma: float | None = None
    keep_checkpoints: int = 2
    log_every: int = 1
    eval_every: int = 0
    eval_max_rows: int = 256
    device: str = "auto"
    resume: bool = True
    init_std: float = 0.02
    prefetch: int = 2
    init_from: str | None = None  # warm start: an exported drafter dir whose weights replace the random init


@dataclass
class TrainResult:
    """What :func:`train` returns (on every rank): the unwrapped model, the log records this process
    produced (rank 0 only), final step, tokens/s of block tokens over the loop (all ranks), the
    summary dict written to ``summary.json``."""

    model: DFlashDraftModel
    records: list[dict]
    step: int
    tokens_per_s: float
    summary: dict
