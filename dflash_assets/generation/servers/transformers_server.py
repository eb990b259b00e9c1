"""``transformers serve`` on CPU: the embedded default's inference server, as a context manager.

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
- Continuous batching serves only models whose ``layer_types`` are full or sliding attention: transformers
  5.24 answers HTTP 500 "Invalid layer type: linear_attention" to a hybrid (Qwen3.5/3.6) model, on the first
  request. Such a model is served without ``--continuous-batching`` (:func:`continuous_batching_refusal`):
  ``model.generate`` on one inference thread, one request at a time, each request's own ``temperature`` /
  ``top_p`` / ``seed`` and ``generation_config`` honoured; the pool then sends the whole sampling as a
  per-request ``generation_config`` (``do_sample`` and ``top_k`` are not request fields).

The server starts in its own process group, is registered for the orphan reaper
(:mod:`dflash_assets.generation.servers.registry`) and counts as up only once a *generation* succeeds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.processes.ports import check_port_free, free_port, listener_is_ours
from dflash_assets.generation.processes.sessions import log_tail, stop_process_group
from dflash_assets.generation.servers.pool import ServerPool
from dflash_assets.generation.servers.probe import probe_chat
from dflash_assets.generation.servers.registry import start_process

__all__ = ["CB_PAGE_SIZE", "LocalTransformersServer", "transformers_executable", "transformers_generation_config"]

#: Tokens per KV-cache block of transformers' continuous batching (ContinuousBatchingConfig.page_size default).
CB_PAGE_SIZE = 256


def _cb_layer_types() -> frozenset[str]:
    """Layer types transformers' continuous batching has a cache for (its ``ATTN_TYPE_TO_ALLOCATOR``)."""
    try:
        from transformers.generation.continuous_batching.cache import ATTN_TYPE_TO_ALLOCATOR
    except ImportError:  # moved in another version: the two 5.24 has
        return frozenset({"full_attention", "sliding_attention"})
    return frozenset(ATTN_TYPE_TO_ALLOCATOR)


def continuous_batching_refusal(model_dir: Path | str) -> str | None:
    """Why ``transformers serve --continuous-batching`` cannot serve the model in ``model_dir``, or None.

    Reads ``config.json`` (a multimodal wrapper's ``text_config``): a ``layer_types`` entry that continuous
    batching has no cache for (``linear_attention`` of Qwen3.5/3.6) makes it fail every request. No
    ``config.json``: None (the server's own start-up reports the missing file).
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    text = config.get("text_config") or config
    unsupported = sorted(set(text.get("layer_types") or []) - _cb_layer_types())
    if unsupported:
        return (
            f"{path}: layer_types {unsupported} have no continuous-batching cache in transformers "
            "(it answers 'Invalid layer type'); served one request at a time"
        )
    return None


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


def model_dir_with_template(model_dir: Path, chat_template: Path) -> Path:
    """A new temporary directory of symbolic links to ``model_dir``'s files, except ``chat_template.jinja`` (a copy
    of ``chat_template``'s text) and ``tokenizer_config.json`` (a copy without its ``chat_template`` key): a model
    directory whose tokenizer renders with ``chat_template``. The caller removes it.

    Raises:
        ChatTemplateError: ``chat_template`` cannot be read
            (:func:`~dflash_assets.generation.engines.chat_render.read_chat_template`).
    """
    from dflash_assets.generation.engines.chat_render import read_chat_template

    text = read_chat_template(chat_template)
    out = Path(tempfile.mkdtemp(prefix=f"{model_dir.name}.template."))
    for item in model_dir.iterdir():
        if item.name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
            continue
        (out / item.name).symlink_to(item.resolve())
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        data.pop("chat_template", None)
        (out / "tokenizer_config.json").write_text(json.dumps(data, indent=2))
    (out / "chat_template.jinja").write_text(text)
    return out


class LocalTransformersServer:
    """``transformers serve <model_dir> --device cpu [--continuous-batching]`` as a context manager.

    Args:
        model_dir: HF model directory (e.g. :func:`dflash_assets.generation.engines.local_model.ensure_local_model`).
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
        parent_death_signal: kill the server when this process dies (Linux; see
            :func:`~dflash_assets.generation.processes.sessions.spawn_in_new_session`). Off only to let a server outlive
            its launcher (tests of :func:`reap_orphaned_servers`).
        continuous_batching: pass ``--continuous-batching`` (and the ``--cb-*`` sizing); None: unless
            :func:`continuous_batching_refusal` names a reason (hybrid linear-attention models).
        chat_template: a Jinja chat-template file the server renders with instead of the model's own
            (``target_model.chat_template``). ``transformers serve`` has no flag for it: the server is given a
            directory of links to the model's files whose ``chat_template.jinja`` is this file (and whose
            ``tokenizer_config.json`` holds no template), made on enter and removed on exit.

    Attributes (valid inside ``with``):
        base_url: ``http://HOST:PORT/v1``.
        model_name: the ``model`` value requests must carry: ``str(model_dir)``, the string the server
            was started with (it answers HTTP 400 to any other name).
        startup_s: seconds from process start to the first successful generation.

    Raises (on enter):
        PortTakenError: the port is held by another process, before launch or while the server loads
            (nothing is sent to it: see :func:`~dflash_assets.generation.processes.ports.listener_is_ours`).
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
        parent_death_signal: bool = True,
        continuous_batching: bool | None = None,
        chat_template: Path | str | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.chat_template = Path(chat_template) if chat_template is not None else None
        self._served_dir: Path | None = None  # the model directory with chat_template, while entered
        self.continuous_batching = (
            continuous_batching_refusal(model_dir) is None if continuous_batching is None else continuous_batching
        )
        self.parent_death_signal = parent_death_signal
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
        return str(self._served_dir or self.model_dir)

    def argv(self) -> list[str]:
        """The full command line (no secrets in it)."""
        base = [
            *transformers_executable(),
            "serve",
            self.model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--device",
            "cpu",
        ]
        if not self.continuous_batching:
            return [*base, *self.extra_args]
        sizing = []
        if self.kv_cache_tokens is not None and "--cb-num-blocks" not in self.extra_args:
            sizing += ["--cb-num-blocks", str(-(-self.kv_cache_tokens // CB_PAGE_SIZE))]
        if self.max_batch_tokens is not None and "--cb-max-batch-tokens" not in self.extra_args:
            sizing += ["--cb-max-batch-tokens", str(self.max_batch_tokens)]
        return [*base, "--continuous-batching", *sizing, *self.extra_args]

    def pool(self, max_running_requests: int = 16) -> ServerPool:
        """This server as a :class:`ServerPool` (``backend="transformers"``). Without continuous batching and
        with ``settings``, every request carries them as its ``generation_config`` (see the module docstring)."""
        extra = {}
        if not self.continuous_batching and self.settings is not None:
            extra = {"generation_config": json.dumps(transformers_generation_config(self.model_dir, self.settings))}
        return ServerPool(
            [self.base_url], self.model_name, None, max_running_requests, "transformers", extra_body=extra
        )

    def __enter__(self) -> LocalTransformersServer:
        if importlib.util.find_spec("fastapi") is None:
            raise RuntimeError(
                "`transformers serve` needs fastapi, which is not installed: pip install 'transformers[serving]'"
            )
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_dir} is not an HF model directory (no config.json)")
        if self.chat_template is not None:
            self._served_dir = model_dir_with_template(self.model_dir, self.chat_template)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="transformers_serve_", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        # One intra-op thread by default: on a 2-core machine shared with the pipeline process, the
        # default (all cores) made generation ~7x slower from oversubscription (measured, bench_completions).
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", **self.env}
        # the port must be free now, and the probe (prompts, sampling) goes only to the socket of our own child
        check_port_free(self.host, self.port, "the transformers serve to start there")
        started = time.monotonic()
        self._proc = start_process(
            self.argv(),
            env,
            self.log_path,
            port=self.port,
            label="transformers serve",
            parent_death_signal=self.parent_death_signal,
        )
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
        if self._served_dir is not None:
            shutil.rmtree(self._served_dir, ignore_errors=True)
            self._served_dir = None

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
            if not listener_is_ours(self.host, self.port, self._proc.pid, "transformers serve"):
                time.sleep(0.5)  # still loading (it binds once the model is loaded)
                continue
            try:
                # The first request also builds the continuous batcher (~10 s on 2 cores).
                probe_chat(self.base_url, self.model_name, timeout_s=remaining, extra_body=extra)
                return
            except httpx.TransportError:
                time.sleep(0.5)
            except RuntimeError as e:
                raise RuntimeError(f"{e}\nlog {self.log_path}:\n{log_tail(self.log_path)}") from None
