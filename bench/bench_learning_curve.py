"""Learning curve of the embedded default's drafter: tokens per target forward on held-out code and held-out BFCL
turns against training tokens, one row per lever, beside vLLM's n-gram lookup on the same greedy continuations.

What is held out (fixed once): the 64 HumanEval prompts 100..163 (no lever trains on them: the training pool is
HumanEval 0..79) and the first 64 turns of the held-out BFCL tasks (``bfcl:multi_turn_base?split=heldout&
tools=used``, 11 tasks the corpus never takes). Their greedy continuations (64 new tokens, as the evaluation
decodes) come from vLLM's CPU build (the engine environment the pipeline makes), and the target's float32
features over them from one plain forward. Every drafter and n-gram lookup (``num_speculative_tokens`` = block
size - 1, lookup 1..4) is then scored by replaying greedy speculative decoding on those sequences (the
"replay" section below): with a lossless greedy verifier the output is the target's greedy continuation whatever
is drafted, and each step accepts the longest prefix of the drafts equal to it plus one token of the target's
own, so every step's accepted length follows by teacher forcing. The drafter's steps are
``dflash.decoding.teacher_forced.teacher_forced_chain`` on the greedy text; n-gram lookup's follow vLLM 0.32's
``NgramProposer`` rule (the rule ``dflash_assets_tests/test_ngram_baseline.py`` checks against vLLM's counters).
Both are counted in tokens per target forward (prefill counted) and compared as the main job compares them
(``stages.evaluation.baseline.paired_ratio``: the pooled ratio and its paired standard error) against the goal:
>= 1.2x n-gram on code, >= 1.0x on BFCL, above 1 by two standard errors.

Training data: the pool (HumanEval 0..79 and the first 128 turns of the training BFCL tasks, ``tools=used``) is
completed by vLLM with the demo's sampling (temperature 0.6, top-p 0.95, top-k 20; 4 samples per code prompt and
2 per BFCL turn from one request each, ``n`` sharing the prefill) and greedily, cap 256; rows cut at 128 tokens
are the cap-128 variant (what a cap of 128 would have returned). Features (bf16, the pipeline's shard format)
come from one forward per prompt whose KV cache the samples and the next turn of the same task reuse (the
longest common prefix). The distillation levers get the target's top-20 next-token distribution from its last
layers run on those features (``dflash.target.tail``, in training). A size is a number of units, one unit = 10
code prompts + 16 BFCL turns (the demo's 64 rows are ~5 code units and ~0.7 BFCL unit).

Levers (``LEVERS``; each trains ``dflash.training.train.train`` with the demo's drafter settings: 2 layers, intermediate
1024, block 4, lr 1e-3, 1100 steps, 64 anchors; then its own changes): see the table's names. CPU seconds are
the training process's (what the 13-minute budget pays; the load average is printed); training tokens are the
loss positions of the training rows.

Everything is cached under ``--work`` (default bench/results/learning_curve): prompts, generations, shards,
held-out replay set, and one result file per (lever, size), keyed by its settings; a rerun trains only what is
missing, so an interrupted grid resumes. The full grid is ~40 trainings of ~5 CPU-minutes each on 2 idle cores.

Usage: .venv/bin/python bench/bench_learning_curve.py [--work DIR] [--levers NAME ...] [--sizes 1 2 4 8]
[--threads 1] [--jobs 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from headline import headline

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
CODE_TRAIN, BFCL_TRAIN = 80, 128  # training pool: HumanEval 0..79, the first 128 training BFCL turns
CODE_HELDOUT = (100, 164)  # HumanEval prompts never trained on
BFCL_HELDOUT = 64  # first turns of the held-out BFCL tasks
UNIT = {"code": 10, "bfcl": 16}
MAX_NEW = 64  # the evaluation's max_new_tokens
GOAL = {"code": 1.2, "bfcl": 1.0}
BFCL_TRAIN_SPEC = "bfcl:multi_turn_base?tools=used"
BFCL_HELDOUT_SPEC = "bfcl:multi_turn_base?split=heldout&tools=used"
#: the demo's dflash_drafter settings (local_demo.yaml when issue 48 began)
DEMO = {
    "num_hidden_layers": 2,
    "block_size": 4,
    "lr": 1e-3,
    "max_steps": 1100,
    "max_anchors": 64,
    "max_length": 2304,
    "draft_overrides": {"intermediate_size": 1024},
}
#: name -> (data: [(variant, set)], training changes). Variants: t06s<j>_c<cap> (sample j at temperature 0.6,
#: cut at cap), g_c<cap> (greedy). A size of k units takes units 0..k-1 of every listed (variant, set).
BASE_DATA = [("t06s0_c128", "code"), ("t06s0_c128", "bfcl")]
N4_DATA = [(f"t06s{j}_c128", "code") for j in range(4)] + [(f"t06s{j}_c128", "bfcl") for j in range(2)]
LEVERS: dict[str, tuple[list, dict]] = {
    "demo (T 0.6, n 1, cap 128)": (BASE_DATA, {}),
    "n 4 samples per prompt": (N4_DATA, {}),
    "cap 256": ([("t06s0_c256", "code"), ("t06s0_c256", "bfcl")], {}),
    "greedy data (temperature 0)": ([("g_c128", "code"), ("g_c128", "bfcl")], {}),
    "init from target layers": (BASE_DATA, {"init_from_target": True}),
    "distill 0.5 (target top-20)": (BASE_DATA, {"distill_weight": 0.5}),
    "distill + loss on all positions": (BASE_DATA, {"distill_weight": 0.5, "loss_positions": "all"}),
    # the best combination of the levers alone at 8 units (n 4 and init from target layers each +0.04 on code;
    # distill within the paired SE of the demo's row)
    "n 4 + init from target layers": (N4_DATA, {"init_from_target": True}),
    # the demo's 1100 steps are 14-27 epochs of a 1-2 unit set (loss ~0.001): half of them, if the held-out ratio
    # holds, is ~3 minutes of the main job's budget
    "demo at 550 steps": (BASE_DATA, {"max_steps": 550}),
}
SIZES = (1, 2, 4, 8)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its waited-for children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


# ------------------------------------------------------------------------------------------------ data


def target_resource():
    from dflash_assets.stages.resources.target_model import TargetModelResource

    return TargetModelResource(chat_template="smollm2_tools.jinja", dtype="float32", device="cpu")


def render_prompts(work: Path) -> Path:
    """``prompts.jsonl``: every prompt of the training pool and the held-out sets, as the servers see it (the demo's
    template with tools), ``{"split", "set", "i", "task", "prompt_ids"}``."""
    path = work / "prompts.jsonl"
    if path.exists():
        return path
    from dflash_assets.common.conversation import api_messages
    from dflash_assets.data.sequence_builder import SequenceBuilder
    from dflash_assets.data.shapes import build_corpus
    from dflash_assets.stages.evaluation.datasets import prompt_file_path

    tok = target_resource().load_tokenizer()
    builder = SequenceBuilder(tok)
    plan = [
        ("train", "code", "humaneval", 0, CODE_TRAIN),
        ("train", "bfcl", BFCL_TRAIN_SPEC, 0, BFCL_TRAIN),
        ("heldout", "code", "humaneval", *CODE_HELDOUT),
        ("heldout", "bfcl", BFCL_HELDOUT_SPEC, 0, BFCL_HELDOUT),
    ]
    records = []
    for split, name, spec, lo, hi in plan:
        rows = build_corpus([prompt_file_path(spec)]).corpus.slice(lo, hi - lo)
        tools = rows["tools"].to_list() if "tools" in rows.columns else [None] * rows.height
        for k, (m, t, cid) in enumerate(zip(rows["messages"].to_list(), tools, rows["conversation_id"].to_list())):
            text = builder.prompt_text(api_messages(m), enable_thinking=True, tools=t)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            records.append({"split": split, "set": name, "i": k, "task": cid.split("#")[0], "prompt_ids": ids})
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)
    return path


VLLM_SCRIPT = r"""
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    model, src, dst, jobs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    prompts = [json.loads(line) for line in open(src)]
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_num_seqs=64, gpu_memory_utilization=0.2,
              enable_prefix_caching=True, max_model_len=4096)
    out = open(dst, "w")
    for job in jobs:
        chosen = [p for p in prompts if p["split"] == job["split"] and p["set"] == job["set"]]
        if job["temperature"] == 0:
            sp = SamplingParams(n=job["n"], temperature=0.0, max_tokens=job["max_tokens"])
        else:
            sp = SamplingParams(n=job["n"], temperature=job["temperature"], top_p=0.95, top_k=20,
                                max_tokens=job["max_tokens"])
        t0 = time.time()
        results = llm.generate([{"prompt_token_ids": p["prompt_ids"]} for p in chosen], sp)
        tokens = 0
        for p, r in zip(chosen, results):
            samples = [{"ids": list(c.token_ids), "finish": c.finish_reason} for c in r.outputs]
            tokens += sum(len(s["ids"]) for s in samples)
            out.write(json.dumps({**{k: p[k] for k in ("split", "set", "i")}, "variant": job["variant"],
                                  "samples": samples}) + "\n")
        print(f"GEN {job['variant']} {job['split']}/{job['set']}: {tokens} tokens in {time.time() - t0:.0f} s",
              flush=True)
    out.close()
if __name__ == "__main__":
    main()
"""

GEN_JOBS = [
    {"split": "heldout", "set": "code", "variant": "greedy64", "n": 1, "temperature": 0, "max_tokens": MAX_NEW},
    {"split": "heldout", "set": "bfcl", "variant": "greedy64", "n": 1, "temperature": 0, "max_tokens": MAX_NEW},
    {"split": "train", "set": "code", "variant": "t06", "n": 4, "temperature": 0.6, "max_tokens": 256},
    {"split": "train", "set": "bfcl", "variant": "t06", "n": 2, "temperature": 0.6, "max_tokens": 256},
    {"split": "train", "set": "code", "variant": "g", "n": 1, "temperature": 0, "max_tokens": 256},
    {"split": "train", "set": "bfcl", "variant": "g", "n": 1, "temperature": 0, "max_tokens": 256},
]


def generate(work: Path, prompts: Path) -> Path:
    """``generations.jsonl``: every job of :data:`GEN_JOBS` from vLLM's offline API in the engine environment."""
    path = work / "generations.jsonl"
    if path.exists():
        return path
    from dflash_assets.generation.engines.environments import vllm_environment, vllm_packages_for

    python = vllm_environment(*vllm_packages_for("cpu")).ensure()
    model = target_resource().resolved_path()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "gen.py"
        script.write_text(VLLM_SCRIPT)
        partial = work / "generations.partial.jsonl"
        started = time.monotonic()
        subprocess.run(
            [str(python), str(script), str(model), str(prompts), str(partial), json.dumps(GEN_JOBS)],
            check=True,
            cwd=tmp,
        )
        print(f"vLLM generation: {time.monotonic() - started:.0f} s wall", flush=True)
        os.replace(partial, path)
    return path


def _records(prompts: Path, generations: Path, split: str) -> list[tuple[dict, list[dict]]]:
    """``(prompt record, [sample with "variant"])`` per prompt of ``split``, prompts in file order."""
    with open(prompts) as f:
        by_key = {(p["set"], p["i"]): (p, []) for p in map(json.loads, f) if p["split"] == split}
    with open(generations) as f:
        generated = [json.loads(line) for line in f]
    for g in generated:
        if g["split"] != split:
            continue
        n = len(g["samples"])
        for j, s in enumerate(g["samples"]):
            variant = g["variant"] if n == 1 else f"{g['variant']}s{j}"
            by_key[(g["set"], g["i"])][1].append({**s, "variant": variant})
    return [v for v in by_key.values() if v[1]]


def build_shards(work: Path, prompts: Path, generations: Path) -> Path:
    """Training shards ``shards/<variant>_c<cap>/<set>_<unit>.safetensors`` (the pipeline's format, bf16 features)."""
    done = work / "shards" / "done"
    if done.exists():
        return done.parent
    import torch

    from dflash_assets.dflash.shards.format import write_shard
    from dflash_assets.dflash.target.layers import resolve_target_layer_ids

    tm = target_resource()
    model = tm.load_model()
    layer_ids = resolve_target_layer_ids(tm.resolved_path(), None, 5)
    started = time.monotonic()
    rows, tokens = training_rows(model, layer_ids, _records(prompts, generations, "train"))
    print(f"features: {tokens} tokens forwarded in {time.monotonic() - started:.0f} s", flush=True)
    for (variant, name, unit), rr in rows.items():
        lengths = [len(r[1]) for r in rr]
        write_shard(
            work / "shards" / variant / f"{name}_{unit:03d}.safetensors",
            torch.cat([r[3] for r in rr]),
            torch.cat([r[1] for r in rr]),
            torch.cat([r[2] for r in rr]),
            torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
            torch.tensor([r[0] for r in rr]),
            target_layer_ids=layer_ids,
            hidden_size=model.config.hidden_size,
            model_name=tm.model_name(),
        )
    done.write_text("ok")
    return done.parent


def training_rows(model, layer_ids: list[int], records) -> tuple[dict[tuple, list], int]:
    """``({(variant_c<cap>, set, unit): [(index, ids, loss mask, bf16 features)]}, tokens forwarded)``: one forward
    per prompt whose KV cache its samples and the next turn of the same task reuse (the longest common prefix)."""
    import torch
    from transformers import DynamicCache

    from dflash_assets.dflash.decoding.speculative import FeatureCapture

    eos = int(model.config.eos_token_id)
    rows: dict[tuple, list] = {}
    cache, held, tokens = DynamicCache(), [], 0
    held_feats = torch.zeros(0, len(layer_ids) * model.config.hidden_size, dtype=torch.bfloat16)
    with FeatureCapture(model, layer_ids) as cap, torch.no_grad():
        for p, samples in records:
            ids = p["prompt_ids"]
            lcp = 0  # the longest common prefix with what the cache holds: a task's turns extend each other
            while lcp < min(len(ids) - 1, len(held)) and held[lcp] == ids[lcp]:
                lcp += 1
            if cache.get_seq_length() > lcp:
                cache.crop(lcp - cache.get_seq_length())
            model(input_ids=torch.tensor([ids[lcp:]]), past_key_values=cache, use_cache=True)
            held_feats = torch.cat([held_feats[:lcp], cap.pop()[0].to(torch.bfloat16)])
            held = list(ids)
            tokens += len(ids) - lcp
            for s in samples:
                gen = list(s["ids"])
                if s["finish"] == "stop" and (not gen or gen[-1] != eos):
                    gen.append(eos)
                if cache.get_seq_length() > len(ids):
                    cache.crop(len(ids) - cache.get_seq_length())
                model(input_ids=torch.tensor([gen]), past_key_values=cache, use_cache=True)
                feats = torch.cat([held_feats, cap.pop()[0].to(torch.bfloat16)])
                tokens += len(gen)
                full = torch.tensor(ids + gen)
                for cap_len in (128, 256):
                    n = len(ids) + min(len(gen), cap_len)
                    mask = torch.zeros(n, dtype=torch.int8)
                    mask[len(ids) :] = 1
                    key = (f"{s['variant']}_c{cap_len}", p["set"], p["i"] // UNIT[p["set"]])
                    index = p["i"] if p["set"] == "code" else 10000 + p["i"]
                    rows.setdefault(key, []).append((index, full[:n], mask, feats[:n]))
    return rows, tokens


def build_heldout(work: Path, prompts: Path, generations: Path) -> Path:
    """``heldout.safetensors``: per held-out prompt its ids (prompt + vLLM's greedy continuation, int32) and the
    target's float32 features over them from one plain forward, and ``heldout.json`` (set, index, task, prompt
    length per prompt)."""
    path = work / "heldout.safetensors"
    if path.exists():
        return path
    import torch
    from safetensors.torch import save_file

    from dflash_assets.dflash.target.features import TargetFeatureExtractor
    from dflash_assets.dflash.target.layers import resolve_target_layer_ids

    tm = target_resource()
    model = tm.load_model()
    extractor = TargetFeatureExtractor(model, resolve_target_layer_ids(tm.resolved_path(), None, 5))
    tensors, meta = {}, []
    with torch.no_grad():
        for p, samples in _records(prompts, generations, "heldout"):
            ids = torch.tensor([*p["prompt_ids"], *samples[0]["ids"]], dtype=torch.long)
            k = len(meta)
            tensors[f"ids{k}"] = ids.to(torch.int32)
            tensors[f"f{k}"] = extractor(ids[None], dtype=torch.float32)[0].contiguous()
            meta.append({"set": p["set"], "i": p["i"], "task": p["task"], "prompt_len": len(p["prompt_ids"])})
    save_file(tensors, str(path))
    (work / "heldout.json").write_text(json.dumps(meta))
    return path


class HeldOutRows:
    """Held-out rows as ``teacher_forced_chain`` reads a dataset (``len`` and ``[i]``); not a list, which that
    function reads as shard paths."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]

    def __iter__(self):
        return iter(self.rows)


def load_heldout(work: Path) -> dict[str, HeldOutRows]:
    """Per set, the held-out rows as ``teacher_forced_chain`` reads them: ``input_ids`` int64 [T], ``loss_mask``
    int8 [T] (1 on the continuation), ``hidden_states`` float32 [T, n*H], and ``prompt_len``."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(work / "heldout.safetensors"))
    sets: dict[str, HeldOutRows] = {}
    for k, m in enumerate(json.loads((work / "heldout.json").read_text())):
        ids = tensors[f"ids{k}"].long()
        mask = torch.zeros(ids.shape[0], dtype=torch.int8)
        mask[m["prompt_len"] :] = 1
        row = {"input_ids": ids, "loss_mask": mask, "hidden_states": tensors[f"f{k}"], "prompt_len": m["prompt_len"]}
        sets.setdefault(m["set"], HeldOutRows()).rows.append(row)
    return sets


# ------------------------------------------------------------------------------------------------ replay


def compare_with_ngram(drafter, rows: HeldOutRows) -> dict:
    """The drafter against n-gram lookup with as many draft tokens (``block_size - 1``, lookup 1..4) on the
    held-out ``rows`` (:func:`load_heldout`): ``stages.evaluation.baseline.paired_ratio`` of their tokens per target
    forward (the main job's statistic), ``a`` the drafter's. A drafter prompt of ``L`` accepted lengths per step
    (``teacher_forced_chain``) makes ``1 + sum(L)`` tokens in ``1 + len(L)`` forwards; n-gram lookup's steps are
    ``dflash.decoding.ngram.ngram_steps`` (vLLM's ``NgramProposer`` rule)."""
    from dflash_assets.dflash.decoding.ngram import ngram_steps
    from dflash_assets.dflash.decoding.teacher_forced import teacher_forced_chain
    from dflash_assets.stages.evaluation.baseline import paired_ratio

    k = int(drafter.config.block_size) - 1
    lengths = teacher_forced_chain(drafter, rows)["accepted_lengths"]
    pairs = []
    for r, accepted in zip(rows, lengths):
        prompt, output = r["input_ids"][: r["prompt_len"]].tolist(), r["input_ids"][r["prompt_len"] :].tolist()
        if output:
            steps = ngram_steps(prompt, output, 1, 4, k)
            pairs.append((len(output), 1 + len(accepted), len(output), 1 + len(steps)))
    return paired_ratio(pairs)


# ------------------------------------------------------------------------------------------------ runs


def run_key(data: list, size: int, changes: dict) -> str:
    spec = json.dumps([data, size, {**DEMO, **changes}], sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def train_one(work: Path, name: str, size: int, threads: int) -> dict:
    """Train (in a child process, ``threads`` torch threads) and replay-evaluate one (lever, size); cached."""
    data, changes = LEVERS[name]
    key = run_key(data, size, changes)
    out = work / "runs" / f"{key}.json"
    if out.exists():
        return json.loads(out.read_text())
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(
        [sys.executable, __file__, "--work", str(work), "--child", json.dumps([name, size])],
        check=True,
        env=env,
    )
    return json.loads(out.read_text())


def child(work: Path, name: str, size: int) -> None:
    """One training run in this process: write ``runs/<key>.json``."""
    import torch

    from dflash_assets.dflash.model.draft_model import count_parameters
    from dflash_assets.dflash.training.config import TrainConfig
    from dflash_assets.dflash.training.train import train

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    data, changes = LEVERS[name]
    key = run_key(data, size, changes)
    shards = [str(work / "shards" / v / f"{s}_{u:03d}.safetensors") for v, s in data for u in range(size)]
    cfg = TrainConfig(
        **{**DEMO, **changes},
        shards=shards,
        out_dir=str(work / "runs" / key),
        target_model_path=str(target_resource().resolved_path()),
        eval_fraction=0.0,
        checkpoint_every=0,
        resume=False,
        device="cpu",
    )
    started, cpu0 = time.monotonic(), cpu_seconds()
    result = train(cfg)
    wall, cpu = time.monotonic() - started, cpu_seconds() - cpu0
    drafter = result.model.eval()
    with torch.no_grad():  # as served: the export is bf16
        for p in drafter.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    sets = load_heldout(work)
    figures = {}
    for s in GOAL:
        figures[s] = compare_with_ngram(drafter, sets[s])
    loss_tokens = 0
    from safetensors import safe_open

    for path in shards:
        with safe_open(path, framework="pt") as f:
            loss_tokens += int(f.get_tensor("loss_mask").sum())
    record = {
        "lever": name,
        "size": size,
        "changes": changes,
        "loss_tokens": loss_tokens,
        "train_tokens": result.summary["train_tokens"],
        "train_rows": result.summary["train_rows"],
        "cpu_s": cpu,
        "wall_s": wall,
        "load": os.getloadavg()[0],
        "parameters": count_parameters(drafter),
        "figures": figures,
    }
    out = work / "runs" / f"{key}.json"
    out.write_text(json.dumps(record, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=HERE / "results" / "learning_curve")
    parser.add_argument("--levers", nargs="+", choices=list(LEVERS), default=list(LEVERS))
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    parser.add_argument("--threads", type=int, default=1, help="torch threads per training")
    parser.add_argument("--jobs", type=int, default=2, help="trainings at once")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.child:
        name, size = json.loads(args.child)
        child(args.work, name, size)
        return 0
    print(f"load average {os.getloadavg()[0]:.2f} at the start; work dir {args.work}", flush=True)
    prompts = render_prompts(args.work)
    generations = generate(args.work, prompts)
    build_shards(args.work, prompts, generations)
    build_heldout(args.work, prompts, generations)
    grid = [(n, s) for n in args.levers for s in args.sizes]
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = dict(zip(grid, pool.map(lambda g: train_one(args.work, *g, args.threads), grid)))
    report(results, args)
    return 0


def met(f: dict, goal: float) -> bool:
    """The main job's rule (bench_main_job): ratio at least ``goal`` and above 1 by two paired standard errors."""
    return f["ratio"] is not None and f["ratio"] >= goal and f["ratio"] - 2 * f["ratio_stderr"] > 1


def tokens_to_goal(points: list[tuple[int, float]], goal: float) -> tuple[float, float] | None:
    """Least-squares fit ``ratio = a + b log2(loss tokens)`` over ``points`` ``[(loss tokens, ratio)]``; returns
    (the gain per doubling ``b``, loss tokens where the fit reaches ``goal``), or None for fewer than 3 points or
    no gain. An extrapolation of this bench's curve (the lever's steps at every size), not a measurement."""
    if len(points) < 3:
        return None
    import numpy as np

    b, a = np.polyfit(np.log2([t for t, _ in points]), [r for _, r in points], 1)
    if b <= 0:
        return None
    return float(b), float(2 ** ((goal - a) / b))


def report(results: dict, args) -> None:
    for s in GOAL:
        print(
            f"\n{s}: tokens per target forward (replay, pooled), drafter vs n-gram lookup, same block; ratio with "
            f"its paired SE; goal >= {GOAL[s]} and > 1 by 2 SE"
        )
        print(
            f"{'lever':<34} {'size':>4} {'loss tok':>8} {'drafter':>7} {'n-gram':>7} {'ratio':>6} "
            f"{'SE':>6} {'CPU s':>6} {'load':>5}"
        )
        for (name, size), r in results.items():
            f = r["figures"][s]
            print(
                f"{name:<34} {size:>4} {r['loss_tokens']:>8} {f['a']:>7.3f} {f['b']:>7.3f} {f['ratio']:>6.3f} "
                f"{f['ratio_stderr']:>6.3f} {r['cpu_s']:>6.0f} {r['load']:>5.1f}"
            )
    # one row per lever and held-out set: its largest size, the curve over every size in the figure's text
    for lever in dict.fromkeys(name for name, _ in results):
        sizes = sorted(size for name, size in results if name == lever)
        r = results[(lever, sizes[-1])]
        for s in GOAL:
            f = r["figures"][s]
            curve = ", ".join(f"{size}: {results[(lever, size)]['figures'][s]['ratio']:.3f}" for size in sizes)
            fit = tokens_to_goal(
                [(results[(lever, n)]["loss_tokens"], results[(lever, n)]["figures"][s]["ratio"]) for n in sizes],
                GOAL[s],
            )
            reach = (
                f"; log-linear fit over the sizes (same steps each): +{fit[0]:.3f} per doubling of the data, "
                f"{GOAL[s]} at ~{fit[1]:.2g} loss tokens ({fit[1] / r['loss_tokens']:.2g}x these; extrapolated)"
                if fit
                else "; no gain with data to extrapolate"
                if len(sizes) >= 3
                else ""
            )
            headline(
                f"learning curve: {lever}, held-out {s} ({f['prompts']} prompts), drafter / n-gram lookup tokens per "
                f"target forward at {sizes[-1]} units ({r['loss_tokens']} loss tokens, {r['cpu_s']:.0f} training CPU "
                f"s; {f['a']:.3f} vs {f['b']:.3f}, replayed, paired SE {f['ratio_stderr']:.3f}); by units {curve}"
                + reach,
                round(f["ratio"], 3),
                f">= {GOAL[s]} and > 1 by two paired standard errors",
                met(f, GOAL[s]),
            )
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    raise SystemExit(main())
