"""vLLM's OpenAI server: its launch command, with or without a DFlash drafter, and its lifecycle.

The server runs from the engine's own environment (:mod:`~dflash_assets.generation.engines.environments`): ``python -m
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
sliding and full attention layers need the V2 model runner, which the CPU build does not run. One CPU server
runs its model in EngineCore's own process (:data:`IN_PROCESS_WORKER_FLAGS`) instead of a worker process bound to
one core beside a reserved one: on a 2-core machine, side by side (SmolLM2-135M with a DFlash drafter, 8 requests
of 64 tokens), start-up 22-23 s instead of 40-42 s and decoding 6.7-8.6 s instead of 13-16 s, same greedy text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from dflash_assets.generation.servers.group import LaunchCommand, ServerGroup, gpu_groups
from dflash_assets.generation.servers.secret_args import refuse_secret_args

VLLM_KEY_VARIABLE = "VLLM_API_KEY"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: vLLM's CPU build reserves this fraction of one NUMA node's memory; its 0.92 default is refused when that
#: much is not free (any machine running other work).
CPU_MEMORY_FRACTION = 0.2
#: the variable vLLM's CPU build reads the cores of its compute threads from ("auto": one NUMA node's)
CPU_BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"
#: one CPU server's model in EngineCore's process (vLLM's "uni" executor); vLLM 0.32's CPU platform switches "uni"
#: back to "mp" unless VLLM_ENABLE_V1_MULTIPROCESSING is 0 (vllm/platforms/cpu.py); the API server still starts
#: EngineCore as its own process (AsyncLLM's client is always multiprocess)
IN_PROCESS_WORKER_FLAGS = ("--distributed-executor-backend", "uni")
IN_PROCESS_WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def dflash_speculative_config(export_dir: str | Path, block_size: int) -> dict:
    """The ``--speculative-config`` vLLM needs to run ``export_dir`` as a DFlash drafter.

    ``num_speculative_tokens`` = ``block_size - 1`` (tokens drafted per verification step).

    Raises:
        ValueError: ``block_size`` below 2 (a block holds the anchor and at least one drafted token).
    """
    if block_size < 2:
        raise ValueError(f"block_size {block_size}: a DFlash block needs at least 2 positions")
    return {"method": "dflash", "model": str(export_dir), "num_speculative_tokens": int(block_size) - 1}


def ngram_speculative_config(num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int) -> dict:
    """The ``--speculative-config`` of vLLM's n-gram (prompt lookup) speculation: at each step the longest suffix of
    the context, ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens, is looked up earlier in the context and the
    up to ``num_speculative_tokens`` tokens that followed it are drafted (none when nothing matches). Keys and
    rules as vLLM 0.32's ``SpeculativeConfig`` reads them (``vllm/config/speculative.py``; ``NgramProposer``).

    Raises:
        ValueError: a count below 1, or ``prompt_lookup_min`` above ``prompt_lookup_max`` (vLLM refuses it too).
    """
    if min(num_speculative_tokens, prompt_lookup_max, prompt_lookup_min) < 1:
        raise ValueError("num_speculative_tokens, prompt_lookup_max and prompt_lookup_min must be >= 1")
    if prompt_lookup_min > prompt_lookup_max:
        raise ValueError(f"prompt_lookup_min {prompt_lookup_min} is above prompt_lookup_max {prompt_lookup_max}")
    return {
        "method": "ngram",
        "num_speculative_tokens": int(num_speculative_tokens),
        "prompt_lookup_max": int(prompt_lookup_max),
        "prompt_lookup_min": int(prompt_lookup_min),
    }


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
    in_process_worker: bool = False,
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
        in_process_worker: the model runs in EngineCore's process (:data:`IN_PROCESS_WORKER_FLAGS` and
            :data:`IN_PROCESS_WORKER_ENV`); for one server on a CPU. Left out when ``extra_args`` names an executor
            or a core binding is set (``env`` or this environment: :func:`cpu_binding_unset`).
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
    if in_process_worker and IN_PROCESS_WORKER_FLAGS[0] not in extra_args and cpu_binding_unset(variables):
        argv += IN_PROCESS_WORKER_FLAGS
        variables.update(IN_PROCESS_WORKER_ENV)
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


def cpu_binding_unset(env: Mapping[str, str] | None = None) -> bool:
    """True when neither ``env`` nor this process's environment sets :data:`CPU_BIND_VARIABLE` (a binding the
    user chose needs vLLM's worker process, which applies it)."""
    return CPU_BIND_VARIABLE not in (env or {}) and CPU_BIND_VARIABLE not in os.environ


def cpu_core_groups(num_servers: int, cores: Sequence[int] | None = None) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` values splitting ``cores`` (default: the cores this process may run on)
    into ``num_servers`` contiguous groups, the first groups one core larger when they do not divide evenly;
    with fewer cores than servers, server ``i`` gets core ``i mod cores`` (they share).

    Raises:
        ValueError: ``num_servers`` below 1.
    """
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    ids = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(ids) < num_servers:
        return [str(ids[i % len(ids)]) for i in range(num_servers)]
    size, extra = divmod(len(ids), num_servers)
    groups, start = [], 0
    for i in range(num_servers):
        n = size + (1 if i < extra else 0)
        groups.append(",".join(map(str, ids[start : start + n])))
        start += n
    return groups


def build_vllm_commands(
    python: str | Path,
    model_path: str | Path,
    num_servers: int,
    port_base: int,
    *,
    host: str = "127.0.0.1",
    device: str = "cpu",
    dtype: str | None = None,
    max_model_len: int | None = None,
    memory_fraction: float | None = None,
    max_num_seqs: int | None = None,
    tp_size: int = 1,
    gpu_ids: Sequence[int] | None = None,
    reasoning_parser: str | None = None,
    api_key_env: str | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> list[LaunchCommand]:
    """``num_servers`` plain vLLM servers (no drafter) for the completions stage, server ``i`` on
    ``port_base + i``.

    On ``device`` ``cpu`` (vLLM's CPU build): ``--enforce-eager``, ``--dtype`` float32 unless given,
    ``--gpu-memory-utilization`` :data:`CPU_MEMORY_FRACTION` of one NUMA node unless given, and with several
    servers each one bound to its own cores (:func:`cpu_core_groups`, unless ``VLLM_CPU_OMP_THREADS_BIND`` is
    set in this environment or ``env``); one server with no binding set runs its model in EngineCore's process
    (:func:`build_vllm_command`'s ``in_process_worker``). On ``cuda``: server ``i`` sees its ``tp_size`` GPUs of
    ``gpu_ids`` (default ``0..num_servers*tp_size-1``) through ``CUDA_VISIBLE_DEVICES``, ``--tensor-parallel-size`` when
    above 1, and vLLM's own defaults for what is not given (dtype from the model, CUDA graphs, 0.92 of each GPU).

    Args:
        python: the engine environment's interpreter.
        model_path: the model's HF directory (also the served model name).
        max_model_len: ``--max-model-len``, tokens (None: the model's context).
        max_num_seqs: ``--max-num-seqs``, requests each server runs at once.
        reasoning_parser: ``--reasoning-parser`` (e.g. ``qwen3``); None: the reply's text stays whole in
            ``content``.
        api_key_env: the variable holding the key (handed to vLLM as ``VLLM_API_KEY``); None: no key.
        extra_args: more ``vllm serve`` flags, after these.
        env: variables set for every server on top of the parent's.

    Raises:
        ValueError: a device other than cpu / cuda, or ``gpu_ids`` not ``num_servers * tp_size`` distinct ids.
        SecretArgError: ``extra_args`` holds ``--api-key``.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: use 'cpu' or 'cuda'")
    refuse_secret_args(extra_args, "inference.vllm.extra_args")
    base_env = dict(env or {})
    on_cpu = device == "cpu"
    bind: list[str] | None = None
    groups: list[list[int] | None] = [None] * num_servers
    if not on_cpu:
        groups = list(gpu_groups(num_servers, tp_size, gpu_ids))
    elif num_servers > 1 and cpu_binding_unset(base_env):
        bind = cpu_core_groups(num_servers)  # else every server binds the same cores ("auto": one NUMA node's)
    if memory_fraction is None and on_cpu:
        memory_fraction = CPU_MEMORY_FRACTION
    flags = list(extra_args)
    if tp_size > 1:
        flags = ["--tensor-parallel-size", str(tp_size), *flags]
    if reasoning_parser:
        flags = ["--reasoning-parser", reasoning_parser, *flags]
    commands = []
    for i in range(num_servers):
        server_env = dict(base_env)
        if bind is not None:
            server_env[CPU_BIND_VARIABLE] = bind[i]
        commands.append(
            build_vllm_command(
                python,
                model_path,
                port_base + i,
                host=host,
                dtype=dtype or ("float32" if on_cpu else "auto"),
                max_model_len=max_model_len,
                memory_fraction=memory_fraction,
                max_num_seqs=max_num_seqs,
                enforce_eager=on_cpu,
                api_key_env=api_key_env,
                extra_args=flags,
                env=server_env,
                gpu_ids=groups[i],
                in_process_worker=on_cpu and num_servers == 1,
            )
        )
    return commands


class VLLMServers(ServerGroup):
    """vLLM servers from :func:`build_vllm_command` commands: the
    :class:`~dflash_assets.generation.servers.group.ServerGroup` of vLLM servers (free port first, listener proven
    ours, process group stopped on exit, logs ``vllm_<i>.log``), each under
    :mod:`~dflash_assets.generation.servers.group_guard` so EngineCore dies with the launcher, a kill -9 too; healthy
    when ``/health`` answers 200 (vLLM has no generation probe: the caller's first request is one).

    Raises (on enter): as ``ServerGroup``.
    """

    guard_group = True  # EngineCore and its workers set no parent-death signal: the guard takes them down

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


__all__ = [
    "CPU_MEMORY_FRACTION",
    "IN_PROCESS_WORKER_ENV",
    "IN_PROCESS_WORKER_FLAGS",
    "VLLM_KEY_VARIABLE",
    "VLLMServers",
    "build_vllm_command",
    "build_vllm_commands",
    "cpu_binding_unset",
    "cpu_core_groups",
    "dflash_speculative_config",
]
