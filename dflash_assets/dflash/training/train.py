"""DFlash drafter training loop: single process or ``torchrun`` (DDP), resumable, logged.

Recipe (DFlash paper arXiv 2602.06036 and its trainers): AdamW lr 6e-4, cosine schedule with 4%
linear warmup, gradient clipping at 1.0, 6 epochs, rows truncated to 3072 tokens, up to 512 anchors
per row, decay-weighted block CE (:mod:`dflash_assets.dflash.model.loss`). bf16 autocast on CUDA, float32
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

Entry point: ``python -m dflash_assets.dflash.training.train --shards S1 S2 --out DIR --target-model MODEL_DIR``
(online: ``--tokenized P1.parquet P2.parquet`` instead of ``--shards``; also under ``torchrun
--nproc_per_node N [--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT]``).

Modules: settings and result (:mod:`~dflash_assets.dflash.training.config`), data order
(:mod:`~dflash_assets.dflash.training.batches`), setup steps (:mod:`~dflash_assets.dflash.training.setup`), the loop
(:mod:`~dflash_assets.dflash.training.loop`), loss and evaluation (:mod:`~dflash_assets.dflash.training.held_out`),
checkpoints (:mod:`~dflash_assets.dflash.training.checkpoints`), ranks
(:mod:`~dflash_assets.dflash.training.process_group`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.training.config import TrainConfig, TrainResult
from dflash_assets.dflash.training.loop import run_training
from dflash_assets.dflash.training.process_group import Distributed


def train(
    cfg: TrainConfig,
    *,
    draft_config: DFlashConfig | None = None,
    target_head: tuple[torch.Tensor, torch.Tensor] | None = None,
    progress_callback: Callable[[dict], None] | None = None,
    online_target: torch.nn.Module | None = None,
) -> TrainResult:
    """Train (or resume) a drafter on ``cfg.shards`` (or, online, on ``cfg.tokenized``); write log, checkpoints
    and summary under ``cfg.out_dir``.

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
    dd = Distributed(cfg.device)
    try:
        return run_training(cfg, dd, draft_config, target_head, progress_callback, online_target)
    finally:
        dd.close()


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
    for name in [*flags, "target_layer_ids", "draft_overrides"]:
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
        from dflash_assets.dflash.export.directory import export_drafter

        export_drafter(result.model, export_dir)
    if rank == 0:
        print(json.dumps({"summary": {k: v for k, v in result.summary.items() if k != "draft_config"}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["main", "train"]
