"""SGLang on GPUs: launch commands (one server per GPU or TP group, or one router) and their lifecycle.

- :func:`build_sglang_commands`: N ``python -m sglang.launch_server`` (one per GPU or TP group).
- :func:`build_router_command`: one ``python -m sglang_router.launch_server --dp-size N``.
- :class:`SGLangServers`: starts them in their own process groups (registered for the orphan reaper),
  waits for ``/health_generate`` (a one-token generation: a 200 from ``/health`` alone can hide a hung
  generator), restarts one on request and stops them all on exit.

Flag names follow SGLang's ``ServerArgs``.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dflash_assets.generation.processes import drain_log, log_tail, stop_process_group
from dflash_assets.generation.server_registry import start_process
from dflash_assets.generation.urls import origin, redact


@dataclass(frozen=True)
class LaunchCommand:
    """One server process to start: ``argv`` (never holding the API key), env overrides, address.

    Attributes:
        argv: the command line without any secret.
        env: variables set on top of the parent's environment (``CUDA_VISIBLE_DEVICES``).
        host, port: where the server (or router) listens.
        api_key_env: name of the environment variable whose value :meth:`launch_argv` appends as
            ``--api-key`` at launch time; None for no key.
    """

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key_env: str | None = None

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    def launch_argv(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """argv to execute: :attr:`argv` plus ``--api-key <value of api_key_env>`` when a key is named.

        Raises:
            KeyError: ``api_key_env`` is set but not present (or empty) in ``environ`` (default os.environ).
        """
        argv = list(self.argv)
        if self.api_key_env:
            value = (os.environ if environ is None else environ).get(self.api_key_env)
            if not value:
                raise KeyError(f"environment variable {self.api_key_env} (the server API key) is not set")
            argv += ["--api-key", value]
        return argv

    def redacted(self) -> str:
        """A shell-quoted line for logs: env overrides, argv, and ``--api-key $NAME`` in place of the key."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = shlex.join(self.argv)
        if self.api_key_env:
            cmd += f" --api-key ${self.api_key_env}"
        return f"{env} {cmd}".strip()


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


def _gpu_groups(num_servers: int, tp_size: int, gpu_ids: Sequence[int] | None) -> list[list[int]]:
    """Split ``gpu_ids`` (default ``0..num_servers*tp_size-1``) into ``num_servers`` groups of ``tp_size``."""
    if num_servers < 1 or tp_size < 1:
        raise ValueError(f"num_servers ({num_servers}) and tp_size ({tp_size}) must be >= 1")
    ids = list(gpu_ids) if gpu_ids is not None else list(range(num_servers * tp_size))
    if len(ids) != num_servers * tp_size:
        raise ValueError(f"{num_servers} servers x tp_size {tp_size} need {num_servers * tp_size} GPUs, got {ids}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"gpu_ids has duplicates: {ids}")
    return [ids[i * tp_size : (i + 1) * tp_size] for i in range(num_servers)]


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

    ``module`` replaces ``sglang.launch_server`` (e.g. ``dflash_assets.simulation.sglang_stub``, a
    time-faithful stand-in for benches without GPUs); it must take the same flags.

    Server ``i`` sees only its GPUs through ``CUDA_VISIBLE_DEVICES`` and listens on ``port_base + i``.
    Flags left None are not passed (SGLang's defaults apply). ``api_key_env`` names the environment
    variable that holds the key; the value is added only by :meth:`LaunchCommand.launch_argv`.

    Raises:
        ValueError: ``gpu_ids`` does not hold exactly ``num_servers * tp_size`` distinct ids.
    """
    groups = _gpu_groups(num_servers, tp_size, gpu_ids)
    flags = _sglang_flags(model_path, max_running_requests, max_mamba_cache_size, mem_fraction_static,
                          context_length, tp_size, reasoning_parser)
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
    The same ``--api-key`` reaches the workers (ServerArgs); the router's own key flag differs
    between releases, so add it through ``extra_args`` if needed.

    Raises:
        ValueError: ``gpu_ids`` does not hold exactly ``num_servers * tp_size`` distinct ids.
    """
    groups = _gpu_groups(num_servers, tp_size, gpu_ids)
    flags = _sglang_flags(model_path, max_running_requests, max_mamba_cache_size, mem_fraction_static,
                          context_length, tp_size, reasoning_parser)
    argv = (
        python, "-m", "sglang_router.launch_server", *flags, "--dp-size", str(num_servers),
        "--host", host, "--port", str(port), "--router-dp-worker-base-port", str(worker_port_base), *extra_args,
    )
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for group in groups for g in group)}
    return LaunchCommand(argv, env, host, port, api_key_env)


def _sglang_label(command: LaunchCommand, index: int) -> str:
    """Pidfile label: ``sglang router`` or ``sglang <index>``."""
    return "sglang router" if "sglang_router.launch_server" in command.argv else f"sglang {index}"


class SGLangServers:
    """Start SGLang servers (or a router) from :class:`LaunchCommand` s; wait for ``/health_generate``.

    ``/health_generate`` runs a one-token generation, so a hung scheduler does not pass. Logs go to
    ``log_dir/sglang_<i>.log``; the launch line written at the top of each log is the redacted one.

    Args:
        commands: from :func:`build_sglang_commands` or ``[build_router_command(...)]``.
        log_dir: directory for the logs.
        api_key: the key value; used for ``--api-key`` (via the command's ``api_key_env``) and for the
            health probes. None reads the variable from ``os.environ``.
        startup_timeout_s: seconds to wait for every server (loading a 27B model plus CUDA-graph capture
            takes minutes).
        parent_death_signal: kill each server (launcher process) when this process dies (Linux).

    Attributes (inside ``with``): ``base_urls`` (``http://host:port/v1``, in command order).

    Raises (on enter):
        RuntimeError: a server exited before it was healthy (message holds its log tail).
        TimeoutError: not all healthy within ``startup_timeout_s``.
    """

    def __init__(
        self,
        commands: Sequence[LaunchCommand],
        log_dir: Path | str,
        api_key: str | None = None,
        startup_timeout_s: float = 1800.0,
        health_path: str = "/health_generate",
        parent_death_signal: bool = True,
        health_poll_s: float = 0.2,
    ) -> None:
        self.health_poll_s = health_poll_s
        self._lock = threading.Lock()  # restart (a monitor thread) vs stop (the run's end)
        self._closed = False
        self.commands = list(commands)
        self.parent_death_signal = parent_death_signal
        self.log_dir = Path(log_dir)
        self.api_key = api_key
        self.startup_timeout_s = startup_timeout_s
        self.health_path = health_path
        self._procs: list[subprocess.Popen] = []

    @property
    def base_urls(self) -> list[str]:
        return [c.base_url for c in self.commands]

    def _environ(self, command: LaunchCommand) -> dict[str, str]:
        environ = dict(os.environ)
        if command.api_key_env and self.api_key:
            environ[command.api_key_env] = self.api_key
        return environ

    def __enter__(self) -> SGLangServers:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(len(self.commands)):
                self._procs.append(self._launch(i))
            self._wait_healthy(range(len(self.commands)))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _launch(self, i: int) -> subprocess.Popen:
        command = self.commands[i]
        log_path = self.log_dir / f"sglang_{i}.log"
        with open(log_path, "a") as log:
            log.write(f"# launch: {command.redacted()}\n")
        key = self._launch_key(command)
        return start_process(
            command.launch_argv(self._environ(command)), {**os.environ, **command.env}, log_path, port=command.port,
            label=_sglang_label(command, i), parent_death_signal=self.parent_death_signal, secrets=[key] if key else [],
        )

    def _launch_key(self, command: LaunchCommand) -> str | None:
        """The key ``command`` is launched with (``api_key``, else its variable in os.environ), or None."""
        return self._environ(command).get(command.api_key_env) if command.api_key_env else None

    def exit_code(self, i: int) -> int | None:
        """Exit code of server ``i`` when its process has exited (killed, crashed), else None."""
        procs = self._procs
        return procs[i].poll() if i < len(procs) else None

    def restart(self, i: int) -> float:
        """Stop server ``i`` (its whole process group), start it again with the same command and wait
        until it generates. Returns the seconds it took. Safe from any thread (one restart per server
        at a time). Raises as :meth:`__enter__` (RuntimeError, TimeoutError)."""
        started = time.monotonic()
        with self._lock:
            if self._closed:
                raise RuntimeError("servers are stopping: not restarted")
            stop_process_group(self._procs[i], grace_s=5.0)
            self._procs[i] = self._launch(i)
        self._wait_healthy([i])
        return time.monotonic() - started

    def stop(self) -> None:
        """Terminate every server's process group (SIGTERM, then SIGKILL after 30 s). Idempotent."""
        with self._lock:
            self._closed = True
            procs, self._procs = self._procs, []
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            stop_process_group(proc, grace_s=30.0)

    def _wait_healthy(self, indices) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        pending = {i: self.commands[i] for i in indices}
        deadline = time.monotonic() + self.startup_timeout_s
        while pending:
            for i, command in list(pending.items()):
                procs = self._procs
                if i >= len(procs):
                    raise RuntimeError("servers were stopped while waiting for them")
                proc = procs[i]
                if proc.poll() is not None:
                    drain_log(proc)
                    log_path = self.log_dir / f"sglang_{i}.log"
                    raise RuntimeError(
                        f"SGLang server {i} ({command.base_url}) exited with code {proc.returncode}; "
                        f"log {log_path}:\n{redact(log_tail(log_path), self._launch_key(command))}"
                    )
                try:
                    r = httpx.get(origin(command.base_url) + self.health_path, headers=headers, timeout=30)
                    if r.status_code == 200:
                        del pending[i]
                except httpx.TransportError:
                    pass
            if pending and time.monotonic() > deadline:
                urls = [c.base_url for c in pending.values()]
                raise TimeoutError(f"SGLang servers {urls} not healthy after {self.startup_timeout_s:.0f} s; "
                                   f"logs in {self.log_dir}")
            if pending:
                # polling is cheap (one GET per pending server); a long pause is idle GPUs after start-up
                time.sleep(self.health_poll_s)
