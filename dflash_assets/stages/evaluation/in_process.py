"""The evaluation in this process: speculative vs plain decoding with the target and the exported drafter
(an untrained drafter beside it when ``untrained_baseline`` is set), and the teacher-forced estimates on the
held-out rows."""

import math
import time

import dagster as dg
import torch

from dflash_assets.common.progress import StageProgressBar
from dflash_assets.dflash.decoding.acceptance import acceptance_length
from dflash_assets.dflash.decoding.evaluation import acceptance_histogram_png, evaluate_drafters, untrained_drafter_like
from dflash_assets.dflash.decoding.teacher_forced import teacher_forced_acceptance, teacher_forced_chain
from dflash_assets.dflash.export.directory import load_exported
from dflash_assets.dflash.model.draft_model import load_target_head
from dflash_assets.dflash.training.online import OnlineTargetFeatures
from dflash_assets.orchestration.metadata import png_markdown
from dflash_assets.stages.evaluation.baseline import in_process_forward_figures
from dflash_assets.stages.evaluation.datasets import HELDOUT
from dflash_assets.stages.resources.target_model import TargetModelResource

REPORT_DIR = "drafter_evaluation"


def _r(x, nd: int = 4):
    return None if x is None or x != x else round(float(x), nd)


def in_process_evaluation(
    log,
    config,
    store,
    target_model: TargetModelResource,
    export_dir: str,
    train_meta: dict,
    prompts: dict[str, list[list[int]]],
    eos: list[int],
    heldout_set,
    online: bool,
    engine_positions: dict[str, list[float]] | None = None,
) -> dict:
    """Speculative vs plain decoding here (and the untrained drafter's, ``config.untrained_baseline``) and the
    teacher-forced chain: the report's and the metadata's in-process parts (``{"report": ..., "metadata": ...}``;
    without the untrained drafter its ``untrained`` entries and ``*_untrained`` figures are absent). ``online``:
    ``heldout_set`` holds tokenized rows, whose features the frozen target computes here. ``engine_positions``: the
    engine's acceptance per draft position per decode step on the held-out prompts, by label, drawn beside the
    trained drafter's in ``acceptance.png``."""
    model_dir = target_model.resolved_path()
    embed, lm_head = load_target_head(model_dir)
    # decoded as trained: an export that wrote other settings then disagrees with the engine (engine_parity)
    trained = {
        k: train_meta[k] for k in ("target_layer_ids", "block_size", "mask_token_id") if train_meta.get(k) is not None
    }
    drafter = load_exported(export_dir, embed_weight=embed, lm_head_weight=lm_head, overrides=trained).eval()
    drafters = {"trained": drafter}
    if config.untrained_baseline:  # the floor (tau ~1.00), opt-in: it costs ~40% of the decoding here
        drafters["untrained"] = untrained_drafter_like(drafter, seed=int(train_meta.get("seed", 0)))
    block_size = drafter.config.block_size
    target = target_model.load_model()
    if online:  # online drafters have no shards: the frozen target computes the held-out rows' features
        heldout_set.attach(OnlineTargetFeatures(target, drafter.config.target_layer_ids))
    started = time.monotonic()

    def report_progress(label: str, bar: StageProgressBar):
        calls = 0

        def progress(name: str, done: int, total: int, result) -> None:
            nonlocal calls
            calls += 1
            bar.update_to(calls, tok_s=f"{result.num_new_tokens / max(result.wall_s, 1e-9):.1f}")
            elapsed = time.monotonic() - started
            log.info(
                f"{label} / {name} drafter: prompt {done}/{total}, {result.num_new_tokens} tokens in "
                f"{result.wall_s:.1f} s "
                f"({result.num_new_tokens / max(result.wall_s, 1e-9):.1f} tokens/s), tau "
                f"{acceptance_length(result.accepted_lengths):.2f}; "
                f"{elapsed:.0f} s into evaluation"
            )

        return progress

    results: dict[str, dict] = {}
    with torch.no_grad():
        for name, prompts_ids in prompts.items():
            log.info(
                f"dataset {name}: {len(prompts_ids)} prompts, {config.max_new_tokens} new tokens each, plain / "
                f"{' / '.join(drafters)} interleaved"
            )
            # one step per drafter and prompt
            with StageProgressBar(f"drafter_evaluation {name}", len(drafters) * len(prompts_ids), unit="prompt") as bar:
                results[name] = evaluate_drafters(
                    target,
                    drafters,
                    prompts_ids,
                    config.max_new_tokens,
                    eos_token_ids=eos,
                    progress=report_progress(name, bar),
                )
        log.info(f"teacher-forced chain estimate on {len(heldout_set)} held-out rows")
        chains = {
            who: teacher_forced_chain(d, heldout_set, max_new_tokens=config.max_new_tokens)
            for who, d in drafters.items()
        }
        uniform = teacher_forced_acceptance(drafter, heldout_set, max_anchors=config.teacher_forced_anchors)
    head, base = results[HELDOUT]["trained"], results[HELDOUT].get("untrained")
    chain, chain_base = chains["trained"], chains.get("untrained")

    positions = {
        "DFlash (in process)": in_process_forward_figures(head["accepted_lengths"], block_size)[
            "accepted_per_decode_step"
        ],
        **(engine_positions or {}),
    }
    png = acceptance_histogram_png(
        {who: [n for lengths in r["accepted_lengths"] for n in lengths] for who, r in results[HELDOUT].items()},
        block_size,
        per_position=positions,
    )
    png_uri = store.write_bytes(png, REPORT_DIR, "acceptance.png")
    report = {
        "datasets": {name: {"num_prompts": r["trained"]["num_prompts"], **r} for name, r in results.items()},
        "tau_definition": "tau = mean over prompts of each prompt's mean accepted length per verification step "
        "(bonus token "
        "counted; z-lab's benchmark); tau_pooled = all tokens / all verification steps; standard errors "
        "across prompts (pooled: ratio estimator clustered by prompt)",
        "teacher_forced_chain": chains,
        "teacher_forced_uniform_anchors": {k: v for k, v in uniform.items() if k != "blocks"},
    }
    for name, r in results.items():
        if not r["trained"]["lossless"]:
            log.error(
                f"{name}: speculative output differs from the target's greedy output on prompts "
                f"{r['trained']['mismatched_prompts']}"
            )
    se = head["tau_stderr"]
    by_dataset = {
        name: {
            "prompts": r["trained"]["num_prompts"],
            "tau": _r(r["trained"]["tau"]),
            "tau_stderr": _r(r["trained"]["tau_stderr"]),
            "tau_pooled": _r(r["trained"]["tau_pooled"]),
            "tau_pooled_stderr": _r(r["trained"]["tau_pooled_stderr"]),
            **({"tau_untrained": _r(r["untrained"]["tau"])} if "untrained" in r else {}),
            "speedup_wall": _r(r["trained"]["speedup"], 3),
        }
        for name, r in results.items()
    }
    floor = base is not None  # the untrained drafter's column only when it ran
    table = (
        f"| dataset | prompts | tau (per-prompt mean) | tau pooled |{' untrained |' if floor else ''} speedup |\n"
        f"|---|---|---|---|{'---|' if floor else ''}---|\n"
        + "".join(
            f"| {n} | {d['prompts']} | {d['tau']} +- {d['tau_stderr']} | {d['tau_pooled']} +- "
            f"{d['tau_pooled_stderr']} |" + (f" {d['tau_untrained']} |" if floor else "") + f" {d['speedup_wall']} |\n"
            for n, d in by_dataset.items()
        )
    )
    untrained_figures = {}
    if base is not None:
        se_base = base["tau_stderr"]
        untrained_figures = {
            "tau_untrained": _r(base["tau"]),
            "tau_untrained_stderr": _r(se_base),
            "tau_margin_in_stderr": round((head["tau"] - base["tau"]) / max(math.hypot(se, se_base), 1e-9), 2),
            "teacher_forced_tau_untrained": _r(chain_base["tau"]),
            "speedup_wall_untrained": _r(base["speedup"], 3),
        }
    metadata = {
        "tau": _r(head["tau"]),
        "tau_stderr": _r(se),
        "tau_pooled": _r(head["tau_pooled"]),
        "tau_pooled_stderr": _r(head["tau_pooled_stderr"]),
        "tau_by_dataset": by_dataset,
        "datasets": dg.MetadataValue.md(table),
        "acceptance_per_position": [_r(a) for a in head["acceptance_per_position"]],
        "teacher_forced_tau": _r(chain["tau"]),
        "teacher_forced_tau_pooled": _r(chain["tau_pooled"]),
        "teacher_forced_tau_uniform_anchors": _r(uniform["tau"]),
        "target_forwards_plain": head["target_forwards_plain"],
        "target_forwards_spec": head["target_forwards_spec"],
        "target_forwards_saved": head["target_forwards_saved"],
        "speedup_wall": _r(head["speedup"], 3),
        **untrained_figures,
        "timing": head["timing"],
        "lossless": all(run["lossless"] for r in results.values() for run in r.values()),
        "num_prompts": head["num_prompts"],
        "new_tokens": head["new_tokens"],
        "histogram": png_markdown(png, "acceptance"),
        "histogram_path": dg.MetadataValue.path(png_uri),
    }
    return {"report": report, "metadata": metadata}
