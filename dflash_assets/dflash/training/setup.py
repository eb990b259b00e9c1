"""The steps that prepare a training run: seeding, the data, the drafter's config and model, the optimizer,
resuming from the last checkpoint and the DDP wrapper."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dflash_assets.dflash.model.draft_config import DFlashConfig, default_mask_token_id
from dflash_assets.dflash.model.draft_model import DFlashDraftModel, load_target_head
from dflash_assets.dflash.shards.dataset import HiddenStateShards
from dflash_assets.dflash.target.layers import resolve_target_layer_ids
from dflash_assets.dflash.training.checkpoints import (
    latest_checkpoint,
    load_checkpoint,
    load_init_weights,
    set_rng_state,
    truncate_log,
)
from dflash_assets.dflash.training.config import LOG_FILE, TrainConfig
from dflash_assets.dflash.training.process_group import Distributed


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (the model init has its own seed)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def training_datasets(cfg: TrainConfig, dd: Distributed, draft_config, online_target):
    """(train set, eval set or None, online features or None) for ``cfg.features``."""
    split_kw = dict(eval_fraction=cfg.eval_fraction, max_length=cfg.max_length, block_size=cfg.block_size)
    distill = cfg.distill_weight > 0 or cfg.loss_positions == "all"
    if cfg.features == "offline":
        dataset = HiddenStateShards(cfg.shards, split="train", **split_kw)
        eval_set = HiddenStateShards(cfg.shards, split="eval", **split_kw) if cfg.eval_fraction > 0 else None
        if distill:
            dataset, eval_set = with_target_distribution(cfg, dd, dataset, eval_set, draft_config)
        return dataset, eval_set, None
    if cfg.features != "online":
        raise ValueError(f"TrainConfig.features must be 'offline' or 'online', got {cfg.features!r}")
    if distill:
        raise ValueError("distill_weight and loss_positions: all need offline features (stored shards)")
    from dflash_assets.dflash.training.online import (
        OnlineTargetFeatures,
        TokenizedRows,
        load_frozen_target,
        read_tokenized_rows,
    )

    if online_target is None:
        if not cfg.target_model_path:
            raise ValueError("online features need TrainConfig.target_model_path (the frozen target)")
        dtype = getattr(torch, cfg.target_dtype) if cfg.target_dtype else None
        online_target = load_frozen_target(cfg.target_model_path, dd.device, dtype)
    else:
        online_target = online_target.to(dd.device)
    if draft_config is not None:
        layer_ids = draft_config.target_layer_ids
    else:  # the same resolution as the drafter config's and the shards' (dflash.target.layers)
        layer_ids = resolve_target_layer_ids(online_target, cfg.target_layer_ids, cfg.num_context_features)
    features = OnlineTargetFeatures(online_target, layer_ids)
    if dd.rank == 0:
        from dflash_assets.dflash.target.kernels import linear_attention_kernels

        features.kernels = linear_attention_kernels(online_target)["summary"]
        print(f"[dflash.train] online target {type(online_target).__name__}: {features.kernels}", flush=True)
    rows = read_tokenized_rows(cfg.tokenized)
    dataset = TokenizedRows(rows, split="train", features=features, **split_kw).tokens_only()
    eval_set = TokenizedRows(rows, split="eval", features=features, **split_kw) if cfg.eval_fraction > 0 else None
    return dataset, eval_set, features


def with_target_distribution(cfg: TrainConfig, dd: Distributed, dataset, eval_set, draft_config):
    """``(dataset, eval_set)`` whose rows carry the target's top-20 distribution
    (:class:`~dflash_assets.dflash.target.tail.WithTargetDistribution`), every position a label position when
    ``cfg.loss_positions == "all"``. The target's layers after the deepest feature layer run on this rank's device.

    Raises:
        ValueError: no target model path.
    """
    from dflash_assets.dflash.target.tail import TargetTail, WithTargetDistribution

    if not cfg.target_model_path:
        raise ValueError("distill_weight / loss_positions: all need TrainConfig.target_model_path (the target)")
    layer_ids = (
        draft_config.target_layer_ids
        if draft_config is not None
        else cfg.target_layer_ids
        or dataset.target_layer_ids
        or resolve_target_layer_ids(cfg.target_model_path, None, cfg.num_context_features)
    )
    tail = TargetTail(cfg.target_model_path, list(layer_ids), device=dd.device)
    wrap = [
        WithTargetDistribution(d, tail, cfg.loss_positions == "all") if d is not None else None
        for d in (dataset, eval_set)
    ]
    return wrap[0], wrap[1]


def resolve_draft_config(cfg: TrainConfig, dataset: HiddenStateShards) -> DFlashConfig:
    """Derive the drafter config from ``cfg.target_model_path`` (``config.json`` + tokenizer).

    ``target_layer_ids``: ``cfg.target_layer_ids``, else the shards' metadata, else the DFlash default.

    Raises:
        ValueError: no target model path, or the shards' feature width is not ``n * hidden_size``.
    """
    if not cfg.target_model_path:
        raise ValueError("TrainConfig.target_model_path is required unless draft_config is passed")
    target_config = json.loads((Path(cfg.target_model_path) / "config.json").read_text())
    mask_token_id = cfg.mask_token_id
    if mask_token_id is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.target_model_path)
        text = target_config.get("text_config") or target_config
        mask_token_id = default_mask_token_id(tok, int(text["vocab_size"]))
    dc = DFlashConfig.from_target_config(
        target_config,
        mask_token_id=mask_token_id,
        num_hidden_layers=cfg.num_hidden_layers,
        num_context_features=cfg.num_context_features,
        target_layer_ids=cfg.target_layer_ids if cfg.target_layer_ids is not None else dataset.target_layer_ids,
        block_size=cfg.block_size,
        **cfg.draft_overrides,
    )
    check_feature_dim(dc, dataset)
    return dc


def check_feature_dim(dc: DFlashConfig, dataset: HiddenStateShards) -> None:
    """Raise ValueError unless the shards hold ``len(target_layer_ids) * hidden_size`` features per token
    and, when the shards record their ``target_layer_ids``, they are the drafter's."""
    if dataset.target_layer_ids is not None and dataset.target_layer_ids != dc.target_layer_ids:
        raise ValueError(f"shards hold target layers {dataset.target_layer_ids}, drafter expects {dc.target_layer_ids}")
    want = dc.num_context_features * dc.hidden_size
    if dataset.feature_dim != want:
        raise ValueError(
            f"shards hold {dataset.feature_dim} features per token, drafter expects "
            f"{dc.num_context_features} x {dc.hidden_size} = {want}"
        )


def draft_config_and_head(
    cfg: TrainConfig, dataset, draft_config: DFlashConfig | None, target_head: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[DFlashConfig, tuple]:
    """The drafter config (given, or derived from the target) checked against the data, and the target's
    (embedding, LM head) weights (given, or read from ``cfg.target_model_path``).

    Raises:
        ValueError: features that do not match the drafter, a block size other than ``cfg.block_size``, or
            no target head and no target model path.
    """
    dc = draft_config or resolve_draft_config(cfg, dataset)
    check_feature_dim(dc, dataset)
    if dc.block_size != cfg.block_size:
        raise ValueError(f"draft_config.block_size {dc.block_size} != TrainConfig.block_size {cfg.block_size}")
    if target_head is None:
        if not cfg.target_model_path:
            raise ValueError("pass target_head or TrainConfig.target_model_path")
        target_head = load_target_head(cfg.target_model_path)
    return dc, target_head


def build_model(cfg: TrainConfig, dc: DFlashConfig, target_head: tuple, device: torch.device) -> DFlashDraftModel:
    """The drafter, initialised (seeded; from the target's last layers with ``cfg.init_from_target``; from
    ``cfg.init_from``'s export, which wins), on ``device``, with the frozen target head attached (bf16 on CUDA,
    float32 on CPU)."""
    model = DFlashDraftModel(dc)
    model.reset_parameters(cfg.init_std, seed=cfg.seed)
    if cfg.init_from_target:
        from dflash_assets.dflash.model.target_init import init_from_target_layers

        if not cfg.target_model_path:
            raise ValueError("init_from_target needs TrainConfig.target_model_path (the target's weights)")
        init_from_target_layers(model, cfg.target_model_path)
    if cfg.init_from:
        load_init_weights(model, cfg.init_from)
    model.to(device)
    head_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model.attach_target(target_head[0].to(head_dtype), target_head[1].to(head_dtype))
    return model


def lr_lambda(total_steps: int, warmup_ratio: float, min_lr_ratio: float = 0.0) -> Callable[[int], float]:
    """Multiplier of the base lr at step s: linear warmup over ``ceil(warmup_ratio*total)`` steps
    (``(s+1)/warmup``), then cosine from 1 to ``min_lr_ratio`` at ``total_steps``."""
    warmup = max(1, math.ceil(warmup_ratio * total_steps))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, total_steps: int):
    """``(AdamW, LambdaLR)`` of the recipe: warmup then cosine (:func:`lr_lambda`)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio))
    return opt, sched


def resume(cfg: TrainConfig, dd: Distributed, out: Path, model, opt, sched) -> tuple[int, int, list[dict]]:
    """Restore the last checkpoint of ``out`` (when ``cfg.resume``) into model, optimizer, scheduler and RNGs;
    on rank 0 cut the log back to it (or remove the log of a run starting over).

    Returns:
        ``(start step, tokens seen, the log records kept)``.

    Raises:
        CheckpointError: see :func:`~dflash_assets.dflash.training.checkpoints.latest_checkpoint`.
    """
    start_step, tokens_seen = 0, 0
    ckpt = latest_checkpoint(out) if cfg.resume else None
    if ckpt is not None:
        state = load_checkpoint(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        start_step, tokens_seen = int(state["step"]), int(state["tokens_seen"])
        if state.get("world_size") != dd.world:
            print(
                f"[dflash.train] warning: checkpoint from world size {state.get('world_size')}, now {dd.world}: "
                "data order differs from an uninterrupted run",
                flush=True,
            )
    log_path = out / LOG_FILE
    records: list[dict] = []
    if dd.rank == 0:
        records = truncate_log(log_path, start_step) if ckpt is not None else []
        if ckpt is None and log_path.exists():
            log_path.unlink()
    dd.barrier()
    return start_step, tokens_seen, records


def wrap_ddp(model: torch.nn.Module, dd: Distributed) -> torch.nn.Module:
    """``model`` in DistributedDataParallel when there are several ranks, else itself."""
    if not dd.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[dd.device.index] if dd.device.type == "cuda" else None, broadcast_buffers=False)
