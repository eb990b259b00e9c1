"""Online training efficiency: ``train(features="online")`` tokens/s against the bare work on the same batches.

Bare side (the plain way a competent engineer would do it): for each batch, the HF base model's
forward, cut after the deepest DFlash layer (the same layers the extractor runs; no LM head), with
``output_hidden_states=True`` over the batch's context tokens (right-padded, attention
mask), the DFlash layers concatenated and cast to bf16, then the drafter forward, the DFlash loss and
backward. Nothing else: no data loading, anchor sampling, optimizer step, clipping, logging or
checkpoint. Online side: the real training loop (``dflash.training.train.train``, frozen target in the loop,
feature extraction stopping after the last needed layer). Both process exactly the same batches (same
rows, anchors, context and block tokens) in one process, measured after a warm-up window of the
same length. Goal: online / bare >= 0.9.

Also printed: offline training (the same rows' features extracted to shards first, then read back)
tokens/s, i.e. what online costs against stored features, and the extraction rate.

Tokens are block tokens (anchors x block_size), the drafter's work per step; context tokens/s (the
target's work) are printed beside them. The target is random-init (``bench/random_targets.py``), which
does not change the cost.

Usage: ``python bench/bench_online.py [--size cpu|tiny|qwen3-4b|hybrid-tiny|hybrid-cpu|qwen36-27b] [--num-layers N]
[--draft-overrides JSON] [--device cpu|cuda] [--steps 8]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from headline import headline
from random_targets import ALL_SIZES, num_parameters, random_target

from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.model.draft_model import DFlashDraftModel
from dflash_assets.dflash.model.loss import dflash_loss_from_hidden
from dflash_assets.dflash.shards.extraction import extract_partition
from dflash_assets.dflash.shards.format import read_index
from dflash_assets.dflash.target.layers import default_target_layer_ids
from dflash_assets.dflash.training.batches import StepPlan, build_batch
from dflash_assets.dflash.training.config import TrainConfig
from dflash_assets.dflash.training.online import TokenizedRows
from dflash_assets.dflash.training.train import train


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_rows(n: int, seq_len: int, prompt_len: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "index": i,
            "input_ids": torch.randint(0, vocab - 1, (seq_len,), generator=g).tolist(),
            "loss_mask": [0] * prompt_len + [1] * (seq_len - prompt_len),
        }
        for i in range(n)
    ]


def bare(target, drafter, batches, layer_ids, device) -> tuple[float, int, int]:
    """Seconds, block tokens and context tokens of plain target forward + drafter forward/backward."""
    base = target.model
    all_layers = base.layers
    base.layers = all_layers[: max(layer_ids) + 1]  # the same layers the extractor runs, as a competent engineer would
    try:
        return _bare_timed(target, drafter, batches, layer_ids, device)
    finally:
        base.layers = all_layers


def _bare_timed(target, drafter, batches, layer_ids, device) -> tuple[float, int, int]:
    use_cuda = device.type == "cuda"
    sync(device)
    start = time.perf_counter()
    block = ctx = 0
    for b in batches:
        b = b.to(device, non_blocking=True)
        ids = b.context_input_ids
        att = (torch.arange(ids.shape[1], device=device)[None, :] < b.context_lengths.to(device)[:, None]).long()
        with torch.no_grad():
            hs = target.model(
                input_ids=ids, attention_mask=att, output_hidden_states=True, use_cache=False
            ).hidden_states
            feats = torch.cat([hs[i + 1] for i in layer_ids], dim=-1).to(torch.bfloat16)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_cuda):
            hidden = drafter(
                b.block_input_ids, target_hidden=feats, position_ids=b.position_ids, attention_mask=b.attention_mask
            )
            out = dflash_loss_from_hidden(
                hidden, drafter.target_lm_head_weight, b.labels, b.label_mask, drafter.config.block_size, None
            )
        out["loss"].backward()
        drafter.zero_grad(set_to_none=True)
        block += b.num_block_tokens
        ctx += int(b.context_lengths.sum())
    sync(device)
    return time.perf_counter() - start, block, ctx


def main(argv: list[str] | None = None, headlines: bool = True) -> dict:
    """Measure and print; ``headlines=False`` when a caller (gpu_check) prints its own, named ones."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=ALL_SIZES, default="cpu")
    p.add_argument("--num-layers", type=int, default=None, help="target depth (default: the size's)")
    p.add_argument(
        "--draft-overrides",
        type=json.loads,
        default={},
        help="drafter shape unlike the target's, e.g. "
        '{"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}',
    )
    p.add_argument("--tiny", action="store_true", help="same as --size tiny --steps 3 --seq-len 96 (a smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=8, help="measured steps (after as many warm-up steps)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument(
        "--rounds", type=int, default=3, help="alternating bare / online rounds; the median ratio is reported"
    )
    p.add_argument("--skip-offline", action="store_true")
    a = p.parse_args(argv)
    if a.tiny:
        a.size, a.steps, a.seq_len, a.anchors, a.rounds = "tiny", 3, 96, 8, 1
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = random_target(a.size, device, dtype, num_layers=a.num_layers)
    cfg_dict = target.config.to_dict()
    vocab = target.config.vocab_size
    layer_ids = default_target_layer_ids(target.config.num_hidden_layers, 5)
    dc = DFlashConfig.from_target_config(
        cfg_dict,
        mask_token_id=vocab - 1,
        num_hidden_layers=a.draft_layers,
        num_context_features=5,
        target_layer_ids=layer_ids,
        block_size=a.block_size,
        **a.draft_overrides,
    )
    head = (target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach())
    steps = 2 * a.steps  # first half: warm-up window
    rows = make_rows(steps * a.batch_size, a.seq_len, a.seq_len // 4, vocab)
    seed = 3
    tmp = Path(tempfile.mkdtemp(prefix="bench-online-"))
    tok = tmp / "tok.parquet"
    pl.DataFrame(rows).write_parquet(tok)

    # the very batches the training loop will build, for the bare side
    ds = TokenizedRows(rows, split="all", max_length=a.seq_len, block_size=a.block_size)
    plan = StepPlan(len(ds), 1, a.batch_size, seed)
    batches = [
        build_batch(ds, plan.rows(s, 0)[1], plan.rows(s, 0)[0], seed, a.block_size, a.anchors, dc.mask_token_id)
        for s in range(steps)
    ]
    draft_parameters = [0]

    def run_bare() -> tuple[float, int, int]:
        drafter = DFlashDraftModel(dc)
        draft_parameters[0] = sum(p.numel() for p in drafter.parameters())
        drafter.reset_parameters(0.02, seed=0)
        drafter.to(device)
        hd = torch.bfloat16 if device.type == "cuda" else torch.float32
        drafter.attach_target(head[0].to(hd), head[1].to(hd))
        drafter.train()
        bare(target, drafter, batches[: a.steps], layer_ids, device)  # warm-up
        return bare(target, drafter, batches[a.steps :], layer_ids, device)

    def run(features: str, tag: str = "", **kw) -> dict:
        cfg = TrainConfig(
            shards=kw.pop("shards", []),
            tokenized=[str(tok)] if features == "online" else [],
            features=features,
            out_dir=str(tmp / f"{features}{tag}"),
            num_hidden_layers=a.draft_layers,
            num_context_features=5,
            target_layer_ids=layer_ids,
            block_size=a.block_size,
            mask_token_id=vocab - 1,
            max_length=a.seq_len,
            max_anchors=a.anchors,
            batch_size=a.batch_size,
            max_steps=steps,
            log_every=a.steps,
            checkpoint_every=0,
            seed=seed,
            device=a.device,
            eval_fraction=0.0,
        )
        result = train(cfg, draft_config=dc, target_head=head, online_target=target if features == "online" else None)
        return result.records[1]  # the measured window: steps a.steps+1 .. 2*a.steps

    # rounds alternate which side goes first, so load that comes and goes falls on both; the median ratio is reported
    ratios, bare_runs, online_runs = [], [], []
    for r in range(a.rounds):
        if r % 2 == 0:
            b_run, o_run = run_bare(), run("online", tag=f"-{r}")
        else:
            o_run, b_run = run("online", tag=f"-{r}"), run_bare()
        bare_runs.append(b_run)
        online_runs.append(o_run)
        ratios.append(o_run["tokens_per_s"] / (b_run[1] / b_run[0]))
        print(
            f"round {r + 1}/{a.rounds}: bare {b_run[1] / b_run[0]:.1f}, online {o_run['tokens_per_s']:.1f} block "
            f"tok/s, ratio {ratios[-1]:.3f}",
            flush=True,
        )
    median = sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]
    bare_s, bare_block, bare_ctx = bare_runs[median]
    online = online_runs[median]
    res = {
        "size": a.size,
        "target_parameters": num_parameters(target),
        "device": str(device),
        "draft_parameters": draft_parameters[0],
        "torch_threads": torch.get_num_threads(),
        "steps_measured": a.steps,
        "batch_size": a.batch_size,
        "seq_len": a.seq_len,
        "block_size": a.block_size,
        "anchors": a.anchors,
        "draft_layers": a.draft_layers,
        "bare_block_tokens_per_s": round(bare_block / bare_s, 1),
        "bare_context_tokens_per_s": round(bare_ctx / bare_s, 1),
        "online_block_tokens_per_s": round(online["tokens_per_s"], 1),
        # same batches, so the same context tokens (cut at each batch's last anchor) per block token
        "online_context_tokens_per_s": round(bare_ctx * online["tokens_per_s"] / bare_block, 1),
        "same_block_tokens": online["block_tokens"] == bare_block,
    }
    res["ratio_online_over_bare"] = round(ratios[median], 3)
    res["ratios_per_round"] = [round(x, 3) for x in ratios]
    if not a.skip_offline:
        with torch.inference_mode():
            t0 = time.perf_counter()
            extract_partition(
                target, rows, tmp / "hs", layer_ids, rows_per_shard=64, max_tokens_per_batch=a.batch_size * a.seq_len
            )
            sync(device)
            ext_s = time.perf_counter() - t0
        shards = [str(tmp / "hs" / s["name"]) for s in read_index(tmp / "hs")["shards"]]
        offline = run("offline", shards=shards)
        res["extraction_tokens_per_s"] = round(len(rows) * a.seq_len / ext_s, 1)
        res["offline_block_tokens_per_s"] = round(offline["tokens_per_s"], 1)
        res["ratio_online_over_offline"] = round(online["tokens_per_s"] / offline["tokens_per_s"], 3)
    print(
        f"bare (target fwd + drafter fwd/bwd): {res['bare_block_tokens_per_s']:.1f} block tok/s, "
        f"{res['bare_context_tokens_per_s']:.1f} context tok/s"
    )
    print(
        f"online training                    : {res['online_block_tokens_per_s']:.1f} block tok/s, "
        f"{res['online_context_tokens_per_s']:.1f} context tok/s"
    )
    print(
        f"ratio online / bare = {res['ratio_online_over_bare']:.3f} (median of {a.rounds} alternating rounds)   (goal "
        ">= 0.9)"
    )
    if "offline_block_tokens_per_s" in res:
        print(
            f"offline training                   : {res['offline_block_tokens_per_s']:.1f} block tok/s "
            f"(features read from shards; extraction ran at {res['extraction_tokens_per_s']:.1f} tok/s)"
        )
        print(f"ratio online / offline = {res['ratio_online_over_offline']:.3f}   (the price of not storing features)")
    if not headlines:
        print(json.dumps(res))
        return res
    headline(
        f"online training / bare target forward + drafter step, block tok/s, median of {a.rounds} alternating rounds",
        res["ratio_online_over_bare"],
        ">= 0.9",
        res["ratio_online_over_bare"] >= 0.9,
    )
    if "ratio_online_over_offline" in res:
        headline(
            "online training / offline training from stored features, block tok/s",
            res["ratio_online_over_offline"],
            "none (context: the cost of not storing features)",
        )
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
