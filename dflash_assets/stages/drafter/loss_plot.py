"""The drafter's loss curve: ``train_log.jsonl`` records drawn as a PNG."""

import json
import os

from dflash_assets.common.figures import figure_png_bytes, new_figure


def loss_curve_png(records: list[dict]) -> bytes:
    """PNG bytes of training loss per step (and held-out loss where logged)."""
    fig, ax = new_figure(figsize=(7, 3.5), dpi=100)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss")
    ev = [r for r in records if "eval_loss" in r]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("decay-weighted CE")
    ax.legend()
    fig.tight_layout()
    return figure_png_bytes(fig)


def read_log(path: str) -> list[dict]:
    """Records of a train_log.jsonl (a torn last line is ignored)."""
    records = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return records


def loss_curve_of_run(run_dir: str) -> bytes:
    """The loss-curve PNG of the run in ``run_dir`` (its ``train_log.jsonl``); empty bytes without records."""
    records = read_log(os.path.join(run_dir, "train_log.jsonl"))
    return loss_curve_png(records) if records else b""
