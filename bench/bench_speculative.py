"""DFlash speculative decoding on the local target: tau, target forwards saved, wall-time speedup.

Compares plain greedy decoding with greedy speculative decoding for (a) an untrained drafter and
(b) a drafter trained in this script on the target's own greedy completions of the prompts (hidden
states extracted and trained by ``dflash_simulators.overfit_drafter``), or (b') an exported drafter
directory given with ``--drafter``. Lossless is checked for every prompt. Evaluated on the training
prompts (the drafter was fit to them: this measures the machinery and the ceiling) and, if given, on
held-out prompts.

Timing is warm and interleaved (plain and speculative decoding alternate on the same prompts, see
``evaluate_drafters``). ``context_cache`` times the trained and untrained drafters twice: re-projecting the
whole context every step (before the drafter's context cache) and with the cache (projecting only newly
accepted positions), as speculative / plain wall time; an untrained drafter accepts almost nothing and
does strictly more work than plain decoding, so its speedup must stay below 1.0.

Hybrid targets (``--target hybrid-tiny|hybrid-cpu|qwen36-27b``, a random-init Qwen3.5/3.6-shaped decoder from
``bench/random_targets.py``, random prompts, a drafter trained here on the target's greedy completions):
after a partial acceptance the linear-attention state is rolled back (``dflash.target.hybrid_cache``), which costs
target work plain models do not pay; printed beside the plain figures: verify forwards and the tokens they
fed, rollback passes (linear-attention mixers only) and the tokens they re-ran, and the share of the
target's weights a rollback pass reads.

Usage: ``python bench/bench_speculative.py [--target smollm2|hybrid-cpu|...] [--steps 60] [--block-size 4]
[--layers 1] [--max-new-tokens 48] [--drafter EXPORT_DIR] [--png hist.png] [--device cpu|cuda]``; prints one
JSON object, then the
wall-time speedup measured side by side: for each prompt, plain and speculative decoding run back to
back (the order alternating by prompt), so both see the same machine load (the figures inside the
evaluations reuse plain timings made minutes earlier and are left out of the headline). Goal: lossless,
tau above the untrained drafter's, and a wall-time speedup > 1.0 on a GPU (on this CPU the small target
verifies a block too slowly for tau to pay: informative only).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from headline import headline

from dflash_assets.dflash.decoding.evaluation import (
    acceptance_histogram_png,
    evaluate_drafter,
    evaluate_drafters,
    untrained_drafter_like,
)
from dflash_assets.dflash.decoding.speculative import dflash_generate, target_generate
from dflash_assets.dflash.decoding.teacher_forced import teacher_forced_acceptance
from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.model.draft_model import load_target_head
from dflash_assets.dflash.shards.extraction import extract_partition
from dflash_assets.dflash.target.layers import default_target_layer_ids
from dflash_simulators.overfit_drafter import greedy_rows, overfit

TRAIN_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many days are in a week?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in two sentences.",
    "List the planets of the solar system.",
]
HELDOUT_QUESTIONS = ["What is the capital of Italy?", "Name three fruits."]


def _summary(ev: dict) -> dict:
    keys = (
        "tau",
        "tau_stderr",
        "tau_pooled",
        "tau_pooled_stderr",
        "per_prompt_tau",
        "histogram",
        "acceptance_per_position",
        "new_tokens",
        "target_forwards_plain",
        "target_forwards_spec",
        "target_forwards_saved",
        "forward_reduction",
        "target_tokens_plain",
        "target_tokens_spec",
        "rollback",
        "rollback_forwards",
        "rollback_tokens",
        "wall_s_plain",
        "wall_s_spec",
        "speedup",
        "lossless",
    )
    return {k: ev[k] for k in keys}


def drafter_step_ms(drafter, context_len: int, steps: int = 30) -> dict:
    """ms per drafter step at ``context_len`` context tokens: re-projecting the whole context vs the context cache
    (the cache extended by one position per step, as after a step that accepted one token)."""
    feats = torch.randn(1, context_len + steps, drafter.config.num_context_features * drafter.config.hidden_size)
    block = torch.full((1, drafter.config.block_size), drafter.config.mask_token_id)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for s in range(steps):
            drafter(
                block,
                target_hidden=feats[:, : context_len + s],
                position_ids=torch.arange(context_len + s + block.shape[1])[None],
            )
        t1 = time.perf_counter()
        cache = drafter.extend_context(drafter.new_context_cache(), feats[:, :context_len])
        t2 = time.perf_counter()
        for s in range(steps):
            drafter.forward_block(block, cache)
            drafter.extend_context(cache, feats[:, context_len + s : context_len + s + 1])
        t3 = time.perf_counter()
    return {"reproject_ms": (t1 - t0) * 1e3 / steps, "cached_ms": (t3 - t2) * 1e3 / steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--target", default="smollm2", help="smollm2 (the local model) or a hybrid size of bench/random_targets.py"
    )
    ap.add_argument("--drafter", help="exported drafter dir (skip training)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--png", help="write the acceptance histogram (trained vs untrained) here")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.target != "smollm2":
        return hybrid_main(a)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_assets.generation.engines.local_model import ensure_local_model

    t_start = time.perf_counter()
    device = torch.device(a.device)
    model_dir = ensure_local_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    end_id = tok.convert_tokens_to_ids("<|im_end|>")

    def encode(q: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]

    train_prompts = [encode(q) for q in TRAIN_QUESTIONS]
    heldout_prompts = [encode(q) for q in HELDOUT_QUESTIONS]
    embed, head = load_target_head(str(model_dir))
    target_generate(target, train_prompts[0], 2)  # warm-up
    plain = [target_generate(target, p, a.max_new_tokens, [end_id]) for p in train_prompts]
    report: dict = {"max_new_tokens": a.max_new_tokens, "device": str(device), "threads": torch.get_num_threads()}

    tmp = Path(tempfile.mkdtemp(prefix="bench_spec_"))
    rows = greedy_rows(train_prompts, plain)  # the target's own greedy completions
    if a.drafter:
        from dflash_assets.dflash.export.directory import load_exported

        drafter = load_exported(a.drafter, embed_weight=embed, lm_head_weight=head).to(device).eval()
        layer_ids = drafter.config.target_layer_ids
        report["drafter"] = a.drafter
        # the rows' shards: the teacher-forced proxy's input
        extract_partition(target, rows, tmp / "shards", layer_ids, rows_per_shard=64)
        shards = sorted(str(p) for p in (tmp / "shards").glob("*.safetensors"))
    else:
        config = json.loads((model_dir / "config.json").read_text())
        layer_ids = default_target_layer_ids(config["num_hidden_layers"])
        dc = DFlashConfig.from_target_config(
            config, mask_token_id=16, num_hidden_layers=a.layers, block_size=a.block_size, target_layer_ids=layer_ids
        )
        t0 = time.perf_counter()  # the shards: the training data and the teacher-forced proxy's input
        result, shards = overfit(target, rows, layer_ids, tmp, dc, (embed, head), steps=a.steps, **_recipe(a))
        drafter = result.model.eval()
        report["train"] = {
            "steps": result.step,
            "final_loss": result.summary["final_loss"],
            "seconds": time.perf_counter() - t0,  # feature extraction and training
            "rows": len(rows),
            "tokens": sum(len(r["input_ids"]) for r in rows),
        }

    fresh = untrained_drafter_like(drafter, seed=a.seed)
    kw = dict(eos_token_ids=[end_id])  # plain decoding interleaved with speculative (not the earlier plain runs)
    ev_trained = evaluate_drafter(target, drafter, train_prompts, a.max_new_tokens, **kw)
    ev_untrained = evaluate_drafter(target, fresh, train_prompts, a.max_new_tokens, **kw)
    report["train_prompts"] = {"trained": _summary(ev_trained), "untrained": _summary(ev_untrained)}
    report["teacher_forced"] = {
        "trained": {k: v for k, v in teacher_forced_acceptance(drafter, shards).items() if k != "histogram"},
        "untrained": {k: v for k, v in teacher_forced_acceptance(fresh, shards).items() if k != "histogram"},
    }
    timing = {}
    for label, cached in (("before (re-project the context every step)", False), ("after (context cache)", True)):
        evs = evaluate_drafters(
            target,
            {"trained": drafter, "untrained": fresh},
            train_prompts,
            a.max_new_tokens,
            eos_token_ids=[end_id],
            use_context_cache=cached,
        )
        timing[label] = {
            name: {
                "tau": ev["tau"],
                "wall_s_spec": ev["wall_s_spec"],
                "wall_s_plain": ev["wall_s_plain"],
                "spec_over_plain": ev["wall_s_spec"] / ev["wall_s_plain"],
                "speedup": ev["speedup"],
                "lossless": ev["lossless"],
            }
            for name, ev in evs.items()
        }
        print(
            f"{label}: "
            + "; ".join(
                f"{n} drafter spec/plain wall {t['spec_over_plain']:.3f} (speedup {t['speedup']:.3f}, "
                f"tau {t['tau']:.2f})"
                for n, t in timing[label].items()
            ),
            file=sys.stderr,
        )
    timing["drafter_step_ms"] = {str(c): drafter_step_ms(drafter, c) for c in (100, 1000)}
    report["context_cache"] = timing
    ev_held = evaluate_drafter(target, drafter, heldout_prompts, a.max_new_tokens, eos_token_ids=[end_id])
    report["heldout_prompts"] = {"trained": _summary(ev_held)}
    if a.png:
        Path(a.png).write_bytes(
            acceptance_histogram_png(
                {
                    "trained": [v for s in ev_trained["accepted_lengths"] for v in s],
                    "untrained": [v for s in ev_untrained["accepted_lengths"] for v in s],
                },
                drafter.config.block_size,
                title="DFlash on SmolLM2-135M (training prompts)",
            )
        )
        report["png"] = a.png
    report["side_by_side"] = side_by_side(target, drafter, train_prompts + heldout_prompts, a.max_new_tokens, end_id)
    report["total_s"] = time.perf_counter() - t_start
    print(json.dumps(report, indent=1))
    sbs = report["side_by_side"]
    print(
        f"speculative / plain wall-time speedup ratio (side by side, {sbs['prompts']} prompts): {sbs['speedup']:.3f} "
        f"(plain {sbs['wall_s_plain']:.1f} s, speculative {sbs['wall_s_spec']:.1f} s; lossless: {sbs['lossless']}); "
        f"goal: > 1.0 on a GPU, lossless always"
    )
    print(
        f"tau trained {report['train_prompts']['trained']['tau']:.3f} vs untrained "
        f"{report['train_prompts']['untrained']['tau']:.3f} (goal: trained > untrained)"
    )
    headline(
        f"CPU, SmolLM2-135M target: speculative / plain decoding wall-time speedup, side by side on "
        f"{sbs['prompts']} prompts",
        sbs["speedup"],
        "> 1.0 on a GPU (no goal on a CPU)",
        None,
    )
    headline(
        "greedy speculative output equals plain decoding token for token",
        "yes" if sbs["lossless"] else "no",
        "yes",
        bool(sbs["lossless"]),
    )
    tau_t, tau_u = report["train_prompts"]["trained"]["tau"], report["train_prompts"]["untrained"]["tau"]
    headline(
        f"tau of the trained drafter on its training prompts (untrained {tau_u:.2f})",
        tau_t,
        "> the untrained drafter's",
        tau_t > tau_u,
    )
    for name in ("trained", "untrained"):
        print(work_line(name, report["train_prompts"][name]))
    return 0


def _recipe(a) -> dict:
    """The bench's settings of the overfit recipe (:func:`dflash_simulators.overfit_drafter.overfit_config`)."""
    return {"max_anchors": 128, "seed": a.seed, "log_every": 10, "device": a.device}


def work_line(name: str, ev: dict, mixer_share: float | None = None) -> str:
    """Target work of one evaluation: plain vs speculative forwards and tokens, and what the rollbacks added."""
    share = f" (each reads {mixer_share:.1%} of the target's weights)" if mixer_share is not None else ""
    return (
        f"{name}: tau {ev['tau']:.3f}, lossless {ev['lossless']}; target work: plain {ev['target_forwards_plain']} "
        f"forwards over {ev['target_tokens_plain']} tokens, speculative {ev['target_forwards_spec']} verify forwards "
        f"over {ev['target_tokens_spec']} tokens + rollback ({ev['rollback']}) {ev['rollback_forwards']} passes over "
        f"{ev['rollback_tokens']} tokens{share}"
    )


def mixer_weight_share(target) -> float:
    """Share of the target's parameters in its linear-attention token mixers (what a ``mixers`` rollback reads)."""
    total = sum(p.numel() for p in target.parameters())
    mixers = sum(p.numel() for m in target.modules() if hasattr(m, "linear_attn") for p in m.linear_attn.parameters())
    return mixers / total if total else 0.0


def scripted_run(target, dc, prompts, plain, max_new_tokens: int, seed: int) -> dict:
    """A drafter that knows the greedy continuation and errs at a random draft of each block
    (``dflash_simulators.oracle_drafter``): acceptances of every length, so rollbacks over several tokens."""
    from dflash_simulators.oracle_drafter import OracleDrafter

    rng = torch.Generator().manual_seed(seed)
    runs = []
    for p, r in zip(prompts, plain):
        corrupt = [
            int(k) if k < dc.block_size else None
            for k in torch.randint(1, dc.block_size + 1, (max_new_tokens,), generator=rng)
        ]
        runs.append(
            dflash_generate(
                target, OracleDrafter(p + r.output_ids + [0] * dc.block_size, dc, corrupt), p, max_new_tokens
            )
        )
    return {
        "tau": sum(map(sum, (x.accepted_lengths for x in runs))) / sum(len(x.accepted_lengths) for x in runs),
        "lossless": all(x.output_ids == r.output_ids for x, r in zip(runs, plain)),
        "target_forwards_plain": sum(r.num_target_forwards for r in plain),
        "target_tokens_plain": sum(r.num_target_tokens for r in plain),
        "target_forwards_spec": sum(x.num_target_forwards for x in runs),
        "target_tokens_spec": sum(x.num_target_tokens for x in runs),
        "rollback": runs[0].rollback,
        "rollback_forwards": sum(x.rollback_forwards for x in runs),
        "rollback_tokens": sum(x.rollback_tokens for x in runs),
    }


def hybrid_main(a) -> int:
    """The bench on a random-init hybrid target: lossless, tau, and the rollbacks' extra target work."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from random_targets import HYBRID_SIZES, num_parameters, random_target

    if a.target not in HYBRID_SIZES:
        raise SystemExit(f"--target {a.target!r}: use smollm2 or one of {sorted(HYBRID_SIZES)}")
    t_start = time.perf_counter()
    device = torch.device(a.device)
    target = random_target(a.target, device, torch.float32, seed=a.seed)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(a.seed + 1)
    prompts = [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in (12, 20, 28, 36, 44, 52)]
    plain = [target_generate(target, p, a.max_new_tokens) for p in prompts]
    layer_ids = default_target_layer_ids(target.config.num_hidden_layers)
    rows = greedy_rows(prompts, plain)
    dc = DFlashConfig.from_target_config(
        target.config,
        mask_token_id=vocab - 1,
        num_hidden_layers=a.layers,
        block_size=a.block_size,
        target_layer_ids=layer_ids,
    )
    head = (target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach())
    tmp = Path(tempfile.mkdtemp(prefix="bench_spec_hybrid_"))
    drafter = overfit(target, rows, layer_ids, tmp, dc, head, steps=a.steps, **_recipe(a))[0].model.eval()
    # held-out prompts: the trained drafter is right only part of the way, so partial acceptances (rollbacks) happen
    heldout = [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in (16, 24, 32, 40)]
    drafters = {"trained": drafter, "untrained": untrained_drafter_like(drafter, seed=a.seed)}
    evs = {
        f"{name} ({which} prompts)": ev
        for which, ps in (("training", prompts), ("held-out", heldout))
        for name, ev in evaluate_drafters(target, drafters, ps, a.max_new_tokens).items()
    }
    evs["scripted (training prompts)"] = scripted_run(target, dc, prompts, plain, a.max_new_tokens, a.seed)
    share = mixer_weight_share(target)
    report = {
        "target": a.target,
        "target_parameters": num_parameters(target),
        "max_new_tokens": a.max_new_tokens,
        "block_size": a.block_size,
        "prompts": {"training": len(prompts), "held-out": len(heldout)},
        "mixer_weight_share": share,
        **{name: _summary(ev) if "scripted" not in name else ev for name, ev in evs.items()},
        "total_s": time.perf_counter() - t_start,
    }
    print(json.dumps(report, indent=1))
    for name, ev in evs.items():
        print(work_line(name, ev, share))
    return 0 if all(ev["lossless"] for ev in evs.values()) else 1


def side_by_side(target, drafter, prompts, max_new_tokens: int, end_id: int) -> dict:
    """Plain and speculative decoding of each prompt back to back (order alternating by prompt); summed
    wall seconds of each and their ratio, and whether every speculative output equals the plain one."""
    cfg = drafter.config
    kw = dict(
        target_layer_ids=cfg.target_layer_ids,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        eos_token_ids=[end_id],
    )
    wall_plain = wall_spec = 0.0
    lossless = True
    for i, p in enumerate(prompts):
        runs = {}
        for kind in ("plain", "spec") if i % 2 == 0 else ("spec", "plain"):
            t0 = time.perf_counter()
            runs[kind] = (
                target_generate(target, p, max_new_tokens, [end_id])
                if kind == "plain"
                else dflash_generate(target, drafter, p, max_new_tokens, **kw)
            )
            elapsed = time.perf_counter() - t0
            if kind == "plain":
                wall_plain += elapsed
            else:
                wall_spec += elapsed
        lossless = lossless and runs["plain"].output_ids == runs["spec"].output_ids
    return {
        "prompts": len(prompts),
        "wall_s_plain": wall_plain,
        "wall_s_spec": wall_spec,
        "speedup": wall_plain / wall_spec if wall_spec else float("nan"),
        "lossless": lossless,
    }


if __name__ == "__main__":
    raise SystemExit(main())
