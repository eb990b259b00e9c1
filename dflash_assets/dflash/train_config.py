"""A training run's settings (:class:`TrainConfig`), what it returns (:class:`TrainResult`) and the files it
writes in its output directory."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_assets.dflash.model import DFlashDraftModel

LOG_FILE = "train_log.jsonl"
SUMMARY_FILE = "summary.json"


@dataclass
class TrainConfig:
    """Training run settings (units: tokens, steps, seconds).

    ``batch_size`` is rows per rank per optimizer step. ``max_steps`` (if set) overrides
    ``epochs * steps_per_epoch`` as the schedule length. ``checkpoint_every`` in steps (0: only at the
    end). ``target_model_path`` supplies the embedding / LM head / config / tokenizer unless passed to
    :func:`train` directly. ``draft_overrides`` replaces fields of the derived :class:`DFlashConfig`
    (e.g. ``{"intermediate_size": 512}`` for tests). ``init_from`` (warm start) names an exported
    drafter directory (:func:`~dflash_assets.dflash.export.export_drafter`) whose weights replace the
    random init before step 0; a checkpoint of the same run, when resuming, still takes precedence.

    ``features``: ``"offline"`` reads ``shards``; ``"online"`` reads ``tokenized`` (tokenized_sequences
    parquet files) and runs the frozen target (``target_model_path``, ``target_dtype``: default bf16 on
    CUDA, float32 on CPU) over each batch's context (:mod:`dflash_assets.dflash.online`).
    """

    shards: list[str]
    out_dir: str
    features: str = "offline"
    tokenized: list[str] = field(default_factory=list)
    target_dtype: str | None = None
    target_model_path: str | None = None
    num_hidden_layers: int = 5
    num_context_features: int = 5
    block_size: int = 16
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    draft_overrides: dict = field(default_factory=dict)
    max_length: int = 3072
    max_anchors: int = 512
    eval_fraction: float = 0.0
    batch_size: int = 1
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    epochs: int = 6
    max_steps: int | None = None
    loss_gamma: float | None = None
    seed: int = 0
    checkpoint_every: int = 500
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
