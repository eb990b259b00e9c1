"""SGLang on GPUs: launch commands (one server per GPU or TP group, or one router) and their lifecycle.

- :func:`build_sglang_commands`: N ``python -m sglang.launch_server`` (one per GPU or TP group).
- :func:`build_router_command`: one ``python -m sglang_router.launch_server --dp-size N``.
- :class:`SGLangServers`: the :class:`~dflash_assets.generation.servers.group.ServerGroup` of SGLang servers: started
  in their own process groups, healthy once ``/health_generate`` answers (a one-token generation: a 200 from
  ``/health`` alone can hide a hung generator), restarted one on request and all stopped on exit.

Flag names follow SGLang's ``ServerArgs``.

The API key never goes on a command line (any local user reads those in ``ps``): each server gets
``--config FILE``, a YAML file holding ``api-key: <key>``, readable by this user only (0600, in a 0700
directory) and deleted once the server is up. SGLang's ``prepare_server_args`` merges such a file into
its flags (``server_args_config_parser.ConfigArgumentMerger``: each ``key: value`` becomes ``--key value``;
the file must end in ``.yaml``). ``sglang_router.launch_server`` parses its flags with no ``--config``, so
router mode takes no key (:func:`build_router_command` refuses one).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dflash_assets.generation.servers.group import LaunchCommand, ServerGroup, gpu_groups
from dflash_assets.generation.servers.secret_args import refuse_secret_args


def _refuse_own_config(extra_args: Sequence[str], api_key_env: str | None) -> None:
    if api_key_env and "--config" in extra_args:
        raise ValueError(
            "inference.sglang.extra_args holds --config: with an API key the launcher gives SGLang its own "
            "--config file (the key, kept off the command line) and SGLang takes one; put those "
            "settings into extra_args as flags"
        )


def _sglang_flags(
    model_path: str,
    max_running_requests: int | None,
    max_mamba_cache_size: int | None,
    mem_fraction_static: float | None,
    context_length: int | None,
    tp_size: int,
    reasoning_parser: str | None,
) -> list[str]:
    """Server flags shared by the per-GPU servers and the router's workers (names from SGLang's ServerArgs)."""
    flags = ["--model-path", str(model_path), "--tp-size", str(tp_size)]
    if max_running_requests is not None:
        flags += ["--max-running-requests", str(max_running_requests)]
    if max_mamba_cache_size is not None:
        flags += ["--max-mamba-cache-size", str(max_mamba_cache_size)]
    if mem_fraction_static is not None:
        flags += ["--mem-fraction-static", str(mem_fraction_static)]
    if context_length is not None:
        flags += ["--context-length", str(context_length)]
    if reasoning_parser:
        flags += ["--reasoning-parser", reasoning_parser]
    return flags


def build_sglang_commands(
    model_path: str,
    num_servers: int = 1,
    gpu_ids: Sequence[int] | None = None,
    port_base: int = 30000,
    host: str = "127.0.0.1",
    max_running_requests: int | None = 40,
    max_mamba_cache_size: int | None = None,
    mem_fraction_static: float | None = None,
    context_length: int | None = None,
    tp_size: int = 1,
    reasoning_parser: str | None = "qwen3",
    api_key_env: str | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    module: str = "sglang.launch_server",
) -> list[LaunchCommand]:
    """One ``python -m sglang.launch_server`` per GPU (or per group of ``tp_size`` GPUs).

    ``module`` replaces ``sglang.launch_server`` (e.g. ``dflash_simulators.sglang_stub``, a
    time-faithful stand-in for benches without GPUs); it must take the same flags.

    Server ``i`` sees only its GPUs through ``CUDA_VISIBLE_DEVICES`` and listens on ``port_base + i``.
    Flags left None are not passed (SGLang's defaults apply). ``api_key_env`` names the environment
    variable that holds the key; the value goes only into the key file of :meth:`LaunchCommand.launch_argv`.

    Raises:
        ValueError: ``gpu_ids`` does not hold exactly ``num_servers * tp_size`` distinct ids, or
            ``extra_args`` holds ``--config`` while a key is named.
        SecretArgError: ``extra_args`` holds ``--api-key`` (:func:`refuse_secret_args`).
    """
    groups = gpu_groups(num_servers, tp_size, gpu_ids)
    _refuse_own_config(extra_args, api_key_env)
    refuse_secret_args(extra_args, "inference.sglang.extra_args / drafter_evaluation.engine_extra_args")
    flags = _sglang_flags(
        model_path,
        max_running_requests,
        max_mamba_cache_size,
        mem_fraction_static,
        context_length,
        tp_size,
        reasoning_parser,
    )
    commands = []
    for i, group in enumerate(groups):
        port = port_base + i
        argv = (python, "-m", module, *flags, "--host", host, "--port", str(port), *extra_args)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, group))}
        commands.append(LaunchCommand(argv, env, host, port, api_key_env))
    return commands


def build_router_command(
    model_path: str,
    num_servers: int = 1,
    gpu_ids: Sequence[int] | None = None,
    port: int = 30000,
    worker_port_base: int = 31000,
    host: str = "127.0.0.1",
    max_running_requests: int | None = 40,
    max_mamba_cache_size: int | None = None,
    mem_fraction_static: float | None = None,
    context_length: int | None = None,
    tp_size: int = 1,
    reasoning_parser: str | None = "qwen3",
    api_key_env: str | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> LaunchCommand:
    """One ``python -m sglang_router.launch_server --dp-size N``: the router co-launches N workers.

    The router listens on ``host:port``; workers take ports from ``--router-dp-worker-base-port``
    and GPUs ``base_gpu_id = rank * tp_size`` within ``CUDA_VISIBLE_DEVICES`` (all of ``gpu_ids``).

    Raises:
        ValueError: ``gpu_ids`` does not hold exactly ``num_servers * tp_size`` distinct ids; or a key is
            named (``api_key_env``): the router's launcher reads flags from its command line only (no
            ``--config``), where every local user would see the key.
    """
    if api_key_env:
        raise ValueError(
            f"inference.sglang.use_router with an API key ({api_key_env}): sglang_router.launch_server takes the key "
            "only on its command line, where any local user reads it (ps); use servers without the router "
            "(use_router: false, the client spreads requests over them) or run the router yourself and use mode: "
            "external"
        )
    refuse_secret_args(extra_args, "inference.sglang.extra_args")
    groups = gpu_groups(num_servers, tp_size, gpu_ids)
    flags = _sglang_flags(
        model_path,
        max_running_requests,
        max_mamba_cache_size,
        mem_fraction_static,
        context_length,
        tp_size,
        reasoning_parser,
    )
    argv = (
        python,
        "-m",
        "sglang_router.launch_server",
        *flags,
        "--dp-size",
        str(num_servers),
        "--host",
        host,
        "--port",
        str(port),
        "--router-dp-worker-base-port",
        str(worker_port_base),
        *extra_args,
    )
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for group in groups for g in group)}
    return LaunchCommand(argv, env, host, port, api_key_env)


def _is_router(command: LaunchCommand) -> bool:
    return "sglang_router.launch_server" in command.argv


class SGLangServers(ServerGroup):
    """Start SGLang servers (or a router) from :class:`~dflash_assets.generation.servers.group.LaunchCommand` s;
    wait for ``/health_generate``. The lifecycle is :class:`~dflash_assets.generation.servers.group.ServerGroup`'s.

    ``/health_generate`` runs a one-token generation, so a hung scheduler does not pass. Logs go to
    ``log_dir/sglang_<i>.log``; the launch line written at the top of each log is the redacted one.

    Args:
        commands: from :func:`build_sglang_commands` or ``[build_router_command(...)]``.
        others: as :class:`~dflash_assets.generation.servers.group.ServerGroup`.

    Raises (on enter): as ``ServerGroup``.
    """

    HEALTH_PATH = "/health_generate"  # a one-token generation: a hung scheduler does not pass

    def label(self, command: LaunchCommand, index: int) -> str:
        """Pidfile label: ``sglang router`` or ``<engine> <index>``."""
        return "sglang router" if _is_router(command) else super().label(command, index)

    def exit_hint(self, command: LaunchCommand, tail: str) -> str:
        """What to do about a server that exited before it was healthy, from its log tail ("" when nothing
        known matches)."""
        if "--config" in tail and command.api_key_env and "unrecognized arguments" in tail:
            return (
                "; this SGLang takes no --config file, which carries the API key (kept off the command "
                "line): upgrade SGLang, or run without a key"
            )
        return super().exit_hint(command, tail)
