"""A stand-in for a drafter trained on a real corpus: one overfit, in seconds, on the target's own greedy
completions of a few prompts, so that speculative decoding of those prompts accepts most drafts.

Shared by test_speculative, test_dflash_train and bench/bench_speculative.py, which each built the same
rows, shards and training recipe by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.shards.extraction import extract_partition
from dflash_assets.dflash.training.config import TrainConfig, TrainResult
from dflash_assets.dflash.training.train import train

__all__ = ["greedy_rows", "overfit", "overfit_config"]


def greedy_rows(prompts: Sequence[list[int]], completions: Sequence) -> list[dict]:
    """Rows ``{index, input_ids, loss_mask}``: each prompt followed by the target's completion of it (a
    :class:`~dflash_assets.dflash.decoding.speculative.SpecResult`), the loss on the completion only."""
    return [
        {"index": i, "input_ids": p + c.output_ids, "loss_mask": [0] * len(p) + [1] * len(c.output_ids)}
        for i, (p, c) in enumerate(zip(prompts, completions))
    ]


def overfit_config(
    shards: list[str],
    out_dir: str | Path,
    *,
    block_size: int,
    batch_size: int,
    steps: int,
    lr: float = 2e-3,
    max_anchors: int = 64,
    seed: int = 0,
    log_every: int = 5,
    **settings,
) -> TrainConfig:
    """The recipe: ``steps`` at most, 5% warm-up, cosine down to a tenth of ``lr``, every row trained on (no
    held-out share), no checkpoint but the last, one batch prefetched. ``settings``: more TrainConfig fields."""
    return TrainConfig(
        shards=shards,
        out_dir=str(out_dir),
        block_size=block_size,
        max_anchors=max_anchors,
        batch_size=batch_size,
        lr=lr,
        max_steps=steps,
        warmup_ratio=0.05,
        min_lr_ratio=0.1,
        checkpoint_every=0,
        eval_fraction=0.0,
        log_every=log_every,
        seed=seed,
        prefetch=1,
        **settings,
    )


def overfit(
    target,
    rows: list[dict],
    layer_ids: list[int],
    work_dir: str | Path,
    draft_config: DFlashConfig,
    target_head: tuple,
    *,
    steps: int,
    stop: Callable[[dict], bool] | None = None,
    **recipe,
) -> tuple[TrainResult, list[str]]:
    """Extract ``target``'s features of ``rows`` into ``work_dir/shards`` and train ``draft_config`` on them by
    :func:`overfit_config` (``recipe``: its keyword arguments; the batch is every row unless given), stopping
    early when ``stop(record)`` says so. Returns the training result and the shards."""
    work = Path(work_dir)
    extract_partition(target, rows, work / "shards", layer_ids, rows_per_shard=64)
    shards = sorted(str(p) for p in (work / "shards").glob("*.safetensors"))
    recipe.setdefault("batch_size", len(rows))
    cfg = overfit_config(shards, work / "run", block_size=draft_config.block_size, steps=steps, **recipe)
    return train(cfg, draft_config=draft_config, target_head=target_head, progress_callback=stop), shards
