"""The group of inference servers an engine's launcher starts, neutral to the engine: one server process to start
(:class:`LaunchCommand`), the API key's file for engines that read it from ``--config`` (:func:`write_key_config`),
GPUs split into groups per server (:func:`gpu_groups`) and the lifecycle every launcher shares
(:class:`ServerGroup`: start in a process group of its own, health wait, restart, stop), which SGLang's and
vLLM's launchers extend (:mod:`~dflash_assets.generation.servers.sglang_servers`,
:mod:`~dflash_assets.generation.servers.vllm_servers`).

The API key never goes on a command line (any local user reads those in ``ps``): it reaches a server through
a file only this user reads (SGLang's ``--config``) or through the server's environment (vLLM's
``VLLM_API_KEY``), as its :class:`LaunchCommand` says.

A server is trusted only once it is provably the process started for it: its port must be free before
launch, and no request (and no key) goes to the port before the socket listening there belongs to the
server's own session (:func:`~dflash_assets.generation.processes.ports.listener_is_ours`).
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


def gpu_groups(num_servers: int, tp_size: int, gpu_ids: Sequence[int] | None) -> list[list[int]]:
    """Split ``gpu_ids`` (default ``0..num_servers*tp_size-1``) into ``num_servers`` groups of ``tp_size``."""
    if num_servers < 1 or tp_size < 1:
        raise ValueError(f"num_servers ({num_servers}) and tp_size ({tp_size}) must be >= 1")
    ids = list(gpu_ids) if gpu_ids is not None else list(range(num_servers * tp_size))
    if len(ids) != num_servers * tp_size:
        raise ValueError(f"{num_servers} servers x tp_size {tp_size} need {num_servers * tp_size} GPUs, got {ids}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"gpu_ids has duplicates: {ids}")
    return [ids[i * tp_size : (i + 1) * tp_size] for i in range(num_servers)]


_ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}
HINT_SCAN_BYTES = 1 << 16  # of a server's log read for a known start-up failure; the message quotes less


def engine_name(command: LaunchCommand) -> str:
    """The engine of ``command`` as messages name it (``SGLang``, ``vLLM``)."""
    return _ENGINE_NAMES.get(command.engine, command.engine)


class ServerGroup:
    """Inference servers started from :class:`LaunchCommand` s, each in its own process group (registered for the
    orphan reaper), waited for until ``health_path`` answers 200, restarted one at a time on request and all
    stopped on exit: the lifecycle SGLang's and vLLM's launchers share
    (:class:`~dflash_assets.generation.servers.sglang_servers.SGLangServers`,
    :class:`~dflash_assets.generation.servers.vllm_servers.VLLMServers`), each adding its health path, start-up
    hints and labels. The launch line written at the top of each log
    (``log_dir/<engine>_<i>.log``) is the redacted one.

    Each port is checked free before its server starts, and no request (no key) goes to it before the
    socket listening there belongs to the server's session (see the module docstring): a process that
    takes the port first is refused with a :class:`~dflash_assets.generation.processes.ports.PortTakenError`.

    Args:
        commands: the servers to start (an engine's ``build_*_commands``).
        log_dir: directory for the logs.
        api_key: the key value; handed to each server as its command says (a key file named by ``--config``, or
            its environment) and sent with the health probes. None reads the command's ``api_key_env`` from
            ``os.environ``.
        startup_timeout_s: seconds to wait for every server (loading a 27B model plus CUDA-graph capture
            takes minutes).
        health_path: the path that answers 200 once a server is ready; None: the engine's :attr:`HEALTH_PATH`.
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
    #: The path that answers 200 once a server is ready, unless one is given.
    HEALTH_PATH = "/health"

    def __init__(
        self,
        commands: Sequence[LaunchCommand],
        log_dir: Path | str,
        api_key: str | None = None,
        startup_timeout_s: float = 1800.0,
        health_path: str | None = None,
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
        self.health_path = health_path or self.HEALTH_PATH
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

    def __enter__(self) -> ServerGroup:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for command in self.commands:  # all ports first: refuse before anything starts
                check_port_free(command.host, command.port, f"the {engine_name(command)} server to start there")
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
            label=self.label(command, i),
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
            check_port_free(
                command.host, command.port, f"the {engine_name(command)} server to start there", wait_s=10.0
            )
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

    def label(self, command: LaunchCommand, index: int) -> str:
        """Pidfile label of server ``index``: ``<engine> <index>``."""
        return f"{command.engine} {index}"

    def exit_hint(self, command: LaunchCommand, tail: str) -> str:
        """What to do about a server that exited before it was healthy, from its log tail ("" when nothing
        known matches); each engine says what it knows."""
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
                        f"{engine_name(command)} server {i} ({command.base_url}) "
                        f"exited with code {proc.returncode}"
                        f"{hint}; log {self.log_path(i)}:\n{tail}"
                    )
                # nothing is sent before the listener is provably this server's (raises when another holds it)
                engine = engine_name(command)
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
