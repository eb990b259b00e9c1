"""Training-loop efficiency: tokens/s of ``dflash.training.train.train`` divided by a bare forward+backward.

Both sides process exactly the same batches (same rows, anchors, block tokens): the bare side builds
them up front, moves them to the device, and times only drafter forward + loss + backward. The
training side additionally reads shards, samples anchors, collates, clips, steps AdamW and the
schedule, logs and checkpoints (once, at the end). Goal: ratio >= 0.85, as the median over ``--rounds``
rounds in one process that alternate which side runs first.

Tokens are block tokens (anchors x block_size): the drafter's work per step. The data is synthetic
(random target features and LM head of the given sizes), which does not change the cost.

Usage: ``python bench/bench_train.py [--device cuda] [--steps 30] [--seq-len 1024] ...``; prints one
line per round, the median ratio beside the goal, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from headline import headline

from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.model.draft_model import DFlashDraftModel
from dflash_assets.dflash.model.loss import dflash_loss_from_hidden
from dflash_assets.dflash.shards.dataset import HiddenStateShards
from dflash_assets.dflash.training.batches import StepPlan, build_batch
from dflash_assets.dflash.training.config import TrainConfig
from dflash_assets.dflash.training.train import train


def make_shard(path: Path, rows: int, seq_len: int, prompt_len: int, feat_dim: int, vocab: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = rows * seq_len
    loss_mask = torch.zeros(rows, seq_len, dtype=torch.int8)
    loss_mask[:, prompt_len:] = 1
    save_file(
        {
            "hidden_states": torch.randn(n, feat_dim, generator=g).to(torch.bfloat16),
            "input_ids": torch.randint(0, vocab - 1, (n,), generator=g).to(torch.int32),
            "loss_mask": loss_mask.reshape(-1),
            "cu_seqlens": torch.arange(0, n + 1, seq_len, dtype=torch.int64),
        },
        str(path),
    )


def bare_tokens_per_s(dc, embed, head, batches, device, block_size) -> float:
    """Block tokens/s of drafter forward + loss + backward alone over prebuilt device batches."""
    cuda = device.type == "cuda"
    model = DFlashDraftModel(dc)
    model.reset_parameters(seed=0)
    model.to(device)
    hd = torch.bfloat16 if cuda else torch.float32
    model.attach_target(embed.to(hd), head.to(hd))
    model.train()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = 0
    for b in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            hidden = model(
                b.block_input_ids,
                target_hidden=b.context_hidden,
                position_ids=b.position_ids,
                attention_mask=b.attention_mask,
            )
            loss = dflash_loss_from_hidden(hidden, model.target_lm_head_weight, b.labels, b.label_mask, block_size)[
                "loss"
            ]
        loss.backward()
        model.zero_grad(set_to_none=True)
        tokens += b.num_block_tokens
    if cuda:
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--anchors", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="alternating train/bare rounds; the median ratio is reported")
    a = p.parse_args()
    cuda = a.device.startswith("cuda")
    steps = a.steps or (40 if cuda else 12)
    seq_len = a.seq_len or (3072 if cuda else 512)
    anchors = a.anchors or (512 if cuda else 32)
    layers = a.layers or (5 if cuda else 2)
    torch.set_num_threads(a.threads)

    dc = DFlashConfig(
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.hidden // a.heads,
        intermediate_size=a.intermediate,
        vocab_size=a.vocab,
        mask_token_id=a.vocab - 1,
        target_layer_ids=[1, 8, 14, 20, 27],
        num_target_layers=30,
        num_hidden_layers=layers,
        block_size=a.block_size,
    )
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(a.vocab, a.hidden, generator=g) * 0.05
    head = torch.randn(a.vocab, a.hidden, generator=g) * 0.05
    with tempfile.TemporaryDirectory() as tmp:
        shard = Path(tmp) / "shard.safetensors"
        rows = steps * a.batch_size
        make_shard(shard, rows, seq_len, seq_len // 8, 5 * a.hidden, a.vocab, 1)
        cfg = TrainConfig(
            shards=[str(shard)],
            out_dir=str(Path(tmp) / "run"),
            block_size=a.block_size,
            max_anchors=anchors,
            max_length=seq_len,
            batch_size=a.batch_size,
            max_steps=steps,
            checkpoint_every=0,
            eval_fraction=0.0,
            log_every=10,
            seed=0,
            device=a.device,
        )
        # the same batches as the training run, prebuilt and already on the device
        device = torch.device(a.device)
        dataset = HiddenStateShards([str(shard)], max_length=seq_len, block_size=a.block_size)
        plan = StepPlan(len(dataset), 1, a.batch_size, cfg.seed)
        batches = []
        for s in range(steps):
            epoch, rws = plan.rows(s, 0)
            batches.append(
                build_batch(dataset, rws, epoch, cfg.seed, a.block_size, anchors, dc.mask_token_id).to(device)
            )
        tokens = sum(b.num_block_tokens for b in batches)
        # Rounds alternate which side runs first, in one process; each round's ratio compares two
        # neighbouring timings, and the median over rounds is the figure (a single pair under load
        # once read 1.708, impossible: training does strictly more than the bare pass).
        rounds = []
        for r in range(a.rounds):
            cfg_r = cfg.model_copy(update={"out_dir": str(Path(tmp) / f"run{r}")})  # a fresh run each round, no resume
            if r % 2 == 0:
                bare_tps = bare_tokens_per_s(dc, embed, head, batches, device, a.block_size)
                train_tps = train(cfg_r, draft_config=dc, target_head=(embed, head)).tokens_per_s
            else:
                train_tps = train(cfg_r, draft_config=dc, target_head=(embed, head)).tokens_per_s
                bare_tps = bare_tokens_per_s(dc, embed, head, batches, device, a.block_size)
            rounds.append((train_tps, bare_tps, train_tps / bare_tps))
            print(
                f"round {r + 1}: train {train_tps:.1f} tok/s, bare {bare_tps:.1f} tok/s, ratio "
                f"{train_tps / bare_tps:.3f}",
                flush=True,
            )
    ratios = sorted(x[2] for x in rounds)
    median = (
        ratios[len(ratios) // 2] if len(ratios) % 2 else (ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2]) / 2
    )
    print(
        f"train / bare forward+backward ratio: median {median:.3f} over {len(rounds)} alternating rounds "
        f"(range {ratios[0]:.3f}-{ratios[-1]:.3f}; goal >= 0.85: {'met' if median >= 0.85 else 'NOT met'})"
    )
    headline(
        f"drafter train step / bare forward+backward tokens/s, median of {len(rounds)} alternating rounds",
        median,
        ">= 0.85",
        median >= 0.85,
    )
    print(
        json.dumps(
            {
                "device": a.device,
                "steps": steps,
                "seq_len": seq_len,
                "anchors": anchors,
                "layers": layers,
                "block_tokens_per_step": tokens // steps,
                "rounds": len(rounds),
                "train_tokens_per_s_median": round(sorted(x[0] for x in rounds)[len(rounds) // 2], 1),
                "bare_tokens_per_s_median": round(sorted(x[1] for x in rounds)[len(rounds) // 2], 1),
                "ratio": round(median, 3),
                "ratios": [round(x, 3) for x in ratios],
                "goal": 0.85,
            }
        )
    )


if __name__ == "__main__":
    main()
