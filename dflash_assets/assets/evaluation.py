"""Stage 7: ``drafter_evaluation``: acceptance length from real speculative decoding on held-out prompts."""

import math
import time

import dagster as dg
import numpy as np
import polars as pl
import torch
from pydantic import Field

from dflash_assets.assets.drafter import EXPORT_DIR
from dflash_assets.assets.prompts import CORPUS_FILE
from dflash_assets.dflash.data import HiddenStateShards
from dflash_assets.dflash.evaluation import acceptance_histogram_png, acceptance_length, evaluate_drafter, teacher_forced_acceptance, untrained_drafter_like
from dflash_assets.dflash.export import load_exported
from dflash_assets.dflash.model import load_target_head
from dflash_assets.dflash.speculative import target_generate
from dflash_assets.feature_sources import heldout_set as heldout_set_for
from dflash_assets.metadata import png_markdown
from dflash_assets.partitions import prompt_ranges
from dflash_assets.resources.storage import StorageResource
from dflash_assets.resources.target_model import TargetModelResource
from dflash_assets.status import GPU_POOL
from dflash_assets.tokenization import SequenceBuilder

REPORT_DIR = "drafter_evaluation"


class EvaluationConfig(dg.Config):
    """How much speculative decoding to run (greedy, temperature 0)."""

    num_prompts: int = Field(default=32, ge=1, description="Held-out prompts decoded both ways.")
    max_new_tokens: int = Field(default=256, ge=1, description="Tokens generated per prompt.")
    teacher_forced_anchors: int = Field(default=64, ge=1, description="Anchors per held-out row for the proxy.")


def heldout_indexes(heldout_set: HiddenStateShards) -> list[int]:
    """Prompt indexes of the rows in the drafter's held-out split (``HiddenStateShards(split="eval")``)."""
    return sorted(int(r.key.split(":", 1)[1]) for r in heldout_set.rows if r.key.startswith("idx:"))


def standard_error(values: list[float]) -> float:
    """Standard error of the mean (sample std / sqrt(n)); 0 for fewer than 2 values."""
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


@dg.asset(
    deps=["dflash_drafter"],
    group_name="drafter",
    kinds={"pytorch", "matplotlib"},
    owners=["team:dflash"],
    op_tags={"dflash/gpu": "eval"},
    pool=GPU_POOL,
    description=(
        "Loads dflash_drafter/export and the target; on prompts the drafter's training held out, decodes greedily "
        "with DFlash speculative decoding and with the plain target, and reports the mean acceptance length tau "
        "(tokens accepted per target forward, bonus token counted), its histogram, target forwards saved, wall-time "
        "speedup, a lossless check, and the teacher-forced acceptance on held-out features; each beside an untrained "
        "drafter's figure. Writes drafter_evaluation/report.json and acceptance.png."
    ),
)
def drafter_evaluation(context: dg.AssetExecutionContext, config: EvaluationConfig, storage: StorageResource, target_model: TargetModelResource) -> dg.MaterializeResult:
    store = storage.open()
    drafter_event = context.instance.get_latest_materialization_event(dg.AssetKey("dflash_drafter"))
    if drafter_event is None:
        raise dg.Failure("dflash_drafter has not been materialized")
    train_meta = {k: getattr(v, "value", v) for k, v in drafter_event.asset_materialization.metadata.items()}
    export_dir = storage.ensure_local_dir(*EXPORT_DIR)  # S3: downloaded to scratch
    model_dir = target_model.resolved_path()
    embed, lm_head = load_target_head(model_dir)
    drafter = load_exported(export_dir, embed_weight=embed, lm_head_weight=lm_head).eval()
    untrained = untrained_drafter_like(drafter, seed=int(train_meta.get("seed", 0)))
    block_size = drafter.config.block_size

    eval_fraction, max_length = float(train_meta.get("eval_fraction", 0.0)), int(train_meta.get("max_length", 3072))
    target = target_model.load_model()
    # online drafters have no shards: the frozen target computes the held-out rows' features
    heldout_set = heldout_set_for(storage, context.instance.get_dynamic_partitions(prompt_ranges.name), train_meta.get("features", "offline"),
                                  eval_fraction=eval_fraction, max_length=max_length, block_size=block_size, target=target,
                                  target_layer_ids=drafter.config.target_layer_ids)
    held = heldout_indexes(heldout_set)
    if not held:
        raise dg.Failure(f"the drafter's training held out no row (eval_fraction {eval_fraction}): raise dflash_drafter's eval_fraction")
    chosen = held[: config.num_prompts]
    corpus = store.read_parquet(*CORPUS_FILE).filter(pl.col("index").is_in(chosen)).sort("index")
    tokenizer = target_model.load_tokenizer()
    builder = SequenceBuilder(tokenizer)
    prompts_ids = [
        tokenizer(builder.prompt_text(m, enable_thinking=True), add_special_tokens=False)["input_ids"] for m in corpus["messages"].to_list()
    ]
    context.log.info(f"speculative decoding of {len(prompts_ids)} held-out prompts, {config.max_new_tokens} new tokens each")
    started = time.monotonic()
    eos = [builder.end_token_id]
    n = len(prompts_ids)

    def report(label: str):
        def progress(done: int, total: int, result) -> None:
            elapsed = time.monotonic() - started
            context.log.info(
                f"{label}: prompt {done}/{total}, {result.num_new_tokens} tokens in {result.wall_s:.1f} s "
                f"({result.num_new_tokens / max(result.wall_s, 1e-9):.1f} tokens/s), tau {acceptance_length(result.accepted_lengths):.2f}; "
                f"{elapsed:.0f} s into evaluation"
            )

        return progress

    with torch.no_grad():
        target_generate(target, prompts_ids[0], 2, eos)  # warm-up outside the timing
        plain = []
        for p in prompts_ids:
            plain.append(target_generate(target, p, config.max_new_tokens, eos))
            report("plain greedy decoding")(len(plain), n, plain[-1])
        trained = evaluate_drafter(target, drafter, prompts_ids, config.max_new_tokens, eos_token_ids=eos, plain_results=plain,
                                   progress=report("speculative decoding, trained drafter"))
        base = evaluate_drafter(target, untrained, prompts_ids, config.max_new_tokens, eos_token_ids=eos, plain_results=plain,
                                progress=report("speculative decoding, untrained drafter"))
        context.log.info(f"teacher-forced acceptance on {len(heldout_set)} held-out rows")
        proxy = teacher_forced_acceptance(drafter, heldout_set, max_anchors=config.teacher_forced_anchors)
        proxy_base = teacher_forced_acceptance(untrained, heldout_set, max_anchors=config.teacher_forced_anchors)
    wall = time.monotonic() - started

    png = acceptance_histogram_png({"trained": sum(trained["accepted_lengths"], []), "untrained": sum(base["accepted_lengths"], [])}, block_size)
    png_uri = store.write_bytes(png, REPORT_DIR, "acceptance.png")
    se, se_base = standard_error(trained["per_prompt_tau"]), standard_error(base["per_prompt_tau"])
    report = {
        "trained": {k: v for k, v in trained.items() if k != "accepted_lengths"},
        "untrained": {k: v for k, v in base.items() if k != "accepted_lengths"},
        "teacher_forced": {"trained": proxy, "untrained": proxy_base},
        "heldout_prompt_indexes": chosen,
        "drafter_export": store.uri(*EXPORT_DIR),
    }
    store.write_json(report, REPORT_DIR, "report.json")
    if not trained["lossless"]:
        context.log.error(f"speculative output differs from the target's greedy output on prompts {trained['mismatched_prompts']}")
    return dg.MaterializeResult(
        metadata={
            "tau": round(trained["tau"], 4),
            "tau_untrained": round(base["tau"], 4),
            "tau_stderr": round(se, 4),
            "tau_untrained_stderr": round(se_base, 4),
            "tau_margin_in_stderr": round((trained["tau"] - base["tau"]) / max(math.hypot(se, se_base), 1e-9), 2),
            "teacher_forced_tau": round(proxy["tau"], 4),
            "teacher_forced_tau_untrained": round(proxy_base["tau"], 4),
            "target_forwards_plain": trained["target_forwards_plain"],
            "target_forwards_spec": trained["target_forwards_spec"],
            "target_forwards_saved": trained["target_forwards_saved"],
            "speedup_wall": round(trained["speedup"], 3),
            "lossless": bool(trained["lossless"]),
            "num_prompts": len(prompts_ids),
            "new_tokens": trained["new_tokens"],
            "block_size": block_size,
            "histogram": png_markdown(png, "acceptance"),
            "histogram_path": dg.MetadataValue.path(png_uri),
            "wall_s": round(wall, 1),
        }
    )
