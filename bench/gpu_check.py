"""GPU check: target-feature extraction, online training and (hybrid) lossless speculative decoding on one CUDA GPU.

Random-init targets (``bench/random_targets.py``; no weights from anywhere), bf16:

* ``dense``: a Qwen3-4B-shaped model (hidden 2560, 36 layers, vocab 151,936, ~4.0B parameters).
* ``hybrid``: Qwen3.6-27B's text decoder (hidden 5,120, FFN 17,408, 3 Gated DeltaNet layers then 1 full-attention
  layer of 24 / 4 / 256 heads, vocab 248,320) with as many layers as fit the GPU beside online training (all 64,
  ~54 GB, on an H200); which linear-attention kernels run (flash-linear-attention / causal-conv1d, or
  transformers' reference path) is printed.

Prints, with the GPU's name and the date, per shape:

1. bf16 feature extraction (``TargetFeatureExtractor``: 5 DFlash layers, stops after the last one) tokens/s
   against a bare forward of the base model (all layers, no hidden states kept) on the same batches; and the
   whole ``extract_partition`` path (batching + shard writes to local disk) tokens/s.
2. Online training (``bench/bench_online.py``: the frozen target in the loop, a 5-layer drafter, block 16; for
   the hybrid shape the published recipe's drafter, 32 heads / 8 KV heads / head_dim 128, FFN 17,408)
   block/context tokens/s, its ratio to bare target forward + drafter forward/backward, and the peak GPU memory.
3. Hybrid only: the lossless check of speculative decoding (``dflash_generate`` against ``target_generate``,
   greedy) on the same shape cut to 8 layers, in float32 so that a bf16 rounding tie cannot pass for a rollback
   error: an untrained drafter (every step rejects) and a scripted one (``bench/dflash_simulators/oracle_drafter.py``:
   partial acceptances of chosen lengths); outputs equal, and the rollbacks' extra target work.

4. ``--shape vllm-hybrid`` (apart: a whole main job): the engine parity check on the Qwen3.6 stand-in in the CUDA
   vLLM (``bench/gpu_check_vllm.py``), from ``--vllm-python``.

``--tiny`` runs the same code on tiny targets (CPU allowed) as a smoke test; its figures mean nothing.

Usage: ``bench/gpu_check`` (the wrapper enforces the time limit) or ``python bench/gpu_check.py [--tiny]
[--shape dense|hybrid|all]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_online
import gpu_check_vllm
from headline import headline
from random_targets import layers_that_fit, num_parameters, random_target

from dflash_assets.dflash.decoding.speculative import dflash_generate, target_generate
from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.model.draft_model import DFlashDraftModel
from dflash_assets.dflash.shards.extraction import extract_partition
from dflash_assets.dflash.target.features import TargetFeatureExtractor
from dflash_assets.dflash.target.kernels import linear_attention_kernels
from dflash_assets.dflash.target.layers import default_target_layer_ids
from dflash_simulators.oracle_drafter import OracleDrafter

# the published Qwen3.6-27B drafter's attention shape (TARGET.md); the dense shape's drafter follows its target
RECIPE_DRAFT = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 17408}
TARGET_SHARE = (
    0.5  # of GPU memory for the hybrid target's weights: the rest for the drafter, its optimizer, activations
)


def timed(fn, device, repeats: int) -> float:
    fn()  # warm-up
    bench_online.sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    bench_online.sync(device)
    return (time.perf_counter() - start) / repeats


def extraction(target, a, device) -> dict:
    """Bare forward vs feature extraction vs ``extract_partition`` tokens/s on random token batches."""
    layers = default_target_layer_ids(target.config.num_hidden_layers, 5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (a.batch, a.seq_len), generator=g).to(device)
    att = torch.ones_like(ids)
    extractor = TargetFeatureExtractor(target, layers)
    tokens = a.batch * a.seq_len
    with torch.inference_mode():
        t_bare = timed(lambda: target.model(input_ids=ids, attention_mask=att, use_cache=False), device, a.repeats)
        t_ext = timed(lambda: extractor(ids, att, dtype=torch.bfloat16), device, a.repeats)
        rows = [
            {"index": i, "input_ids": ids[i % a.batch].tolist(), "loss_mask": [0] * 16 + [1] * (a.seq_len - 16)}
            for i in range(2 * a.batch)
        ]
        out = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        extract_partition(
            target, rows[: a.batch], out / "warm", layers, rows_per_shard=a.batch, max_tokens_per_batch=tokens
        )
        bench_online.sync(device)
        t0 = time.perf_counter()
        extract_partition(target, rows, out / "hs", layers, rows_per_shard=a.batch, max_tokens_per_batch=tokens)
        bench_online.sync(device)
        t_part = time.perf_counter() - t0
    return {
        "target_layer_ids": layers,
        "batch": a.batch,
        "seq_len": a.seq_len,
        "bare_forward_tokens_per_s": round(tokens / t_bare, 1),
        "extraction_tokens_per_s": round(tokens / t_ext, 1),
        "ratio_extraction_over_bare_forward": round(t_bare / t_ext, 3),
        "extract_partition_tokens_per_s": round(len(rows) * a.seq_len / t_part, 1),
    }


def online(size: str, a, device, num_layers: int | None, overrides: dict, rounds: int) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    args = [
        "--size",
        size,
        "--device",
        str(device),
        "--steps",
        str(a.train_steps),
        "--batch-size",
        "1",
        "--seq-len",
        str(min(a.seq_len, 2048)),
        "--draft-layers",
        "5" if not a.tiny else "1",
        "--anchors",
        "256" if not a.tiny else "8",
        "--skip-offline",
        "--rounds",
        str(rounds),
    ]
    if num_layers is not None:
        args += ["--num-layers", str(num_layers)]
    if overrides:
        args += ["--draft-overrides", json.dumps(overrides)]
    res = bench_online.main(args, headlines=False)  # gpu_check prints them named by GPU and shape
    out = {
        f"online_{k}": v
        for k, v in res.items()
        if k.endswith("per_s") or k.startswith("ratio") or k == "draft_parameters"
    }
    if device.type == "cuda":
        out["online_peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return out


def lossless(size: str, device, tiny: bool) -> dict:
    """Greedy speculative decoding equals plain decoding on the hybrid shape cut to 8 layers, float32."""
    target = random_target(size, device, torch.float32, seed=1, num_layers=8)
    vocab = target.config.vocab_size
    dc = DFlashConfig.from_target_config(
        target.config,
        mask_token_id=vocab - 1,
        num_hidden_layers=1,
        block_size=16,
        target_layer_ids=[1, 3, 5, 7],
        **({} if tiny else RECIPE_DRAFT),
    )
    drafter = DFlashDraftModel(dc)
    drafter.reset_parameters(seed=0)
    drafter.to(device).attach_target(target.get_input_embeddings().weight, target.lm_head.weight).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in (33, 97, 250)]
    new = 48
    corrupt = [
        5,
        2,
        None,
        9,
        1,
        12,
        3,
        None,
        7,
        4,
        15,
        2,
    ]  # rejections at chosen drafts: accepted lengths 5, 2, 16, ...
    equal, steps, rollbacks, rollback_tokens, target_tokens, lengths = True, 0, 0, 0, 0, set()
    t0 = time.perf_counter()
    for p in prompts:
        plain = target_generate(target, p, new + 16).output_ids
        for d in (drafter, OracleDrafter(p + plain, dc, corrupt=corrupt).to(device)):
            spec = dflash_generate(target, d, p, new)
            equal = equal and spec.output_ids == plain[:new]
            steps += len(spec.accepted_lengths)
            rollbacks += spec.rollback_forwards
            rollback_tokens += spec.rollback_tokens
            target_tokens += spec.num_target_tokens
            lengths |= set(spec.accepted_lengths)
    return {
        "spec_lossless": equal,
        "spec_rollback": spec.rollback,
        "spec_verify_steps": steps,
        "spec_rollback_passes": rollbacks,
        "spec_rollback_tokens": rollback_tokens,
        "spec_target_tokens": target_tokens,
        "spec_accepted_lengths_seen": sorted(lengths),
        "spec_check_s": round(time.perf_counter() - t0, 1),
        "spec_target": f"{size} cut to 8 layers, float32",
    }


def check(shape: str, a, device, dtype) -> dict:
    size = (
        {"dense": "qwen3-4b", "hybrid": "qwen36-27b"}[shape]
        if not a.tiny
        else {"dense": "tiny", "hybrid": "hybrid-tiny"}[shape]
    )
    num_layers = None
    if shape == "hybrid" and device.type == "cuda":
        num_layers = layers_that_fit(size, int(TARGET_SHARE * torch.cuda.get_device_properties(device).total_memory))
    started = time.perf_counter()
    target = random_target(size, device, dtype, num_layers=num_layers)
    result = {
        "shape": shape,
        "target": size,
        "target_layers": target.config.num_hidden_layers,
        "target_parameters": num_parameters(target),
        "linear_attention_kernels": linear_attention_kernels(target)["summary"],
        "build_s": round(time.perf_counter() - started, 1),
    }
    result.update(extraction(target, a, device))
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hybrid = shape == "hybrid"
    result.update(
        online(size, a, device, num_layers, RECIPE_DRAFT if hybrid and not a.tiny else {}, 1 if hybrid else 3)
    )
    if hybrid:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result.update(lossless(size, device, a.tiny))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def report(r: dict, dtype, device) -> None:
    print(
        f"  {r['shape']}: {r['target']} target, {r['target_layers']} layers ({r['target_parameters'] / 1e9:.2f}B "
        f"params, {str(dtype).removeprefix('torch.')} on {device.type}); {r['linear_attention_kernels']}"
    )
    print(
        f"    bare forward {r['bare_forward_tokens_per_s']:.0f} tok/s; feature extraction "
        f"{r['extraction_tokens_per_s']:.0f} tok/s (ratio {r['ratio_extraction_over_bare_forward']:.2f}); "
        f"extract_partition with shard writes {r['extract_partition_tokens_per_s']:.0f} tok/s"
    )
    print(
        f"    online training {r['online_online_block_tokens_per_s']:.0f} block tok/s, "
        f"{r['online_online_context_tokens_per_s']:.0f} context tok/s, online/bare "
        f"{r['online_ratio_online_over_bare']:.3f}, drafter {r['online_draft_parameters'] / 1e9:.2f}B params"
        + (f", peak memory {r['online_peak_memory_gib']} GiB" if "online_peak_memory_gib" in r else "")
    )
    if "spec_lossless" in r:
        print(
            f"    speculative decoding ({r['spec_target']}): lossless {r['spec_lossless']}; {r['spec_verify_steps']} "
            f"verify steps over {r['spec_target_tokens']} target tokens, rollback ({r['spec_rollback']}) "
            f"{r['spec_rollback_passes']} passes over {r['spec_rollback_tokens']} tokens; accepted lengths seen "
            f"{r['spec_accepted_lengths_seen']}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny targets, any device: a smoke run, figures meaningless")
    p.add_argument(
        "--shape",
        choices=["dense", "hybrid", "all", "vllm-hybrid"],
        default="all",
        help="vllm-hybrid: the engine parity check on the Qwen3.6 stand-in in vLLM (bench/gpu_check_vllm.py)",
    )
    p.add_argument("--vllm-python", help="vllm-hybrid: an interpreter with the CUDA vLLM (no install: no network)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=8, help="sequences per extraction batch")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=10)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    if a.shape == "vllm-hybrid":  # its own step, any device (on a CPU vLLM refuses the stand-in, saying why)
        result = gpu_check_vllm.run(a.vllm_python, str(device), timeout_s=500)
        print(f"{datetime.date.today().isoformat()} {gpu}:")
        ok = gpu_check_vllm.print_result(result, gpu)
        print(json.dumps({"date": datetime.date.today().isoformat(), "gpu": gpu, "vllm_hybrid": result}))
        return 0 if ok else 1
    if device.type != "cuda" and not a.tiny:
        print("no CUDA device: run with --tiny for a CPU smoke test (its figures are not a measurement)")
        return 2
    if a.tiny:
        a.batch, a.seq_len, a.repeats, a.train_steps = 2, 128, 2, 2
    started = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = ["dense", "hybrid"] if a.shape == "all" else [a.shape]
    results = [check(s, a, device, dtype) for s in shapes]
    summary = {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        "tiny": a.tiny,
        "checks": results,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(f"{summary['date']} {gpu}:")
    for r in results:
        report(r, dtype, device)
    if a.tiny:
        print("  (--tiny: a smoke run of the code path; these figures are not a measurement)")
    else:
        for r in results:
            what = f"{gpu}, random-init {r['target']} ({r['target_layers']} layers, bf16)"
            ratio = r["ratio_extraction_over_bare_forward"]
            headline(f"{what}: feature extraction / bare forward tokens/s", ratio, ">= 0.9", ratio >= 0.9)
            ratio = r["online_ratio_online_over_bare"]
            headline(
                f"{what}: online training / bare target forward + drafter step, block tok/s "
                f"({r['online_online_block_tokens_per_s']:.0f} block tok/s)",
                ratio,
                ">= 0.9",
                ratio >= 0.9,
            )
            if "spec_lossless" in r:
                headline(
                    f"{what}: speculative decoding lossless with rollbacks ({r['spec_target']})",
                    "yes" if r["spec_lossless"] else "no",
                    "yes",
                    bool(r["spec_lossless"]),
                )
    print(json.dumps(summary))
    return 0 if all(r.get("spec_lossless", True) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
