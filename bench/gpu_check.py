"""GPU check: target-feature extraction and online training on one CUDA GPU, random-init target, < 8 minutes.

Target: a random-init Qwen3-4B-shaped model (``bench/random_targets.py``: hidden 2560, 36 layers,
vocab 151,936, ~4.0B parameters, bf16; no weights from anywhere). Prints, with the GPU's name and the
date:

1. bf16 feature extraction (``TargetFeatureExtractor``: 5 DFlash layers, stops after the last one)
   tokens/s against a bare forward of the base model (all layers, no hidden states kept) on the same
   batches; and the whole ``extract_partition`` path (batching + shard writes to local disk) tokens/s.
2. Online training (``bench/bench_online.py``: the frozen target in the loop, a 5-layer drafter at the
   target's width, block 16) block/context tokens/s, its ratio to bare target forward + drafter
   forward/backward, and the peak GPU memory.

``--tiny`` runs the same code on a tiny target (CPU allowed) as a smoke test; its figures mean nothing.

Usage: ``bench/gpu_check`` (the wrapper enforces the time limit) or ``python bench/gpu_check.py [--tiny]``.
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

import bench_online  # noqa: E402
from random_targets import num_parameters, random_target  # noqa: E402

from dflash_assets.dflash.model import default_target_layer_ids  # noqa: E402
from dflash_assets.dflash.shards import extract_partition  # noqa: E402
from dflash_assets.dflash.target_features import TargetFeatureExtractor  # noqa: E402


def timed(fn, device, repeats: int) -> float:
    fn()  # warm-up
    bench_online.sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    bench_online.sync(device)
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny target, any device: a smoke run, figures meaningless")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=8, help="sequences per extraction batch")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=10)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type != "cuda" and not a.tiny:
        print("no CUDA device: run with --tiny for a CPU smoke test (its figures are not a measurement)")
        return 2
    size = "tiny" if a.tiny else "qwen3-4b"
    if a.tiny:
        a.batch, a.seq_len, a.repeats, a.train_steps = 2, 128, 2, 2
    started = time.perf_counter()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = random_target(size, device, dtype)
    layers = default_target_layer_ids(target.config.num_hidden_layers, 5)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (a.batch, a.seq_len), generator=g).to(device)
    att = torch.ones_like(ids)
    extractor = TargetFeatureExtractor(target, layers)
    tokens = a.batch * a.seq_len
    with torch.inference_mode():
        t_bare = timed(lambda: target.model(input_ids=ids, attention_mask=att, use_cache=False), device, a.repeats)
        t_ext = timed(lambda: extractor(ids, att, dtype=torch.bfloat16), device, a.repeats)
        rows = [{"index": i, "input_ids": ids[i % a.batch].tolist(), "loss_mask": [0] * 16 + [1] * (a.seq_len - 16)}
                for i in range(2 * a.batch)]
        out = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        extract_partition(target, rows[: a.batch], out / "warm", layers, rows_per_shard=a.batch, max_tokens_per_batch=tokens)
        bench_online.sync(device)
        t0 = time.perf_counter()
        extract_partition(target, rows, out / "hs", layers, rows_per_shard=a.batch, max_tokens_per_batch=tokens)
        bench_online.sync(device)
        t_part = time.perf_counter() - t0
    result = {
        "date": datetime.date.today().isoformat(), "gpu": gpu, "target": size, "target_parameters": num_parameters(target),
        "target_layer_ids": layers, "batch": a.batch, "seq_len": a.seq_len,
        "bare_forward_tokens_per_s": round(tokens / t_bare, 1),
        "extraction_tokens_per_s": round(tokens / t_ext, 1),
        "ratio_extraction_over_bare_forward": round(t_bare / t_ext, 3),
        "extract_partition_tokens_per_s": round(len(rows) * a.seq_len / t_part, 1),
    }
    del extractor
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    train_args = ["--size", size, "--device", a.device, "--steps", str(a.train_steps), "--batch-size", "1",
                  "--seq-len", str(min(a.seq_len, 2048)), "--draft-layers", "5" if not a.tiny else "1", "--anchors", "256" if not a.tiny else "8",
                  "--skip-offline"]
    del target
    online = bench_online.main(train_args)
    result.update({f"online_{k}": v for k, v in online.items() if k.endswith("per_s") or k.startswith("ratio")})
    if device.type == "cuda":
        result["online_peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(f"{result['date']} {gpu}: {size} target ({result['target_parameters'] / 1e9:.2f}B params, {str(dtype).removeprefix('torch.')} on {device.type})")
    print(f"  bare forward {result['bare_forward_tokens_per_s']:.0f} tok/s; feature extraction {result['extraction_tokens_per_s']:.0f} tok/s "
          f"(ratio {result['ratio_extraction_over_bare_forward']:.2f}); extract_partition with shard writes "
          f"{result['extract_partition_tokens_per_s']:.0f} tok/s")
    print(f"  online training {result['online_online_block_tokens_per_s']:.0f} block tok/s, "
          f"{result['online_online_context_tokens_per_s']:.0f} context tok/s, online/bare {result['online_ratio_online_over_bare']:.3f}"
          + (f", peak memory {result['online_peak_memory_gib']} GiB" if "online_peak_memory_gib" in result else ""))
    if a.tiny:
        print("  (--tiny: a smoke run of the code path; these figures are not a measurement)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
