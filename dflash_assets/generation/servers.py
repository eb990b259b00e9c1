"""Inference-server launchers: ``transformers serve`` on CPU (the embedded default) and SGLang on GPUs.

No Dagster here: ``dflash_assets.resources.inference`` wraps these for the pipeline.

Two launchers, both context managers that start subprocesses in their own process groups, wait until
a *generation* succeeds (a 200 from ``/health`` alone can hide a hung generator) and kill the groups on
exit:

- :class:`LocalTransformersServer`: one ``transformers serve DIR --device cpu --continuous-batching``.
- :class:`SGLangServers`: N ``python -m sglang.launch_server`` processes (one per GPU or TP group) from
  :func:`build_sglang_commands`, or one ``python -m sglang_router.launch_server --dp-size N`` from
  :func:`build_router_command`.

What ``transformers serve`` (transformers 5.24, measured with SmolLM2-135M-Instruct) returns and accepts:

- ``finish_reason`` is ``"length"`` when ``completion_tokens >= max_tokens``, else ``"stop"`` (also
  ``"tool_calls"`` when a tool call is parsed). ``usage.prompt_tokens`` is the length of the
  chat-templated prompt (``add_generation_prompt=True``); ``usage.completion_tokens`` counts the
  generated ids *including* the end-of-turn token (``<|im_end|>``) on a ``stop``. ``message.content`` is
  decoded with ``skip_special_tokens=True``.
- ``chat_template_kwargs`` is accepted and forwarded to ``apply_chat_template`` (SmolLM2's template
  ignores ``enable_thinking``).
- ``message.reasoning_content`` appears only for model types with a response template (the Qwen2/Qwen3
  families); for SmolLM2 (llama) it is absent and all text is in ``content``.
- No generated token ids: ``logprobs``/``top_logprobs`` are accepted and ignored (so are
  ``presence_penalty``, ``n``, ``stream_options`` ...), and no ``return_token_ids`` field exists.
  Callers re-tokenize ``content`` (and add the end-of-turn token on ``stop``).
- Request fields outside the OpenAI schema are rejected with HTTP 422: ``top_k``, ``min_p`` and
  ``repetition_penalty`` among them; only ``seed``, ``chat_template_kwargs`` and ``generation_config``
  (a JSON *string* of ``GenerationConfig`` fields) are extra. :data:`TRANSFORMERS_SERVE_REJECTED_FIELDS`.
- ``model`` must equal the served directory string (:attr:`LocalTransformersServer.model_name`) or be
  omitted; another name gets HTTP 400. ``/v1/models`` lists that string as the id.
- With ``--continuous-batching`` the sampling configuration (``do_sample``, temperature, top_p, top_k)
  is fixed by the *first* request for the server's whole life; later requests only set
  ``max_tokens`` (per request) — their temperature/top_p/seed are ignored. ``temperature`` alone never
  turns sampling on: ``do_sample`` comes from the model's ``generation_config.json`` (absent for
  SmolLM2, so it decodes greedily) or from a ``generation_config`` field. Hence the startup probe,
  which is the first request, carries the sampling the server must use (``settings=``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from dflash_assets.settings import GenerationSettings

#: Request fields ``transformers serve`` rejects with HTTP 422 (not in the OpenAI chat schema).
TRANSFORMERS_SERVE_REJECTED_FIELDS = frozenset({"top_k", "min_p", "repetition_penalty"})

#: Tokens per KV-cache block of transformers' continuous batching (ContinuousBatchingConfig.page_size default).
CB_PAGE_SIZE = 256

#: Environment variable that holds the inference servers' API key (its value never goes into logs).
API_KEY_ENV = "DFLASH_SERVER_API_KEY"

Backend = Literal["transformers", "sglang", "openai"]


@dataclass(frozen=True)
class ServerPool:
    """Where the completions client sends requests.

    Attributes:
        base_urls: OpenAI base URLs ending in ``/v1`` (``POST {base_url}/chat/completions``).
        model: the ``model`` value requests must carry.
        api_key: sent as ``Authorization: Bearer <api_key>`` when not None.
        max_running_requests: client concurrency *per base URL* (requests in flight at once).
        backend: which server answers, so the client can drop fields it rejects (:meth:`adapt_body`).
    """

    base_urls: list[str]
    model: str
    api_key: str | None = None
    max_running_requests: int = 16
    backend: Backend = "openai"

    def headers(self) -> dict[str, str]:
        """HTTP headers for every request (the bearer token when an API key is set)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def adapt_body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Return ``body`` minus the fields this backend rejects.

        For ``transformers serve`` that is :data:`TRANSFORMERS_SERVE_REJECTED_FIELDS` (HTTP 422 otherwise);
        its sampling was fixed at startup by the probe (see the module docstring). Others: unchanged copy.
        """
        if self.backend == "transformers":
            return {k: v for k, v in body.items() if k not in TRANSFORMERS_SERVE_REJECTED_FIELDS}
        return dict(body)

    def __repr__(self) -> str:  # keep the key out of logs
        key = "None" if self.api_key is None else "'***'"
        return (
            f"ServerPool(base_urls={self.base_urls!r}, model={self.model!r}, api_key={key}, "
            f"max_running_requests={self.max_running_requests}, backend={self.backend!r})"
        )


# --------------------------------------------------------------------------------------------------
# process and HTTP helpers


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` now (another process may still take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path | str | None, max_bytes: int = 4000) -> str:
    """The last ``max_bytes`` bytes of a log file as text ('' when missing)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _start_process(argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen:
    """Start ``argv`` in a new session (own process group) with stdout+stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(env), start_new_session=True,
        )


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
    """SIGTERM the process group of ``proc``, wait up to ``grace_s`` seconds, then SIGKILL it.

    The group is signalled even when the leader has already exited, so orphaned workers (SGLang's
    scheduler/detokenizer processes) die too. Returns the leader's exit code (None if unknown).
    """
    pgid = proc.pid  # start_new_session=True makes the leader's pid the group id
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)  # leftovers in the group, or a leader that ignored SIGTERM
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    return proc.returncode


def probe_chat(
    base_url: str,
    model: str,
    api_key: str | None = None,
    timeout_s: float = 60.0,
    extra_body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Send one tiny ``/chat/completions`` request (``max_tokens=2``) and return the decoded reply.

    Raises:
        httpx.TransportError: the server is not reachable (yet), or did not answer in ``timeout_s`` s.
        RuntimeError: it answered with an HTTP error or a reply without ``choices``.
    """
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    body.update(extra_body or {})
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.post(f"{base_url.rstrip('/')}/chat/completions", json=body, headers=headers, timeout=timeout_s)
    if r.status_code != 200:
        raise RuntimeError(f"probe of {base_url} got HTTP {r.status_code}: {r.text[:500]}")
    reply = r.json()
    if not reply.get("choices"):
        raise RuntimeError(f"probe of {base_url} got a reply without choices: {str(reply)[:500]}")
    return reply


def _origin(base_url: str) -> str:
    """``http://h:p/v1`` -> ``http://h:p`` (SGLang's health routes are not under /v1)."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


# --------------------------------------------------------------------------------------------------
# transformers serve (CPU)


def transformers_executable() -> list[str]:
    """argv prefix that runs the ``transformers`` CLI of this interpreter's environment."""
    script = Path(sys.executable).with_name("transformers")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; sys.exit(main())"]


def transformers_generation_config(model_dir: Path | str, settings: GenerationSettings | None) -> dict[str, Any]:
    """``GenerationConfig`` fields for the startup probe: the model's ``generation_config.json``
    (eos/pad ids) overlaid with ``settings``' sampling (``do_sample = temperature > 0``).

    Empty when ``settings`` is None: the server then keeps the model's own defaults (greedy for SmolLM2).
    """
    if settings is None:
        return {}
    path = Path(model_dir) / "generation_config.json"
    config: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    config = {k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"}
    config["do_sample"] = settings.temperature > 0
    if settings.temperature > 0:
        config.update(temperature=settings.temperature, top_p=settings.top_p)
        config["top_k"] = max(settings.top_k, 0)  # 0 disables top-k in transformers
        if settings.min_p > 0:
            config["min_p"] = settings.min_p
    if settings.repetition_penalty != 1.0:
        config["repetition_penalty"] = settings.repetition_penalty
    return config


class LocalTransformersServer:
    """``transformers serve <model_dir> --device cpu --continuous-batching`` as a context manager.

    Args:
        model_dir: HF model directory (e.g. :func:`dflash_assets.generation.local_model.ensure_local_model`).
        host: listen address.
        port: listen port; a free one is picked when None.
        log_path: file for the server's stdout+stderr; a temporary file when None.
        extra_args: more ``transformers serve`` flags (e.g. ``("--cb-max-batch-tokens", "512")``).
        settings: sampling the server is frozen with (sent by the startup probe, the first request;
            see the module docstring). None keeps the model's defaults: greedy for SmolLM2.
        kv_cache_tokens: KV-cache capacity in tokens (``--cb-num-blocks`` = ceil(tokens / 256), 256 being
            the default ``page_size``). Left to transformers (None) the CPU cache takes 60 % of free RAM:
            ~10 GB RSS measured on a 24 GB machine, vs ~2.8 GB with 32768 tokens and 2048 batch tokens.
            SmolLM2 fp32 KV is 30 layers x 2 x 3 heads x 64 x 4 B = 46 KB per token.
        max_batch_tokens: tokens per forward step (``--cb-max-batch-tokens``); None = transformers' 8192.
        startup_timeout_s: seconds to wait for the first successful generation.
        env: extra environment variables for the server (the hub is always switched off;
            ``OMP_NUM_THREADS`` defaults to 1, override it here).

    Attributes (valid inside ``with``):
        base_url: ``http://HOST:PORT/v1``.
        model_name: the ``model`` value requests must carry: ``str(model_dir)``, the string the server
            was started with (it answers HTTP 400 to any other name).
        startup_s: seconds from process start to the first successful generation.

    Raises (on enter):
        RuntimeError: ``fastapi`` is missing, the server exited, or it answered the probe with an error;
            the message holds the tail of the server log.
        TimeoutError: no successful generation within ``startup_timeout_s``; message holds the log tail.
    """

    def __init__(
        self,
        model_dir: Path | str,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: Path | str | None = None,
        extra_args: Sequence[str] = (),
        settings: GenerationSettings | None = None,
        startup_timeout_s: float = 300.0,
        env: Mapping[str, str] | None = None,
        kv_cache_tokens: int | None = 32768,
        max_batch_tokens: int | None = 2048,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.kv_cache_tokens = kv_cache_tokens
        self.max_batch_tokens = max_batch_tokens
        self.host = host
        self.port = port or free_port(host)
        self.log_path = Path(log_path) if log_path else None
        self.extra_args = tuple(extra_args)
        self.settings = settings
        self.startup_timeout_s = startup_timeout_s
        self.env = dict(env or {})
        self.startup_s: float | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def model_name(self) -> str:
        return str(self.model_dir)

    def argv(self) -> list[str]:
        """The full command line (no secrets in it)."""
        sizing = []
        if self.kv_cache_tokens is not None and "--cb-num-blocks" not in self.extra_args:
            sizing += ["--cb-num-blocks", str(-(-self.kv_cache_tokens // CB_PAGE_SIZE))]
        if self.max_batch_tokens is not None and "--cb-max-batch-tokens" not in self.extra_args:
            sizing += ["--cb-max-batch-tokens", str(self.max_batch_tokens)]
        return [
            *transformers_executable(), "serve", str(self.model_dir),
            "--host", self.host, "--port", str(self.port),
            "--device", "cpu", "--continuous-batching", *sizing, *self.extra_args,
        ]

    def pool(self, max_running_requests: int = 16) -> ServerPool:
        """This server as a :class:`ServerPool` (``backend="transformers"``)."""
        return ServerPool([self.base_url], self.model_name, None, max_running_requests, "transformers")

    def __enter__(self) -> LocalTransformersServer:
        if importlib.util.find_spec("fastapi") is None:
            raise RuntimeError(
                "`transformers serve` needs fastapi, which is not installed: pip install 'transformers[serving]'"
            )
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_dir} is not an HF model directory (no config.json)")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="transformers_serve_", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        # One intra-op thread by default: on a 2-core machine shared with the pipeline process, the
        # default (all cores) made generation ~7x slower from oversubscription (measured, bench_completions).
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", **self.env}
        started = time.monotonic()
        self._proc = _start_process(self.argv(), env, self.log_path)
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Terminate the server's process group (SIGTERM, then SIGKILL after 10 s). Idempotent."""
        if self._proc is not None:
            stop_process_group(self._proc)
            self._proc = None

    def _wait_ready(self, started: float) -> None:
        generation_config = transformers_generation_config(self.model_dir, self.settings)
        extra = {"generation_config": json.dumps(generation_config)} if generation_config else {}
        deadline = started + self.startup_timeout_s
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"transformers serve exited with code {self._proc.returncode} before answering; "
                    f"log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"transformers serve at {self.base_url} did not finish a generation within "
                    f"{self.startup_timeout_s:.0f} s; log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            try:
                # The first request also builds the continuous batcher (~10 s on 2 cores).
                probe_chat(self.base_url, self.model_name, timeout_s=remaining, extra_body=extra)
                return
            except httpx.TransportError:
                time.sleep(0.5)
            except RuntimeError as e:
                raise RuntimeError(f"{e}\nlog {self.log_path}:\n{log_tail(self.log_path)}") from None


# --------------------------------------------------------------------------------------------------
# SGLang (GPU)


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
) -> list[LaunchCommand]:
    """One ``python -m sglang.launch_server`` per GPU (or per group of ``tp_size`` GPUs).

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
        argv = (python, "-m", "sglang.launch_server", *flags, "--host", host, "--port", str(port), *extra_args)
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
    ) -> None:
        self.commands = list(commands)
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
            for i, command in enumerate(self.commands):
                log_path = self.log_dir / f"sglang_{i}.log"
                with open(log_path, "a") as log:
                    log.write(f"# launch: {command.redacted()}\n")
                argv = command.launch_argv(self._environ(command))
                self._procs.append(_start_process(argv, {**os.environ, **command.env}, log_path))
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Terminate every server's process group (SIGTERM, then SIGKILL after 30 s). Idempotent."""
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._procs:
            stop_process_group(proc, grace_s=30.0)
        self._procs = []

    def _wait_healthy(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        pending = dict(enumerate(self.commands))
        deadline = time.monotonic() + self.startup_timeout_s
        while pending:
            for i, command in list(pending.items()):
                proc = self._procs[i]
                if proc.poll() is not None:
                    log_path = self.log_dir / f"sglang_{i}.log"
                    raise RuntimeError(
                        f"SGLang server {i} ({command.base_url}) exited with code {proc.returncode}; "
                        f"log {log_path}:\n{log_tail(log_path)}"
                    )
                try:
                    r = httpx.get(_origin(command.base_url) + self.health_path, headers=headers, timeout=30)
                    if r.status_code == 200:
                        del pending[i]
                except httpx.TransportError:
                    pass
            if pending and time.monotonic() > deadline:
                urls = [c.base_url for c in pending.values()]
                raise TimeoutError(f"SGLang servers {urls} not healthy after {self.startup_timeout_s:.0f} s; "
                                   f"logs in {self.log_dir}")
            if pending:
                time.sleep(5)
