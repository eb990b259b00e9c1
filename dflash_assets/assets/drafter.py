"""Stage 6: ``dflash_drafter``: train the DFlash drafter on every materialized hidden-state partition and export it.

The run's steps (identity, data, launcher, loss plot) are in :mod:`dflash_assets.training`."""

import time
from typing import Literal

import dagster as dg
from pydantic import Field

from dflash_assets.cost import device_cost
from dflash_assets.feature_sources import decide_mode
from dflash_assets.partitions import prompt_ranges
from dflash_assets.pools import GPU_POOL
from dflash_assets.resources.storage import StorageResource
from dflash_assets.resources.target_model import TargetModelResource
from dflash_assets.shard_access import ShardIntegrityError
from dflash_assets.training.identity import config_fingerprint, file_sha256
from dflash_assets.training.launcher import TrainingRunError, check_process_layout
from dflash_assets.training.loss_plot import loss_curve_of_run
from dflash_assets.training.report import drafter_metadata, outcome_of
from dflash_assets.training.run import (
    DRAFTER_DIR,
    EXPORT_DIR,
    gather_training_data,
    plan_run,
    publish_export,
    train_run,
)
from dflash_assets.training.settings import resolved_settings, train_config_for


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


def config_changed_since_last(instance: dg.DagsterInstance, key: str, config: dg.Config) -> bool:
    """Whether ``config`` differs from the settings recorded (``config_fingerprint``) by the last
    materialization of asset ``key`` (False when there is none or it recorded none)."""
    event = instance.get_latest_materialization_event(dg.AssetKey(key))
    recorded = (
        event.asset_materialization.metadata.get("config_fingerprint")
        if event and event.asset_materialization
        else None
    )
    return recorded is not None and recorded.value != config_fingerprint(config)


@dg.asset(
    deps=["hidden_states", "tokenized_sequences"],  # offline reads the first, online only the second
    group_name="drafter",
    kinds={"pytorch", "safetensors"},
    owners=["team:dflash"],
    op_tags={"dflash/gpu": "train"},
    pool=GPU_POOL,
    description=(
        "Trains the DFlash drafter (fc + hidden_norm over 5 target layers, draft decoder layers, frozen target "
        "embedding "
        "and LM head) on the hidden-state shards of every complete partition, with a held-out split; checkpoints under "
        "`dflash_drafter/runs/<run id>/` (a rerun resumes); exports dflash_drafter/export/ (config.json with "
        "architectures [DFlashDraftModel], block_size, dflash_config; model.safetensors) for SGLang/vLLM."
    ),
)
def dflash_drafter(
    context: dg.AssetExecutionContext,
    config: DrafterConfig,
    storage: StorageResource,
    target_model: TargetModelResource,
) -> dg.MaterializeResult:
    keys = context.instance.get_dynamic_partitions(prompt_ranges.name)
    try:  # settings checked before any work; a bad process layout is an error even when the run would be reused
        if config.nproc > 1 or config.nnodes > 1:
            check_process_layout(config)
        layer_ids, _ = resolved_settings(config, target_model)
    except (TrainingRunError, ValueError) as exc:
        raise dg.Failure(str(exc)) from exc
    mode, mode_reason = decide_mode(context.instance, storage, target_model, config.features)
    try:
        data = gather_training_data(
            storage, target_model, keys, mode, mode_reason, config.features, layer_ids, context.log
        )
    except (TrainingRunError, ShardIntegrityError) as exc:
        raise dg.Failure(str(exc)) from exc
    plan = plan_run(storage, data.indexes, config_fingerprint(config), config.warm_start)
    try:
        cfg = train_config_for(
            config,
            target_model,
            mode=data.mode,
            shards=data.shards,
            tokenized=data.tokenized,
            out_dir=plan.run_dir,
            init_from=plan.init_from,
        )
    except ValueError as exc:
        raise dg.Failure(str(exc)) from exc
    started = time.monotonic()
    try:
        summary = train_run(plan, cfg, config, data, context.log)
    except TrainingRunError as exc:
        raise dg.Failure(str(exc), metadata=exc.metadata) from exc
    outcome = outcome_of(summary, plan.reused)
    context.log.info(f"drafter {outcome[1]} (run {plan.run_id})")
    wall = time.monotonic() - started
    png = loss_curve_of_run(plan.run_dir)
    store = storage.open()
    weights = publish_export(store, plan.export_dir, png)
    subset = _offline_subset(context.instance, data.used) if data.mode == "offline" else {}
    metadata = drafter_metadata(summary, plan, data, config, outcome, weights, png, wall, subset)
    trained = 0 if plan.reused else summary["train_tokens"]  # a reused run cost nothing now
    metadata.update(device_cost(target_model.device, 0.0 if plan.reused else wall, trained, 0, summary["world_size"]))
    # same weights, same version: the evaluation reuses its report
    return dg.MaterializeResult(
        metadata={**metadata, "export_path": dg.MetadataValue.path(store.uri(*EXPORT_DIR))},
        data_version=dg.DataVersion(file_sha256(weights)[:20]),  # streamed: GBs of weights
    )


def _offline_subset(instance: dg.DagsterInstance, used: list[str]) -> dict:
    """Subset setting and rows stored by the hidden_states partitions trained on (their latest metadata)."""
    from dflash_assets.history import latest_metadata

    stored = total = 0
    subset: dict = {}
    for pk in used:
        meta = latest_metadata(instance, "hidden_states", pk) or {}
        stored += int(meta.get("rows") or 0)
        total += int(meta.get("rows_in_partition") or meta.get("rows") or 0)
        subset = meta.get("subset") or subset
    return {**subset, "rows_stored": stored, "rows_tokenized": total}


__all__ = ["DRAFTER_DIR", "EXPORT_DIR", "DrafterConfig", "config_changed_since_last", "dflash_drafter"]
