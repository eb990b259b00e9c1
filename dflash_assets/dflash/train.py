"""DFlash drafter training loop: single process or ``torchrun`` (DDP), resumable, logged.

Recipe (DFlash paper arXiv 2602.06036 and its trainers): AdamW lr 6e-4, cosine schedule with 4%
linear warmup, gradient clipping at 1.0, 6 epochs, rows truncated to 3072 tokens, up to 512 anchors
per row, decay-weighted block CE (:mod:`dflash_assets.dflash.loss`). bf16 autocast on CUDA, float32
on CPU.

Determinism and resume: the row order of epoch ``e`` is a permutation seeded by ``(seed, e)`` and the
anchors of a row by ``(seed, e, row)``, so the data of step ``s`` is a pure function of ``s``. A
checkpoint (model, optimizer, scheduler, RNG states, step) is written atomically (temp file +
``os.replace``) every ``checkpoint_every`` steps; resuming restores it, drops log lines written after
it, and continues, giving the same losses as an uninterrupted run with the same seed.

Checkpoints live on a filesystem the training nodes share, so resuming trusts nothing in them: the
file ``checkpoints/latest.json`` names must be a checkpoint file inside ``checkpoints/``
(:func:`latest_checkpoint`), and it is read with ``torch.load(weights_only=True)``
(:func:`load_checkpoint`): tensors, numbers, strings and containers only, no pickled code.

Distributed: launched by ``torchrun`` the same code runs one process per rank (NCCL on GPU, gloo on
CPU); each optimizer step consumes ``world_size * batch_size`` rows, rank ``r`` taking its slice.

Entry point: ``python -m dflash_assets.dflash.train --shards S1 S2 --out DIR --target-model MODEL_DIR``
(online: ``--tokenized P1.parquet P2.parquet`` instead of ``--shards``; also under ``torchrun
--nproc_per_node N [--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT]``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pickle
import queue
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dflash_assets.atomic import atomic_write_bytes
from dflash_assets.dflash.data import HiddenStateShards, TrainingBatch, collate_training_batch
from dflash_assets.dflash.loss import accuracy_per_position, dflash_loss_from_hidden, expected_acceptance_length
from dflash_assets.dflash.masks import sample_anchors
from dflash_assets.dflash.model import (
    DFlashConfig,
    DFlashDraftModel,
    default_mask_token_id,
    load_target_head,
)
from dflash_assets.dflash.target_layers import resolve_target_layer_ids

LOG_FILE = "train_log.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest.json"
CHECKPOINT_NAME = re.compile(r"step_\d{8,}\.pt")  # what _save_checkpoint writes


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


# ---------------------------------------------------------------------------------------------
# helpers


def _seed_for(*parts: int) -> int:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


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


class _Dist:
    """Rank / world size / device; initialises torch.distributed when WORLD_SIZE > 1."""

    def __init__(self, device: str) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
        if use_cuda:
            index = self.local_rank if device in ("auto", "cuda") else (torch.device(device).index or 0)
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.owns_group = False
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if use_cuda else "gloo")
            self.owns_group = True
        self.enabled = self.world > 1

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _param_checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def _rng_state() -> dict:
    """RNG states as tensors, numbers and strings only (a weights-only load takes them back)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    np.random.set_state(numpy_state)  # a tuple holding an ndarray: checkpoints written before issue 27
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# data order


class StepPlan:
    """Which rows and anchors each (step, rank) trains on: a pure function of the step.

    Epoch ``e`` visits a permutation of the rows seeded by ``(seed, e)``, padded by wrapping to a
    multiple of ``world * batch_size`` so every rank runs the same number of steps.
    """

    def __init__(self, num_rows: int, world: int, batch_size: int, seed: int) -> None:
        if num_rows == 0:
            raise ValueError("no training rows (all held out, empty, or without room for a block)")
        self.num_rows, self.world, self.batch_size, self.seed = num_rows, world, batch_size, seed
        self.rows_per_step = world * batch_size
        self.steps_per_epoch = math.ceil(num_rows / self.rows_per_step)
        self._cache: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._cache:
            g = torch.Generator().manual_seed(_seed_for(self.seed, epoch))
            perm = torch.randperm(self.num_rows, generator=g)
            need = self.steps_per_epoch * self.rows_per_step
            self._cache = {epoch: perm.repeat(math.ceil(need / self.num_rows))[:need]}
        return self._cache[epoch]

    def rows(self, step: int, rank: int) -> tuple[int, list[int]]:
        """(epoch, row indices) for ``rank`` at global ``step``."""
        epoch, s = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)
        lo = s * self.rows_per_step + rank * self.batch_size
        return epoch, order[lo : lo + self.batch_size].tolist()


def build_batch(
    dataset: HiddenStateShards,
    rows: list[int],
    epoch: int,
    seed: int,
    block_size: int,
    max_anchors: int,
    mask_token_id: int,
) -> TrainingBatch:
    """Read ``rows``, sample anchors with generators seeded by ``(seed, epoch, row)``, collate."""
    samples, anchors = [], []
    for r in rows:
        s = dataset[r]
        g = torch.Generator().manual_seed(_seed_for(seed, epoch, r, 1))
        samples.append(s)
        anchors.append(sample_anchors(s["loss_mask"], block_size, max_anchors, g))
    return collate_training_batch(samples, anchors, block_size, mask_token_id)


class _Prefetcher:
    """Builds batches for steps [start, stop) in a background thread (bounded queue)."""

    def __init__(self, make: Callable[[int], TrainingBatch], start: int, stop: int, depth: int, pin: bool) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()

        def run() -> None:
            try:
                for step in range(start, stop):
                    b = make(step)
                    if pin:
                        b = b.pin_memory()
                    while not self._stop.is_set():
                        try:
                            self._q.put((step, b), timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if self._stop.is_set():
                        return
            except BaseException as e:  # surfaced in the training thread
                self._q.put((None, e))

        self._thread = threading.Thread(target=run, daemon=True, name="dflash-prefetch")
        self._thread.start()

    def get(self) -> tuple[int, TrainingBatch]:
        step, item = self._q.get()
        if step is None:
            raise item
        return step, item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# ---------------------------------------------------------------------------------------------
# model setup


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


# ---------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def evaluate(
    model: DFlashDraftModel,
    dataset: HiddenStateShards,
    *,
    max_anchors: int = 512,
    batch_size: int = 1,
    seed: int = 0,
    gamma: float | None = None,
    max_rows: int | None = None,
    device: torch.device | str | None = None,
) -> dict:
    """Loss and per-position accuracy of ``model`` on ``dataset`` with fixed (seeded) anchors.

    Returns:
        ``{"loss", "acc_per_position": [block_size floats, NaN at 0], "tau_estimate", "rows"}``.
    """
    was_training = model.training
    model.eval()
    device = torch.device(device) if device is not None else model.fc.weight.device
    bs = model.config.block_size
    n = len(dataset) if max_rows is None else min(len(dataset), max_rows)
    correct = torch.zeros(bs, device=device)
    count = torch.zeros(bs, device=device)
    loss_sum = weight_sum = 0.0
    for lo in range(0, n, batch_size):
        batch = build_batch(
            dataset, list(range(lo, min(n, lo + batch_size))), 0, seed, bs, max_anchors, model.config.mask_token_id
        )
        batch = batch.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = _loss(model, model, batch, gamma)
        loss_sum += float(out["loss"]) * float(out["weight_sum"])
        weight_sum += float(out["weight_sum"])
        correct += out["correct"]
        count += out["count"]
    model.train(was_training)
    acc = accuracy_per_position(correct.cpu(), count.cpu())
    return {
        "loss": loss_sum / weight_sum if weight_sum else math.nan,
        "acc_per_position": acc,
        "tau_estimate": expected_acceptance_length(acc),
        "rows": n,
    }


def _loss(model_call, model: DFlashDraftModel, batch: TrainingBatch, gamma: float | None) -> dict:
    hidden = model_call(
        batch.block_input_ids,
        target_hidden=batch.context_hidden,
        position_ids=batch.position_ids,
        attention_mask=batch.attention_mask,
    )
    return dflash_loss_from_hidden(
        hidden, model.target_lm_head_weight, batch.labels, batch.label_mask, model.config.block_size, gamma
    )


# ---------------------------------------------------------------------------------------------
# checkpoints


def _ckpt_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / CHECKPOINT_DIR


class CheckpointError(ValueError):
    """A checkpoint or ``latest.json`` that resuming refuses (outside the run directory, or holding more
    than tensors and plain data); the message names the file and the fix."""


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """Path of the newest complete checkpoint under ``out_dir/checkpoints`` (None if none).

    ``latest.json`` is data from a shared filesystem: the file it names must be a checkpoint name
    (``step_NNNNNNNN.pt``, one path component) and, symlinks resolved, lie in ``checkpoints/`` itself.

    Raises:
        CheckpointError: ``latest.json`` is unreadable or names anything else (naming it and the value).
    """
    directory = _ckpt_dir(out_dir)
    pointer = directory / LATEST_FILE
    if not pointer.is_file():
        return None
    fix = f"delete {pointer} to resume from nothing (training starts over), or restore it"
    try:
        name = json.loads(pointer.read_text())["file"]
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise CheckpointError(f"{pointer}: unreadable ({type(exc).__name__}); {fix}") from None
    if not isinstance(name, str) or not CHECKPOINT_NAME.fullmatch(name):
        raise CheckpointError(
            f"{pointer}: file {name!r} is not a checkpoint name (step_NNNNNNNN.pt in "
            f"{directory}); it is not loaded; {fix}"
        )
    path = directory / name
    if not path.is_file():
        return None
    if path.resolve().parent != directory.resolve():
        raise CheckpointError(
            f"{pointer}: {name} resolves to {path.resolve()}, outside {directory}; it is not loaded; {fix}"
        )
    return path


def _numpy_rng_globals() -> list:
    """What an ndarray pickle refers to: the ``np.random.get_state()`` arrays of older checkpoints."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint's state dict, read with ``torch.load(weights_only=True)``: tensors, numbers, strings
    and containers (plus the numpy arrays older checkpoints hold their RNG state in), never code.

    Raises:
        CheckpointError: the file holds anything else (e.g. a pickle that would run code when loaded):
            naming the file, what it holds, and the fix; nothing of it was executed.
    """
    try:
        with torch.serialization.safe_globals(_numpy_rng_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL (\S+)", str(exc))
        what = f"it refers to {found.group(1)}" if found else "it holds objects other than tensors and plain data"
        raise CheckpointError(
            f"{path}: not loaded, {what}: not a checkpoint this trainer writes (a weights-only "
            "load refuses it, so nothing in it ran); delete it and checkpoints/latest.json to train "
            "from scratch, or restore the file"
        ) from None
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(
            f"{path}: not a checkpoint this trainer writes (no model / step); delete it and "
            "checkpoints/latest.json to train from scratch"
        )
    return state


def _save_checkpoint(
    cfg: TrainConfig, dc: DFlashConfig, model, opt, sched, step: int, tokens: int, plan: StepPlan, world: int
) -> Path:
    d = _ckpt_dir(cfg.out_dir)
    name = f"step_{step:08d}.pt"
    epoch, in_epoch = divmod(step, plan.steps_per_epoch)
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": _rng_state(),
        "data_position": {"epoch": epoch, "step_in_epoch": in_epoch, "rows_per_step": plan.rows_per_step},
        "tokens_seen": tokens,
        "world_size": world,
        "train_config": asdict(cfg),
        "draft_config": dc.to_dict(),
    }
    atomic_write_bytes(d / name, lambda f: torch.save(state, f))
    atomic_write_bytes(d / LATEST_FILE, json.dumps({"file": name, "step": step}).encode())
    old = sorted(d.glob("step_*.pt"))[: -max(1, cfg.keep_checkpoints)]
    for p in old:
        p.unlink(missing_ok=True)
    return d / name


def load_init_weights(model: DFlashDraftModel, export_dir: str | Path) -> None:
    """Warm start: copy the tensors of an exported drafter into ``model`` (cast to its dtype).

    Raises:
        ValueError: the export's config (layers, sizes, block, target layers) differs from ``model``'s,
            naming the fields; then warm start is impossible and ``warm_start: false`` trains from scratch.
    """
    from safetensors.torch import load_file

    from dflash_assets.dflash.export import config_from_hf_dict, resolve_export

    d = resolve_export(export_dir)  # one version's config and weights, whatever is switched in meanwhile
    theirs = config_from_hf_dict(json.loads((d / "config.json").read_text())).to_dict()
    ours = model.config.to_dict()
    differ = sorted(k for k in ours if k in theirs and theirs[k] != ours[k] and k != "max_position_embeddings")
    if differ:
        raise ValueError(
            f"cannot warm-start from {d}: its {differ} differ from the drafter being trained "
            f"({[(theirs[k], ours[k]) for k in differ]}); set warm_start: false to train from scratch"
        )
    state = load_file(str(d / "model.safetensors"))
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)


def _truncate_log(path: Path, step: int) -> list[dict]:
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break  # a torn last line from a kill
        if rec.get("step", 0) <= step:
            kept.append(rec)
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
    return kept


# ---------------------------------------------------------------------------------------------
# the loop


def train(
    cfg: TrainConfig,
    *,
    draft_config: DFlashConfig | None = None,
    target_head: tuple[torch.Tensor, torch.Tensor] | None = None,
    progress_callback: Callable[[dict], None] | None = None,
    online_target: torch.nn.Module | None = None,
) -> TrainResult:
    """Train (or resume) a drafter on ``cfg.shards`` (or, online, on ``cfg.tokenized``); write log, checkpoints and summary under ``cfg.out_dir``.

    Args:
        draft_config: drafter config; default derived from ``cfg.target_model_path``.
        target_head: (embed_weight, lm_head_weight) [vocab, H]; default read from the target model.
        progress_callback: called on rank 0 with each log record (dict with ``step``, ``total_steps``,
            ``epoch``, ``loss``, ``acc_per_position``, ``lr``, ``grad_norm``, ``tokens_per_s``,
            ``elapsed_s``, ...). Returning ``True`` stops training after that step (a checkpoint is
            written; a later call with a larger schedule resumes); an exception raised by it aborts
            training (checkpoints stay valid).
        online_target: the frozen target for ``features="online"`` (default: loaded from
            ``cfg.target_model_path``); frozen and moved to this rank's device here.

    Output files: ``train_log.jsonl`` (one record per logged step), ``checkpoints/step_*.pt`` +
    ``checkpoints/latest.json``, ``summary.json`` (final step/loss/eval, tokens/s, per-rank parameter
    checksums, which must all be equal).

    Raises:
        ValueError: no usable rows, or shard features do not match the drafter.
    """
    dd = _Dist(cfg.device)
    try:
        return _train(cfg, dd, draft_config, target_head, progress_callback, online_target)
    finally:
        dd.close()


def _datasets(cfg: TrainConfig, dd: _Dist, draft_config, online_target):
    """(train set, eval set or None, online features or None) for ``cfg.features``."""
    split_kw = dict(eval_fraction=cfg.eval_fraction, max_length=cfg.max_length, block_size=cfg.block_size)
    if cfg.features == "offline":
        dataset = HiddenStateShards(cfg.shards, split="train", **split_kw)
        eval_set = HiddenStateShards(cfg.shards, split="eval", **split_kw) if cfg.eval_fraction > 0 else None
        return dataset, eval_set, None
    if cfg.features != "online":
        raise ValueError(f"TrainConfig.features must be 'offline' or 'online', got {cfg.features!r}")
    from dflash_assets.dflash.online import OnlineTargetFeatures, TokenizedRows, load_frozen_target, read_tokenized_rows

    if online_target is None:
        if not cfg.target_model_path:
            raise ValueError("online features need TrainConfig.target_model_path (the frozen target)")
        dtype = getattr(torch, cfg.target_dtype) if cfg.target_dtype else None
        online_target = load_frozen_target(cfg.target_model_path, dd.device, dtype)
    else:
        online_target = online_target.to(dd.device)
    if draft_config is not None:
        layer_ids = draft_config.target_layer_ids
    else:  # the same resolution as the drafter config's and the shards' (dflash.target_layers)
        layer_ids = resolve_target_layer_ids(online_target, cfg.target_layer_ids, cfg.num_context_features)
    features = OnlineTargetFeatures(online_target, layer_ids)
    if dd.rank == 0:
        from dflash_assets.dflash.target_kernels import linear_attention_kernels

        features.kernels = linear_attention_kernels(online_target)["summary"]
        print(f"[dflash.train] online target {type(online_target).__name__}: {features.kernels}", flush=True)
    rows = read_tokenized_rows(cfg.tokenized)
    dataset = TokenizedRows(rows, split="train", features=features, **split_kw).tokens_only()
    eval_set = TokenizedRows(rows, split="eval", features=features, **split_kw) if cfg.eval_fraction > 0 else None
    return dataset, eval_set, features


def _train(cfg, dd: _Dist, draft_config, target_head, progress_callback, online_target=None) -> TrainResult:
    out = Path(cfg.out_dir)
    if dd.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    torch.manual_seed(cfg.seed)

    dataset, eval_set, online = _datasets(cfg, dd, draft_config, online_target)
    dc = draft_config or resolve_draft_config(cfg, dataset)
    check_feature_dim(dc, dataset)
    if dc.block_size != cfg.block_size:
        raise ValueError(f"draft_config.block_size {dc.block_size} != TrainConfig.block_size {cfg.block_size}")
    if target_head is None:
        if not cfg.target_model_path:
            raise ValueError("pass target_head or TrainConfig.target_model_path")
        target_head = load_target_head(cfg.target_model_path)

    device = dd.device
    use_cuda = device.type == "cuda"
    model = DFlashDraftModel(dc)
    model.reset_parameters(cfg.init_std, seed=cfg.seed)
    if cfg.init_from:
        load_init_weights(model, cfg.init_from)
    model.to(device)
    head_dtype = torch.bfloat16 if use_cuda else torch.float32
    model.attach_target(target_head[0].to(head_dtype), target_head[1].to(head_dtype))

    plan = StepPlan(len(dataset), dd.world, cfg.batch_size, cfg.seed)
    total_steps = cfg.max_steps if cfg.max_steps is not None else cfg.epochs * plan.steps_per_epoch
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio))

    start_step, tokens_seen = 0, 0
    ckpt = latest_checkpoint(out) if cfg.resume else None
    if ckpt is not None:
        state = load_checkpoint(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
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
        records = _truncate_log(log_path, start_step) if ckpt is not None else []
        if ckpt is None and log_path.exists():
            log_path.unlink()
    dd.barrier()

    train_model: torch.nn.Module = model
    if dd.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(model, device_ids=[device.index] if use_cuda else None, broadcast_buffers=False)
    model.train()

    def make(step: int) -> TrainingBatch:
        epoch, rows = plan.rows(step, dd.rank)
        return build_batch(dataset, rows, epoch, cfg.seed, cfg.block_size, cfg.max_anchors, dc.mask_token_id)

    prefetch = _Prefetcher(make, start_step, total_steps, cfg.prefetch, pin=use_cuda)
    window_start = time.perf_counter()
    loop_start, loop_tokens = window_start, 0
    acc_correct = torch.zeros(cfg.block_size, device=device)
    acc_count = torch.zeros(cfg.block_size, device=device)
    loss_sum = torch.zeros(2, device=device)  # sum of loss, number of steps
    tok_sum = torch.zeros(2, device=device, dtype=torch.float64)  # block tokens, context tokens
    stop = torch.zeros(1, device=device)  # set when the progress callback asks to stop early
    done = start_step
    step = start_step
    try:
        for step in range(start_step, total_steps):
            got, batch = prefetch.get()
            assert got == step
            batch = batch.to(device, non_blocking=True)
            if online is not None:  # the frozen target computes this batch's context features
                batch.context_hidden = online(batch.context_input_ids, batch.context_lengths)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_cuda):
                res = _loss(train_model, model, batch, cfg.loss_gamma)
            loss, step_loss = res["loss"], res["loss"].detach().float()
            if dd.enabled:
                # DDP averages gradients over ranks; scale so the result is the gradient of the global
                # weighted mean (what one process with the whole global batch computes)
                totals = dd.all_reduce_sum(
                    torch.stack([step_loss * res["weight_sum"].float(), res["weight_sum"].float().detach()])
                )
                global_w = totals[1].clamp(min=1e-12)
                loss = loss * (res["weight_sum"].float().detach() * dd.world / global_w)
                step_loss = totals[0] / global_w / dd.world  # summed over ranks at log time
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)

            loss_sum += torch.stack([step_loss, torch.ones((), device=device) / dd.world])
            acc_correct += res["correct"]
            acc_count += res["count"]
            tok_sum[0] += batch.num_block_tokens
            tok_sum[1] += batch.num_context_tokens
            loop_tokens += batch.num_block_tokens
            done = step + 1
            tokens_seen += batch.num_block_tokens * dd.world

            if done % cfg.log_every == 0 or done == total_steps:
                stats = torch.cat([loss_sum.double(), acc_correct.double(), acc_count.double(), tok_sum])
                dd.all_reduce_sum(stats)
                now = time.perf_counter()
                nb = cfg.block_size
                rec = {
                    "step": done,
                    "total_steps": total_steps,
                    "epoch": step // plan.steps_per_epoch,
                    "loss": float(stats[0] / stats[1]),
                    "acc_per_position": accuracy_per_position(stats[2 : 2 + nb], stats[2 + nb : 2 + 2 * nb]),
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "block_tokens": int(stats[-2]),
                    "context_tokens": int(stats[-1]),
                    "tokens_per_s": float(stats[-2]) / max(now - window_start, 1e-9),
                    "elapsed_s": now - loop_start,
                }
                if (
                    eval_set is not None
                    and len(eval_set)
                    and cfg.eval_every
                    and (done % cfg.eval_every == 0 or done == total_steps)
                ):
                    ev = evaluate(
                        model,
                        eval_set,
                        max_anchors=cfg.max_anchors,
                        seed=cfg.seed,
                        gamma=cfg.loss_gamma,
                        max_rows=cfg.eval_max_rows,
                    )
                    rec.update(
                        {
                            "eval_loss": ev["loss"],
                            "eval_acc_per_position": ev["acc_per_position"],
                            "eval_tau_estimate": ev["tau_estimate"],
                        }
                    )
                for t in (loss_sum, acc_correct, acc_count, tok_sum):
                    t.zero_()
                window_start = time.perf_counter()  # eval/log time stays out of the next window
                if dd.rank == 0:
                    records.append(rec)
                    with open(log_path, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    if progress_callback is not None and progress_callback(rec) is True:
                        stop[0] = 1.0
                if dd.enabled:
                    dd.all_reduce_sum(stop)  # every rank stops at the same step
            stopping = bool(stop[0] > 0)
            if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == total_steps or stopping:
                if dd.rank == 0:
                    _save_checkpoint(cfg, dc, model, opt, sched, done, tokens_seen, plan, dd.world)
                dd.barrier()
            if stopping:
                break
    finally:
        prefetch.close()
    loop_s = time.perf_counter() - loop_start
    tokens_per_s = loop_tokens * dd.world / loop_s if loop_s > 0 and loop_tokens else 0.0

    checksum = _param_checksum(model)
    checksums = [checksum]
    if dd.enabled:
        checksums = [None] * dd.world
        dist.all_gather_object(checksums, checksum)
    summary = {
        "step": done,
        "total_steps": total_steps,
        "stopped_early": bool(stop[0] > 0),
        "resumed_from_step": start_step,
        "world_size": dd.world,
        "features": cfg.features,
        "target_forwards": online.forwards if online is not None else 0,
        "target_kernels": getattr(online, "kernels", None),
        "train_rows": len(dataset),
        "dropped_rows": dataset.dropped_rows,
        "train_tokens": dataset.num_tokens,
        "tokens_seen": tokens_seen,
        "tokens_per_s": tokens_per_s,
        "final_loss": records[-1]["loss"] if records else None,
        "rank_param_checksums": checksums,
        "draft_config": dc.to_dict(),
    }
    if eval_set is not None and len(eval_set):
        summary["eval"] = evaluate(
            model,
            eval_set,
            max_anchors=cfg.max_anchors,
            seed=cfg.seed,
            gamma=cfg.loss_gamma,
            max_rows=cfg.eval_max_rows,
        )
    if dd.rank == 0:
        atomic_write_bytes(out / SUMMARY_FILE, json.dumps(summary, indent=2).encode())
    dd.barrier()
    return TrainResult(model=model, records=records, step=done, tokens_per_s=tokens_per_s, summary=summary)


# ---------------------------------------------------------------------------------------------
# CLI


def _parse(argv: list[str] | None) -> tuple[TrainConfig, str | None]:
    p = argparse.ArgumentParser(description="Train a DFlash drafter on hidden-state shards (torchrun-ready).")
    p.add_argument("--shards", nargs="*", default=[], help="safetensors hidden-state shards (offline features)")
    p.add_argument("--tokenized", nargs="*", default=[], help="tokenized_sequences parquet files (online features)")
    p.add_argument(
        "--features", choices=["offline", "online"], default=None, help="default: online when --tokenized is given"
    )
    p.add_argument("--out", required=True, help="output dir (log, checkpoints, summary)")
    p.add_argument("--target-model", help="HF dir of the target (config, tokenizer, embedding, LM head)")
    p.add_argument("--export", help="export the trained drafter to this HF dir (rank 0)")
    p.add_argument("--config-json", help="JSON file of TrainConfig fields (CLI flags override it)")
    flags = {
        "num_hidden_layers": int,
        "block_size": int,
        "max_anchors": int,
        "max_length": int,
        "batch_size": int,
        "lr": float,
        "epochs": int,
        "max_steps": int,
        "checkpoint_every": int,
        "seed": int,
        "log_every": int,
        "eval_fraction": float,
        "eval_every": int,
        "mask_token_id": int,
        "warmup_ratio": float,
        "grad_clip": float,
        "device": str,
        "target_dtype": str,
    }
    for name, typ in flags.items():
        p.add_argument("--" + name.replace("_", "-"), type=typ, default=None)
    p.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--draft-overrides", type=json.loads, default=None, help='JSON, e.g. {"intermediate_size": 512}')
    p.add_argument("--no-resume", action="store_true")
    a = p.parse_args(argv)
    base: dict = json.loads(Path(a.config_json).read_text()) if a.config_json else {}
    base.update(shards=a.shards, out_dir=a.out, tokenized=a.tokenized)
    base["features"] = a.features or ("online" if a.tokenized and not a.shards else base.get("features", "offline"))
    if a.target_model:
        base["target_model_path"] = a.target_model
    for name in list(flags) + ["target_layer_ids", "draft_overrides"]:
        v = getattr(a, name)
        if v is not None:
            base[name] = v
    if a.no_resume:
        base["resume"] = False
    return TrainConfig(**base), a.export


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints one JSON line per logged step on rank 0 and the summary at the end."""
    cfg, export_dir = _parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    cb = (lambda rec: print(json.dumps(rec), flush=True)) if rank == 0 else None
    result = train(cfg, progress_callback=cb)
    if export_dir and rank == 0:
        from dflash_assets.dflash.export import export_drafter

        export_drafter(result.model, export_dir)
    if rank == 0:
        print(json.dumps({"summary": {k: v for k, v in result.summary.items() if k != "draft_config"}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "StepPlan",
    "TrainConfig",
    "TrainResult",
    "build_batch",
    "evaluate",
    "latest_checkpoint",
    "load_init_weights",
    "lr_lambda",
    "main",
    "resolve_draft_config",
    "train",
]
