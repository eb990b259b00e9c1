"""Stage 7: ``drafter_evaluation``: acceptance length from real speculative decoding on held-out prompts.

The prompt sets, the in-process decoding and the engine mode are in :mod:`dflash_assets.stages.evaluation`."""

import json
import os
import time
from pathlib import Path

import dagster as dg

from dflash_assets.common.cost import evaluation_cost
from dflash_assets.dflash.export.directory import config_from_hf_dict, resolve_export
from dflash_assets.orchestration.history import plain_metadata
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.orchestration.pools import GPU_POOL
from dflash_assets.stages.drafter.identity import file_sha256
from dflash_assets.stages.drafter.run import EXPORT_DIR
from dflash_assets.stages.evaluation.baseline import CHECK_BASELINE
from dflash_assets.stages.evaluation.config import EvaluationConfig
from dflash_assets.stages.evaluation.datasets import evaluation_fingerprint, evaluation_prompts
from dflash_assets.stages.evaluation.engine import engine_fingerprint, plan_engine
from dflash_assets.stages.evaluation.in_process import REPORT_DIR
from dflash_assets.stages.evaluation.parity import CHECK_LOSSLESS, CHECK_PARITY
from dflash_assets.stages.evaluation.run import check_results, evaluated_metadata, run_evaluation
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource


@dg.asset(
    deps=["dflash_drafter"],
    check_specs=[
        dg.AssetCheckSpec(
            CHECK_LOSSLESS,
            asset="drafter_evaluation",
            description="Speculative decoding (in process; on the engine when it ran) equals plain greedy decoding.",
        ),
        dg.AssetCheckSpec(
            CHECK_PARITY,
            asset="drafter_evaluation",
            description="engine vllm: every verification step vLLM ran, replayed here at its anchor with the drafter "
            "as trained, accepts as many drafts (numeric ties apart), and vLLM drafts block_size - 1 tokens: the "
            "export serves as the drafter trained.",
        ),
        dg.AssetCheckSpec(
            CHECK_BASELINE,
            asset="drafter_evaluation",
            description="Warns (non-blocking) unless the trained drafter makes more tokens per target forward than "
            "the engine's n-gram lookup (no training) on the same prompts with as many draft tokens, by more than two "
            "paired standard errors of the pooled ratio.",
        ),
    ],
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
        "saved, wall-time speedup and a lossless check (an untrained drafter's beside them with untrained_baseline); "
        "plus the quick teacher-forced "
        "estimate along the decoder's own anchor chain on held-out features. With engine: sglang | external, also the "
        "acceptance length SGLang reports per request with the export loaded by --speculative-algorithm DFLASH (the "
        "export is checked against SGLang's loader rules before any server starts; a simulated engine is labelled so). "
        "With engine: vllm, the prompts go to vLLM together, with the drafter, with vLLM's n-gram lookup (no training) "
        "and with plain decoding, each request's verification steps read from vLLM's own per-request figures, the "
        "methods compared in generated tokens per target forward with paired standard errors; the in-process side "
        "then replays vLLM's outputs step by step instead of decoding again. "
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
):
    store = storage.open()
    if not config.in_process and config.engine == "none":
        raise dg.Failure(
            "drafter_evaluation: in_process: false with engine: none evaluates nothing; set engine or in_process"
        )
    train_meta = _drafter_metadata(context.instance)
    # S3: downloaded to scratch. Resolved once: a new export switched in meanwhile cannot mix into this one
    export_dir = str(resolve_export(storage.ensure_local_dir(*EXPORT_DIR)))
    export_sha = file_sha256(os.path.join(export_dir, "model.safetensors"))
    plan = plan_engine(config, inference, target_model, export_dir, context.log)  # refuses before anything starts
    # config.json too: an export whose settings changed (layers, mask token, block) is evaluated again
    export_files_sha = f"{export_sha}:{file_sha256(os.path.join(export_dir, 'config.json'))}"
    fingerprint = evaluation_fingerprint(config, export_files_sha, train_meta, engine_fingerprint(plan))
    previous = _previous_if_same(context.instance, fingerprint)
    if previous is not None:
        text = (
            f"reused: the drafter (export sha256 {export_sha[:12]}) and the evaluation settings are "
            "unchanged, no decoding"
        )
        context.log.info(text)
        yield dg.MaterializeResult(metadata={**previous, "outcome": "reused", "outcome_text": text})
        yield from check_results(_plain(previous.get("checks")) or {})
        return
    block_size = config_from_hf_dict(json.loads(Path(export_dir, "config.json").read_text())).block_size
    keys = context.instance.get_dynamic_partitions(prompt_ranges.name)
    rows_only, held, prompts, eos, last_roles = evaluation_prompts(
        storage, store, keys, train_meta, block_size, config, target_model, context.log
    )
    started = time.monotonic()
    report, metadata, engine_section = run_evaluation(
        context.log,
        config,
        plan,
        inference,
        storage,
        store,
        target_model,
        export_dir,
        train_meta,
        rows_only,
        prompts,
        eos,
        held,
        export_sha,
        last_roles,
    )
    store.write_json(report, REPORT_DIR, "report.json")
    wall_s = time.monotonic() - started
    metadata |= evaluation_cost(plan, inference, target_model.device, wall_s, metadata)  # dflash_assets.common.cost
    yield dg.MaterializeResult(
        metadata=evaluated_metadata(
            config, plan, engine_section, prompts, export_sha, metadata, block_size, fingerprint, wall_s=wall_s
        )
    )
    yield from check_results(report["checks"])


def _drafter_metadata(instance: dg.DagsterInstance) -> dict:
    """Plain values of the latest ``dflash_drafter`` materialization's metadata.

    Raises:
        dagster.Failure: the drafter has not been materialized.
    """
    drafter_event = instance.get_latest_materialization_event(dg.AssetKey("dflash_drafter"))
    if drafter_event is None:
        raise dg.Failure("dflash_drafter has not been materialized")
    return plain_metadata(drafter_event)


def _plain(value):
    """A metadata entry's plain value (``JsonMetadataValue.value``), or the value itself."""
    return getattr(value, "value", value)


def _previous_if_same(instance: dg.DagsterInstance, fingerprint: str) -> dict | None:
    """The last evaluation's metadata when it has this ``evaluation_fingerprint``, else None."""
    previous = instance.get_latest_materialization_event(dg.AssetKey("drafter_evaluation"))
    if previous is not None and previous.asset_materialization is not None:
        prev_meta = dict(previous.asset_materialization.metadata)
        # an evaluation recorded before a check existed is redone: its reuse would have no result for that check
        checks = _plain(prev_meta.get("checks")) or {}
        same = getattr(prev_meta.get("evaluation_fingerprint"), "value", None) == fingerprint
        if same and {CHECK_LOSSLESS, CHECK_PARITY, CHECK_BASELINE} <= set(checks):
            return prev_meta
    return None


__all__ = ["drafter_evaluation"]
