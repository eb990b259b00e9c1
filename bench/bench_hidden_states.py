"""Benchmark: target hidden-state extraction vs a bare batched forward of the same model.

Usage::

    python bench/bench_hidden_states.py [--model-dir DIR] [--num-seqs 24] [--min-len 16] [--max-len 160]
                                        [--max-tokens-per-batch 1024] [--threads N] [--device cpu|cuda]
                                        [--repeats 5]

Three measurements, each in its own fresh subprocess so that peak-memory numbers do not mix, on the
same seeded random sequences and the same batches (``iter_batches_by_token_budget``, right padding):

* ``forward``   -- baseline, the same work done the plain way: the base model (no LM head) with its
  layer list cut after the deepest target layer, ``output_hidden_states=True``, the target layers'
  states concatenated, cast to bf16 and moved to CPU (a bare forward of all 30 layers plus the LM head
  does more work than extraction and flattered the ratio: 1.11-1.31 instead of ~0.98);
* ``extract``   -- ``TargetFeatureExtractor`` (5 DFlash layers, stops after the deepest one), result
  cast to bf16 and moved to CPU;
* ``partition`` -- ``extract_partition`` end to end: extraction plus packing and atomic, fsynced
  shard writes to a temporary directory.

Throughput counts real (unpadded) tokens per second of wall time. The goal is
``extract tokens/s / forward tokens/s >= 0.9`` (extraction must cost no more than the forward pass), measured
back to back in ``--repeats`` rounds (5, the order alternating): the figure is the median of the rounds' ratios,
the table each method's best round. One pair per run read 0.74 and 1.00 on the same code on a shared machine: the
load drifts between two measurements a minute apart.
The partition run also reports stored bytes per token against ``len(layer_ids) x hidden x 2`` (bf16
features; input_ids, loss_mask and the index add a few bytes per token).

Peak memory. ``tracemalloc`` only sees Python-heap allocations, not torch's C++ allocator, so it is
not used. On CPU each subprocess loads the model, runs one warm-up batch, then resets the kernel's
peak-RSS counter (writing ``5`` to ``/proc/self/clear_refs`` resets ``VmHWM``) and reads ``VmHWM``
after the timed loop: ``peak_rss`` is the process's peak resident memory during the measured work
(model weights included) and ``peak_over_start`` the part above the RSS when the loop started, i.e.
the activations, outputs and buffers the method itself needs. ``getrusage(RUSAGE_SELF).ru_maxrss``
is also printed (peak over the whole process life, including model loading, which the reset cannot
clear). On CUDA, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from headline import headline

MIB = 2**20


def _rss_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process in bytes (Linux /proc/self/status)."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return values


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _sequences(args, vocab_size: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.num_seqs,), generator=g).tolist()
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def _padded(seqs, positions, device):
    import torch

    max_len = max(len(seqs[p]) for p in positions)
    input_ids = torch.zeros(len(positions), max_len, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, p in enumerate(positions):
        input_ids[b, : len(seqs[p])] = torch.tensor(seqs[p])
        attention_mask[b, : len(seqs[p])] = 1
    return input_ids.to(device), attention_mask.to(device)


def measure(args) -> dict:
    """Run one method in this process and return its numbers (called in a subprocess)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_assets.dflash.shards.extraction import extract_partition
    from dflash_assets.dflash.target.features import TargetFeatureExtractor, iter_batches_by_token_budget
    from dflash_assets.dflash.target.layers import default_target_layer_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(device).eval()
    layer_ids = args.layer_ids or default_target_layer_ids(model.config.num_hidden_layers)
    seqs = _sequences(args, model.config.vocab_size)
    batches = list(iter_batches_by_token_budget([len(s) for s in seqs], args.max_tokens_per_batch))
    extractor = TargetFeatureExtractor(model, layer_ids)

    base, deepest = model.model, max(layer_ids)
    all_layers = base.layers

    def run_forward(positions):
        input_ids, attention_mask = _padded(seqs, positions, device)
        base.layers = all_layers[: deepest + 1]  # the same layers the extractor runs; no LM head
        try:
            with torch.inference_mode():
                out = base(
                    input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
                )
                feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1).to(torch.bfloat16).cpu()
        finally:
            base.layers = all_layers
        return feats.shape

    def run_extract(positions):
        input_ids, attention_mask = _padded(seqs, positions, device)
        return extractor(input_ids, attention_mask, dtype=torch.bfloat16).cpu().shape

    rows = [{"index": i, "input_ids": s, "loss_mask": [1] * len(s)} for i, s in enumerate(seqs)]
    tmp = tempfile.TemporaryDirectory(prefix="bench_hidden_states_")

    # Warm-up on the smallest batch (thread pools, allocator, kernels), not timed.
    warm = batches[-1]
    run_forward(warm) if args.measure == "forward" else run_extract(warm)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    reset_ok = _reset_peak_rss()
    rss_start = _rss_status()["VmRSS"]

    started = time.perf_counter()
    if args.measure == "forward":
        for positions in batches:
            run_forward(positions)
    elif args.measure == "extract":
        for positions in batches:
            run_extract(positions)
    else:
        extract_partition(
            model,
            rows,
            tmp.name,
            layer_ids,
            rows_per_shard=len(rows),
            max_tokens_per_batch=args.max_tokens_per_batch,
            model_name="bench",
        )
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started

    shard_bytes = (
        sum(f.stat().st_size for f in Path(tmp.name).rglob("*") if f.is_file()) if args.measure == "partition" else None
    )
    status = _rss_status()
    result = {
        "shard_bytes": shard_bytes,
        "expected_bytes_per_token": len(layer_ids) * model.config.hidden_size * 2,
        "measure": args.measure,
        "tokens": sum(len(s) for s in seqs),
        "padded_tokens": sum(len(b) * max(len(seqs[p]) for p in b) for b in batches),
        "batches": len(batches),
        "seconds": seconds,
        "peak_rss": status["VmHWM"] if reset_ok else None,
        "peak_over_start": status["VmHWM"] - rss_start if reset_ok else None,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "layer_ids": layer_ids,
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        result["cuda_peak_allocated"] = torch.cuda.max_memory_allocated()
    result["tokens_per_s"] = result["tokens"] / seconds
    tmp.cleanup()
    return result


def _fmt_mib(value) -> str:
    return "n/a" if value is None else f"{value / MIB:9.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=None, help="HF model directory (default: the local SmolLM2-135M)")
    parser.add_argument("--num-seqs", type=int, default=24)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=160)
    parser.add_argument("--max-tokens-per-batch", type=int, default=1024)
    parser.add_argument("--layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=None)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="rounds of forward and extract back to back; the median ratio is the figure",
    )
    parser.add_argument("--measure", choices=["forward", "extract", "partition"], help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args(argv)

    if args.measure:
        print(json.dumps(measure(args)))
        return 0

    if args.model_dir is None:
        from dflash_assets.generation.engines.local_model import ensure_local_model

        args.model_dir = str(ensure_local_model())
    passthrough = [
        "--model-dir",
        args.model_dir,
        "--num-seqs",
        str(args.num_seqs),
        "--min-len",
        str(args.min_len),
        "--max-len",
        str(args.max_len),
        "--max-tokens-per-batch",
        str(args.max_tokens_per_batch),
        "--threads",
        str(args.threads),
        "--device",
        args.device,
        "--seed",
        str(args.seed),
    ]
    if args.layer_ids:
        passthrough += ["--layer-ids", ",".join(map(str, args.layer_ids))]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    best: dict[str, dict] = {}
    ratios: list[float] = []  # extract / forward per round: both measured back to back, so load drifts cancel
    for round_ in range(max(1, args.repeats)):
        order = ("forward", "extract") if round_ % 2 == 0 else ("extract", "forward")
        names = order + (("partition",) if round_ == 0 else ())
        this: dict[str, dict] = {}
        for name in names:
            proc = subprocess.run(
                [sys.executable, __file__, *passthrough, "--measure", name],
                capture_output=True,
                text=True,
                env=env,
                check=False,
            )
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return proc.returncode
            this[name] = res = json.loads(proc.stdout.strip().splitlines()[-1])
            if name not in best or res["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = res
        ratios.append(this["extract"]["tokens_per_s"] / this["forward"]["tokens_per_s"])
        print(f"round {round_ + 1} ({' then '.join(order)}): extract / forward {ratios[-1]:.3f}", flush=True)

    fwd = best["forward"]
    print(
        f"model: {args.model_dir}  device: {args.device}  threads: {fwd['threads']}  layer_ids: "
        f"{best['extract']['layer_ids']}"
    )
    print(
        f"sequences: {args.num_seqs} ({fwd['tokens']} tokens, {fwd['padded_tokens']} padded) in {fwd['batches']} "
        f"batches of <= {args.max_tokens_per_batch} padded tokens"
    )
    print(
        f"{'method':<10} {'tokens/s':>10} {'ratio':>7} {'peak RSS MiB':>13} {'over start':>11} {'ru_maxrss':>10}"
        + (f" {'cuda peak':>10}" if args.device.startswith("cuda") else "")
    )
    for name in ("forward", "extract", "partition"):
        r = best[name]
        line = (
            f"{name:<10} {r['tokens_per_s']:10.1f} {r['tokens_per_s'] / fwd['tokens_per_s']:7.3f} "
            f"{_fmt_mib(r['peak_rss']):>13} {_fmt_mib(r['peak_over_start']):>11} {_fmt_mib(r['ru_maxrss']):>10}"
        )
        if "cuda_peak_allocated" in r:
            line += f" {_fmt_mib(r['cuda_peak_allocated']):>10}"
        print(line)
    ratio = statistics.median(ratios)
    part = best["partition"]
    per_token = part["shard_bytes"] / part["tokens"]
    expected = part["expected_bytes_per_token"]
    print(
        f"stored bytes/token: {per_token:.1f} vs layers x hidden x 2 = {expected} (ratio {per_token / expected:.3f}; "
        f"goal: features alone, ~1.00 plus a few bytes of ids and mask per token)"
    )
    print(
        f"extraction / same-work plain forward throughput ratio, median of {len(ratios)} rounds (each back to back, "
        f"order alternating; range {min(ratios):.3f}-{max(ratios):.3f}): {ratio:.3f} (goal >= 0.9: "
        f"{'PASS' if ratio >= 0.9 else 'FAIL'})"
    )
    headline(
        f"extraction / same-work plain forward (same layers) tokens/s, median of {len(ratios)} back-to-back rounds",
        ratio,
        ">= 0.9",
        ratio >= 0.9,
    )
    headline(
        f"stored bytes per token / (layers x hidden x 2 = {expected})",
        per_token / expected,
        "~1.00 (features alone plus a few bytes of ids and mask)",
        None,
    )
    if args.json:
        print(json.dumps(best))
    return 0 if ratio >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
