"""Training checkpoints: written atomically, read back trusting nothing in them (a shared filesystem), the RNG
states they carry, warm-start weights and the log truncated to a resumed step."""

from __future__ import annotations

import json
import pickle
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.model.draft_model import DFlashDraftModel
from dflash_assets.storage.atomic import atomic_write_bytes

if TYPE_CHECKING:
    from dflash_assets.dflash.training.batches import StepPlan
    from dflash_assets.dflash.training.config import TrainConfig

CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest.json"
CHECKPOINT_NAME = re.compile(r"step_\d{8,}\.pt")  # what save_checkpoint writes


def rng_state() -> dict:
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


def set_rng_state(state: dict) -> None:
    """Restore the RNG states :func:`rng_state` took (or an older checkpoint's, numpy's as a tuple)."""
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


def save_checkpoint(
    cfg: TrainConfig, dc: DFlashConfig, model, opt, sched, step: int, tokens: int, plan: StepPlan, world: int
) -> Path:
    """Write ``checkpoints/step_NNNNNNNN.pt`` (model, optimizer, scheduler, RNG states, data position) and point
    ``latest.json`` at it, both atomically; keep the newest ``cfg.keep_checkpoints``. Returns its path."""
    d = _ckpt_dir(cfg.out_dir)
    name = f"step_{step:08d}.pt"
    epoch, in_epoch = divmod(step, plan.steps_per_epoch)
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": rng_state(),
        "data_position": {"epoch": epoch, "step_in_epoch": in_epoch, "rows_per_step": plan.rows_per_step},
        "tokens_seen": tokens,
        "world_size": world,
        "train_config": cfg.model_dump(),
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

    from dflash_assets.dflash.export.directory import config_from_hf_dict, resolve_export

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


def truncate_log(path: Path, step: int) -> list[dict]:
    """Keep the log records up to ``step`` (a resumed run rewrites the rest); returns them."""
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
