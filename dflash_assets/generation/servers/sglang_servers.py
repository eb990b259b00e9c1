"""SGLang on GPUs: launch commands (one server per GPU or TP group, or one router) and their lifecycle.

- :func:`build_sglang_commands`: N ``python -m sglang.launch_server`` (one per GPU or TP group).
- :func:`build_router_command`: one ``python -m sglang_router.launch_server --dp-size N``.
- :class:`SGLangServers`: starts them in their own process groups (registered for the orphan reaper),
  waits for ``/health_generate`` (a one-token generation: a 200 from ``/health`` alone can hide a hung
  generator), restarts one on request and stops them all on exit.

Flag names follow SGLang's ``ServerArgs``.

The API key never goes on a command line (any local user reads those in ``ps``): each server gets
``--config FILE``, a YAML file holding ``api-key: <key>``, readable by this user only (0600, in a 0700
directory) and deleted once the server is up. SGLang's ``prepare_server_args`` merges such a file into
its flags (``server_args_config_parser.ConfigArgumentMerger``: each ``key: value`` becomes ``--key value``;
the file must end in ``.yaml``). ``sglang_router.launch_server`` parses its flags with no ``--config``, so
router mode takes no key (:func:`build_router_command` refuses one).

A server is trusted only once it is provably the process started for it: its port must be free before
launch, and no request (and no key) goes to the port before the socket listening there belongs to the
server's own session (:func:`~dflash_assets.generation.processes.sessions.listener_is_ours`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from dflash_assets.generation.api.urls import origin, redact
from dflash_assets.generation.processes.ports import check_port_free, listener_is_ours
from dflash_assets.generation.processes.sessions import drain_log, log_tail, stop_process_group
from dflash_assets.generation.servers.registry import KEY_DIR_PREFIX, register_key_dir, start_process
from dflash_assets.generation.servers.secret_args import refuse_secret_args


@dataclass(frozen=True)
class LaunchCommand:
    """One server process to start: ``argv`` (never holding the API key), env overrides, address.

    Attributes:
        argv: the command line without any secret.
        env: variables set on top of the parent's environment (``CUDA_VISIBLE_DEVICES``).
        host, port: where the server (or router) listens.
        api_key_env: name of the environment variable holding the key the server is started with (it
            reaches the server through the file :meth:`launch_argv` names, see :func:`write_key_config`);
            None for no key.
        key_env_var: the variable the *server* reads its key from (vLLM: ``VLLM_API_KEY``); set, the key is
            handed over in the server's environment (readable by this user only, ``/proc/<pid>/environ``)
            instead of a ``--config`` file. None: SGLang's key file.
        engine: ``sglang`` or ``vllm``: names the log (``<engine>_<i>.log``), the pidfile label and messages.
    """

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key_env: str | None = None
    key_env_var: str | None = None
    engine: str = "sglang"

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    def launch_argv(self, key_config: str | os.PathLike | None = None) -> list[str]:
        """argv to execute: :attr:`argv` plus ``--config <key_config>`` when a key is named (the key is in
        the file, never on the command line).

        Raises:
            ValueError: ``api_key_env`` is set but no ``key_config`` file is given.
        """
        if not self.api_key_env or self.key_env_var:
            return list(self.argv)
        if not key_config:
            raise ValueError(f"{self.api_key_env}: a server started with an API key needs its key file (--config)")
        return [*self.argv, "--config", str(key_config)]

    def redacted(self) -> str:
        """A shell-quoted line for logs: env overrides, argv, and the key file as ``--config <api-key: $NAME>``."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = shlex.join(self.argv)
        if self.api_key_env and self.key_env_var:
            env = f"{env} {self.key_env_var}=${self.api_key_env}".strip()
        elif self.api_key_env:
            cmd += f" --config '<0600 file: api-key: ${self.api_key_env}>'"
        return f"{env} {cmd}".strip()


def write_key_config(directory: str | os.PathLike, api_key: str) -> Path:
    """Write ``api-key: <api_key>`` to a new YAML file in ``directory`` readable and writable by this user
    only (created with mode 0600, never existing before); returns its path (``.yaml``, as SGLang's
    ``--config`` requires)."""
    path = Path(directory) / f"server-{uuid.uuid4().hex[:12]}.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump({"api-key": api_key}, f)
    return path


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
    groups = _gpu_groups(num_servers, tp_size, gpu_ids)
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
    groups = _gpu_groups(num_servers, tp_size, gpu_ids)
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


_ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}
HINT_SCAN_BYTES = 1 << 16  # of a server's log read for a known start-up failure; the message quotes less


def _sglang_label(command: LaunchCommand, index: int) -> str:
    """Pidfile label: ``sglang router`` or ``<engine> <index>``."""
    return "sglang router" if "sglang_router.launch_server" in command.argv else f"{command.engine} {index}"


class SGLangServers:
    """Start SGLang servers (or a router) from :class:`LaunchCommand` s; wait for ``/health_generate``.

    ``/health_generate`` runs a one-token generation, so a hung scheduler does not pass. Logs go to
    ``log_dir/sglang_<i>.log``; the launch line written at the top of each log is the redacted one.

    Each port is checked free before its server starts, and no request (no key) goes to it before the
    socket listening there belongs to the server's session (see the module docstring): a process that
    takes the port first is refused with a :class:`~dflash_assets.generation.processes.sessions.PortTakenError`.

    Args:
        commands: from :func:`build_sglang_commands` or ``[build_router_command(...)]``.
        log_dir: directory for the logs.
        api_key: the key value; written to each server's key file (``--config``) and sent with the health
            probes. None reads the command's ``api_key_env`` from ``os.environ``.
        startup_timeout_s: seconds to wait for every server (loading a 27B model plus CUDA-graph capture
            takes minutes).
        parent_death_signal: kill each server (launcher process) when this process dies (Linux).

    Attributes (inside ``with``): ``base_urls`` (``http://host:port/v1``, in command order). ``guard_group``
    (class attribute): start each server under :mod:`~dflash_assets.generation.servers.group_guard`, so its children
    die with this process too (vLLM's; SGLang's children set their own parent-death signal).

    Raises (on enter):
        KeyError: a command names a key variable that is neither given nor set.
        PortTakenError: a port is held by another process (before launch, or taken while loading).
        RuntimeError: a server exited before it was healthy (message holds its log tail).
        TimeoutError: not all healthy within ``startup_timeout_s``.
    """

    guard_group = False

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
        self._key_dir: Path | None = None  # 0700 directory of the key files (removed on stop)
        self._key_files: dict[int, Path] = {}
        self._key_record: Path | None = None  # its registry entry, for the orphan reaper

    @property
    def base_urls(self) -> list[str]:
        return [c.base_url for c in self.commands]

    def log_path(self, i: int) -> Path:
        """Log file of server ``i``: ``<engine>_<i>.log`` (``sglang_0.log``, ``vllm_0.log``)."""
        return self.log_dir / f"{self.commands[i].engine}_{i}.log"

    def __enter__(self) -> SGLangServers:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for command in self.commands:  # all ports first: refuse before anything starts
                check_port_free(command.host, command.port, "the SGLang server to start there")
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
        with open(self.log_path(i), "a") as log:
            log.write(f"# launch: {command.redacted()}\n")
        key = self._launch_key(command)
        key_config = None
        env = {**os.environ, **command.env}
        if command.api_key_env:
            env.pop(command.api_key_env, None)  # the server gets its key one way only
            if not key:
                raise KeyError(f"environment variable {command.api_key_env} (the server API key) is not set")
        if command.api_key_env and command.key_env_var:
            env[command.key_env_var] = key
        elif command.api_key_env:
            if self._key_dir is None:
                self._key_dir = Path(tempfile.mkdtemp(prefix=KEY_DIR_PREFIX))  # mode 0700
                # a kill -9 of this launcher skips stop(): the reaper removes the directory then
                self._key_record = register_key_dir(self._key_dir)
            self._drop_key_file(i)
            key_config = self._key_files[i] = write_key_config(self._key_dir, key)
        argv = command.launch_argv(key_config)
        guarded = self.guard_group and self.parent_death_signal
        if guarded:  # the guard leads the session and takes the whole group down with this launcher
            argv = [sys.executable, str(Path(__file__).with_name("group_guard.py")), *argv]
        return start_process(
            argv,
            env,
            self.log_path(i),
            port=command.port,
            label=_sglang_label(command, i),
            parent_death_signal=self.parent_death_signal and not guarded,
            secrets=[key] if key else [],
        )

    def _drop_key_file(self, i: int) -> None:
        path = self._key_files.pop(i, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def _launch_key(self, command: LaunchCommand) -> str | None:
        """The key ``command`` is launched with (``api_key``, else its variable in os.environ), or None."""
        if not command.api_key_env:
            return None
        return self.api_key or os.environ.get(command.api_key_env) or None

    def exit_code(self, i: int) -> int | None:
        """Exit code of server ``i`` when its process has exited (killed, crashed), else None."""
        procs = self._procs
        return procs[i].poll() if i < len(procs) else None

    def restart(self, i: int) -> float:
        """Stop server ``i`` (its whole process group), start it again with the same command and wait
        until it generates. Returns the seconds it took. Safe from any thread (one restart per server
        at a time). Raises as :meth:`__enter__` (PortTakenError, RuntimeError, TimeoutError)."""
        started = time.monotonic()
        with self._lock:
            if self._closed:
                raise RuntimeError("servers are stopping: not restarted")
            stop_process_group(self._procs[i], grace_s=5.0)
            command = self.commands[i]
            check_port_free(command.host, command.port, "the SGLang server to start there", wait_s=10.0)
            self._procs[i] = self._launch(i)
        self._wait_healthy([i])
        return time.monotonic() - started

    def stop(self) -> None:
        """Terminate every server's process group (SIGTERM, then SIGKILL after 30 s) and remove the key
        files. Idempotent."""
        with self._lock:
            self._closed = True
            procs, self._procs = self._procs, []
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            stop_process_group(proc, grace_s=30.0)
        if self._key_dir is not None:
            shutil.rmtree(self._key_dir, ignore_errors=True)
            self._key_dir, self._key_files = None, {}
        if self._key_record is not None:
            self._key_record.unlink(missing_ok=True)
            self._key_record = None

    def exit_hint(self, command: LaunchCommand, tail: str) -> str:
        """What to do about a server that exited before it was healthy, from its log tail ("" when nothing
        known matches)."""
        if "--config" in tail and command.api_key_env and "unrecognized arguments" in tail:
            return (
                "; this SGLang takes no --config file, which carries the API key (kept off the command "
                "line): upgrade SGLang, or run without a key"
            )
        return ""

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
                    tail = redact(log_tail(self.log_path(i)), self._launch_key(command))
                    # the cause can sit far above the last lines (vLLM re-raises it as a config error)
                    hint = self.exit_hint(command, log_tail(self.log_path(i), HINT_SCAN_BYTES))
                    raise RuntimeError(
                        f"{_ENGINE_NAMES.get(command.engine, command.engine)} server {i} ({command.base_url}) "
                        f"exited with code {proc.returncode}"
                        f"{hint}; log {self.log_path(i)}:\n{tail}"
                    )
                # nothing is sent before the listener is provably this server's (raises when another holds it)
                engine = _ENGINE_NAMES.get(command.engine, command.engine)
                if not listener_is_ours(command.host, command.port, proc.pid, f"{engine} server {i}"):
                    continue
                try:
                    r = httpx.get(origin(command.base_url) + self.health_path, headers=headers, timeout=30)
                    if r.status_code == 200:
                        del pending[i]
                        self._drop_key_file(i)  # read at start-up; a restart writes a new one
                except httpx.TransportError:
                    pass
            if pending and time.monotonic() > deadline:
                urls = [c.base_url for c in pending.values()]
                engine = _ENGINE_NAMES.get(self.commands[0].engine, "SGLang")
                raise TimeoutError(
                    f"{engine} servers {urls} not healthy after {self.startup_timeout_s:.0f} s; logs in {self.log_dir}"
                )
            if pending:
                # polling is cheap (one GET per pending server); a long pause is idle GPUs after start-up
                time.sleep(self.health_poll_s)
