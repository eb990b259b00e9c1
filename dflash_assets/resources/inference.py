"""The inference-server resource: where completions come from (local CPU server, SGLang on GPUs, or
servers someone else runs)."""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

import dagster as dg
from pydantic import ConfigDict, Field, field_validator

from dflash_assets.config import SECRET_ENV
from dflash_assets.dflash.target_layers import text_config
from dflash_assets.generation.engine_env import EngineEnvironment, vllm_environment
from dflash_assets.generation.local_model import DEFAULT_LOCAL_MODEL, LocalModelName
from dflash_assets.generation.ports import free_port_block
from dflash_assets.generation.probe import probe_external
from dflash_assets.generation.replies import MAX_REPLY_BYTES
from dflash_assets.generation.secret_args import refuse_secret_args
from dflash_assets.generation.server_registry import orphan_message, reap_orphaned_servers
from dflash_assets.generation.servers import API_KEY_ENV, ServerPool
from dflash_assets.generation.sglang_servers import (
    LaunchCommand,
    SGLangServers,
    build_router_command,
    build_sglang_commands,
)
from dflash_assets.generation.supervision import ProbeSupervisor, ProcessSupervisor
from dflash_assets.generation.transformers_server import LocalTransformersServer
from dflash_assets.generation.vllm_servers import VLLMServers, build_vllm_commands
from dflash_assets.resources.inference_sections import VLLMSettings
from dflash_assets.settings import GenerationSettings

__all__ = ["InferenceServerResource", "ServerPool"]

LOCAL_MAX_RUNNING_REQUESTS = 16  # measured best on 2 CPU cores (~55 output tok/s with 48-token replies)
SGLANG_MAX_RUNNING_REQUESTS = 40  # the production setting (16 -> 40 raised throughput on B200s)


class InferenceServerResource(dg.ConfigurableResource):
    """Inference servers for the ``completions`` stage.

    Modes:
        ``local`` (default): one ``transformers serve`` on CPU over ``local_model``: the embedded SmolLM2
            model, or the Qwen3.6-architecture stand-in (served without continuous batching, which has no
            cache for its linear-attention layers).
        ``sglang``: ``num_servers`` SGLang servers, one per GPU (``tp_size`` GPUs each), or one
            ``sglang_router`` with ``--dp-size num_servers`` when ``use_router``.
        ``vllm``: ``vllm.num_servers`` vLLM OpenAI servers (section ``vllm``,
            :class:`~dflash_assets.resources.inference_sections.VLLMSettings`) from vLLM's own environment, made
            on first use; on CPU over ``local_model`` unless ``vllm.model_path`` is set. Replies carry the
            generated token ids (``return_token_ids``), so rows are exact, as with SGLang.
        ``external``: servers already running at ``base_urls`` serving ``served_model_name``: any number of
            URLs on any number of hosts (requests go to the one with the fewest in flight; each row records
            its server), or one ``sglang_router`` URL with ``max_running_requests`` set to the total slots
            behind it.

    ``api_key`` comes from the environment only: ``api_key=dg.EnvVar("DFLASH_SERVER_API_KEY")`` (a value in
    the config file is refused); it is sent as a bearer token and, in ``sglang`` mode, given to the servers
    in a ``--config`` file only this user can read (never on a command line, where ``ps`` shows it to
    every local user; see :mod:`~dflash_assets.generation.sglang_servers`).

    ``max_running_requests`` is both the server's limit (SGLang ``--max-running-requests``, vLLM
    ``--max-num-seqs``) and the client's concurrency per server; None means 16 in local mode and vLLM on CPU
    (measured best for 2 cores) and 40 otherwise.
    """

    # a refused value (a key in extra_args) is not quoted back into the error, the UI or the logs
    model_config = ConfigDict(hide_input_in_errors=True)

    mode: Literal["local", "sglang", "vllm", "external"] = Field(default="local")
    # numbers and switches are strict: YAML `true` would otherwise become 1 slot, 1 server or a 1-token chunk
    api_key: str | None = Field(
        default=None,
        description="Server API key; set with EnvVar('DFLASH_SERVER_API_KEY').",
        json_schema_extra={SECRET_ENV: API_KEY_ENV},
    )  # a value in the config file is refused
    max_running_requests: int | None = Field(
        strict=True,
        default=None,
        ge=1,
        description="Requests in flight per server; None: 16 local and vLLM on CPU, 40 otherwise.",
    )
    startup_timeout_s: float = Field(
        strict=True, default=1800.0, gt=0, description="Seconds to wait for servers to generate."
    )

    # local
    local_model: LocalModelName = Field(
        default=DEFAULT_LOCAL_MODEL,
        description="local: the model served (made in the cache on first use); "
        "target_model.local_model must name the same one.",
    )

    # sglang
    model_path: str = Field(default="", description="sglang: HF model directory (also the tokenizer).")
    num_servers: int = Field(strict=True, default=1, ge=1, description="sglang: servers (data-parallel replicas).")
    gpu_ids: list[int] | None = Field(default=None, description="sglang: GPUs to use; None = 0..N*tp-1.")
    port_base: int = Field(
        strict=True, default=30000, description="sglang: server i listens on port_base + i (router: port_base)."
    )
    host: str = Field(default="127.0.0.1", description="sglang: listen address.")
    max_mamba_cache_size: int | None = Field(strict=True, default=None, description="sglang: --max-mamba-cache-size.")
    mem_fraction_static: float | None = Field(strict=True, default=None, description="sglang: --mem-fraction-static.")
    context_length: int | None = Field(strict=True, default=None, description="sglang: --context-length (tokens).")
    tp_size: int = Field(strict=True, default=1, ge=1, description="sglang: --tp-size, GPUs per server.")
    reasoning_parser: str | None = Field(default="qwen3", description="sglang: --reasoning-parser.")
    use_router: bool = Field(
        strict=True, default=False, description="sglang: one sglang_router --dp-size N instead of N servers."
    )
    extra_args: list[str] = Field(default_factory=list, description="sglang/local: extra server flags.")
    launch_module: str = Field(
        default="sglang.launch_server",
        description="sglang: module run as `python -m <module>` per server; "
        "dflash_assets.simulation.sglang_stub simulates a GPU server (benches).",
    )

    # vllm
    vllm: VLLMSettings = Field(
        default_factory=VLLMSettings,
        description="vllm: how the vLLM servers are launched (model_path, num_servers, device, packages, ...).",
    )

    # external
    base_urls: list[str] = Field(default_factory=list, description="external: OpenAI base URLs ending in /v1.")
    served_model_name: str = Field(default="", description="external: the model name requests carry.")
    external_tokenizer_path: str = Field(default="", description="external: the served model's dir, for tokenizing.")
    external_backend: Literal["openai", "sglang", "vllm", "transformers"] = Field(
        default="openai", description="external: what serves the URLs (decides which request fields are sent)."
    )

    # client (all modes)
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
        "re-sent to the others, restarted (sglang) or re-probed (external). Above the longest request "
        "(cap / per-request tok/s: 8192 / 87 = ~94 s on the user's GPUs). None: no hang detection.",
    )
    server_retry_s: float = Field(
        strict=True, default=30.0, gt=0, description="external: seconds between probes of a server left out."
    )
    max_server_restarts: int = Field(
        strict=True,
        default=5,
        ge=0,
        description="sglang: restarts of one server within an hour before it is left out (its log named) instead of "
        "restarted again: a server that crashes at every start is not restarted forever. 0: never restarted.",
    )
    continue_truncated: bool = Field(
        strict=True,
        default=True,
        description="After a cap raise, continue each row the old cap cut from the tokens it has (SGLang "
        "continue_final_message; sglang mode, or external_backend 'sglang') instead of regenerating it whole. "
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
        description="tail_chunk_tokens: prompts generated in chunks, per slot (servers x "
        "max_running_requests) of the run.",
    )

    @field_validator("extra_args")
    @classmethod
    def _no_secret_flags(cls, value: list[str]) -> list[str]:
        refuse_secret_args(value, "inference.extra_args")  # the key comes from DFLASH_SERVER_API_KEY only
        return value

    def backend(self) -> str:
        """What answers requests in this mode: ``transformers`` (local), ``sglang``, ``vllm``, or
        ``external_backend``."""
        return {"local": "transformers", "sglang": "sglang", "vllm": "vllm"}.get(self.mode, self.external_backend)

    def exposure_warnings(self) -> list[str]:
        """What these settings expose, one line each (never the key's value); empty when nothing:

        - ``sglang`` or ``vllm`` mode, the servers' host not loopback (``0.0.0.0``, a LAN address) and no API
          key: anyone who reaches the port can send requests (and read or spend the GPUs);
        - an API key sent over ``http://`` to a host that is not loopback (``external`` mode): it travels in
          clear text, readable by anyone on the path.

        ``serve`` logs them as warnings; ``completions`` keeps them in its metadata (``security_warnings``).
        """
        warnings = []
        if self.mode == "sglang" and not self.api_key and not _is_loopback(self.host):
            warnings.append(
                f"inference.host {self.host!r} with no API key: the servers take requests from anyone who can reach "
                f"port {self.port_base}; set {API_KEY_ENV}, or host: 127.0.0.1"
            )
        if self.mode == "vllm" and not self.api_key and not _is_loopback(self.vllm.host):
            warnings.append(
                f"inference.vllm.host {self.vllm.host!r} with no API key: the servers take requests from anyone who "
                f"can reach their ports; set {API_KEY_ENV}, or host: 127.0.0.1"
            )
        if self.mode == "external" and self.api_key:
            for url in self.base_urls:
                parsed = urlparse(url)
                if parsed.scheme == "http" and not _is_loopback(parsed.hostname or ""):
                    warnings.append(
                        f"the API key is sent in clear text over http:// to {parsed.hostname}: use https:// "
                        "(a TLS proxy in front of the server) or an SSH tunnel to a loopback port"
                    )
        return warnings

    def effective_max_running_requests(self) -> int:
        """Requests in flight per server: the configured value, else 16 (local, vLLM on CPU) or 40."""
        if self.max_running_requests is not None:
            return self.max_running_requests
        on_cpu = self.mode == "local" or (self.mode == "vllm" and self.vllm.device == "cpu")
        return LOCAL_MAX_RUNNING_REQUESTS if on_cpu else SGLANG_MAX_RUNNING_REQUESTS

    def sglang_commands(self, extra_args: Sequence[str] = (), use_router: bool | None = None) -> list[LaunchCommand]:
        """The launch commands ``serve`` uses in sglang mode (key by variable name, never by value).

        ``extra_args`` come after ``inference.extra_args`` (``drafter_evaluation`` adds the DFLASH flags);
        ``use_router`` overrides ``inference.use_router``."""
        if not self.model_path:
            raise ValueError("mode 'sglang' needs model_path")
        common = dict(
            model_path=self.model_path,
            num_servers=self.num_servers,
            gpu_ids=self.gpu_ids,
            host=self.host,
            max_running_requests=self.effective_max_running_requests(),
            max_mamba_cache_size=self.max_mamba_cache_size,
            mem_fraction_static=self.mem_fraction_static,
            context_length=self.context_length,
            tp_size=self.tp_size,
            reasoning_parser=self.reasoning_parser,
            api_key_env=API_KEY_ENV if self.api_key else None,
            extra_args=[*self.extra_args, *extra_args],
        )
        if self.use_router if use_router is None else use_router:
            return [build_router_command(port=self.port_base, **common)]
        return build_sglang_commands(port_base=self.port_base, module=self.launch_module, **common)

    def vllm_environment(self) -> EngineEnvironment:
        """The environment mode ``vllm`` runs its servers from (``vllm.packages`` minus ``vllm.remove_packages``,
        or ``vllm.python``); the same one ``drafter_evaluation``'s ``engine: vllm`` uses for the same pins."""
        v = self.vllm
        return vllm_environment(v.packages, v.remove_packages, v.python)

    def vllm_commands(self, python: str | Path, port_base: int | None = None) -> list[LaunchCommand]:
        """The launch commands ``serve`` uses in vllm mode: ``vllm.num_servers`` servers of the model
        :meth:`tokenizer_path` names, ``max_running_requests`` each (``--max-num-seqs``); the key by variable
        name, never by value.

        Args:
            python: the engine environment's interpreter.
            port_base: server i listens on ``port_base + i``; None: ``vllm.port_base``, else a free block.

        Raises:
            ValueError: ``gpu_ids`` that do not fit ``num_servers x tp_size``; SecretArgError: ``--api-key`` in
                ``vllm.extra_args``.
        """
        v = self.vllm
        if port_base is None:
            port_base = v.port_base if v.port_base is not None else free_port_block(v.num_servers, v.host)
        return build_vllm_commands(
            python,
            self.tokenizer_path(),
            v.num_servers,
            port_base,
            host=v.host,
            device=v.device,
            dtype=v.dtype,
            max_model_len=v.max_model_len,
            memory_fraction=v.memory_fraction,
            max_num_seqs=self.effective_max_running_requests(),
            tp_size=v.tp_size,
            gpu_ids=v.gpu_ids,
            reasoning_parser=v.reasoning_parser,
            api_key_env=API_KEY_ENV if self.api_key else None,
            extra_args=v.extra_args,
        )

    @contextlib.contextmanager
    def serve(self, log_dir: Path | str, settings: GenerationSettings | None = None) -> Iterator[ServerPool]:
        """Make servers ready, yield a :class:`ServerPool`, and stop what was started on exit.

        Args:
            log_dir: directory for server logs (``transformers_serve.log``, ``sglang_<i>.log``, ``vllm_<i>.log``).
            settings: local mode only: the sampling ``transformers serve`` is frozen with at startup
                (its continuous batcher keeps the first request's sampling); None = model defaults
                (greedy for SmolLM2). SGLang and vLLM honour per-request sampling, so they need none.

        Raises:
            RuntimeError, TimeoutError: a server did not start or failed the generation probe.
            EngineEnvironmentError (a RuntimeError): vllm mode, vLLM's environment could not be made.
            ValueError: the mode's required fields are missing.
        """
        for entry in reap_orphaned_servers():  # left by a killed run (UI, daemon or `run`) on this host
            dg.get_dagster_logger().warning(orphan_message(entry))
        for line in self.exposure_warnings():
            dg.get_dagster_logger().warning(line)
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        mrr = self.effective_max_running_requests()
        if self.mode == "local":
            from dflash_assets.generation.local_model import local_model_dir

            with LocalTransformersServer(
                local_model_dir(self.local_model),
                log_path=log_dir / "transformers_serve.log",
                extra_args=self.extra_args,
                settings=settings,
                startup_timeout_s=self.startup_timeout_s,
            ) as server:
                yield server.pool(mrr)
        elif self.mode == "external":
            if not self.base_urls or not self.served_model_name:
                raise ValueError("mode 'external' needs base_urls and served_model_name")
            for url in self.base_urls:
                probe_external(url, self.served_model_name, self.api_key, timeout_s=min(self.startup_timeout_s, 300.0))
            supervisor = ProbeSupervisor(self.base_urls, self.served_model_name, self.api_key, self.server_retry_s)
            yield ServerPool(
                list(self.base_urls),
                self.served_model_name,
                self.api_key,
                mrr,
                self.external_backend,
                supervisor=supervisor,
            )
        elif self.mode == "vllm":
            python = self.vllm_environment().ensure(dg.get_dagster_logger().info)  # first use: a few minutes
            commands = self.vllm_commands(python)
            dg.get_dagster_logger().info(f"starting {len(commands)} vLLM server(s): {commands[0].redacted()}")
            with VLLMServers(commands, log_dir, self.api_key, self.startup_timeout_s) as servers:
                yield ServerPool(
                    servers.base_urls,
                    str(self.tokenizer_path()),
                    self.api_key,
                    mrr,
                    "vllm",
                    supervisor=ProcessSupervisor(servers, self.server_retry_s, self.max_server_restarts),
                )
        else:
            commands = self.sglang_commands()
            with SGLangServers(commands, log_dir, self.api_key, self.startup_timeout_s) as servers:
                # Behind a router one URL fronts num_servers servers: scale its concurrency to match.
                per_url = mrr * self.num_servers if self.use_router else mrr
                yield ServerPool(
                    servers.base_urls,
                    self.model_path,
                    self.api_key,
                    per_url,
                    "sglang",
                    supervisor=ProcessSupervisor(servers, self.server_retry_s, self.max_server_restarts),
                )

    def client(self, pool: ServerPool):
        """A :class:`CompletionClient` for ``pool``: concurrency = servers x max_running_requests."""
        from dflash_assets.generation.client import CompletionClient

        return CompletionClient(
            pool.base_urls,
            api_key=pool.api_key,
            concurrency=pool.max_running_requests * len(pool.base_urls),
            read_timeout_s=self.request_timeout_s,
            request_timeout_s=self.request_timeout_s,
            max_attempts=self.max_attempts,
            backoff_base_s=self.backoff_base_s,
            max_consecutive_failures=self.max_consecutive_failures,
            supervisor=pool.supervisor,
            stall_timeout_s=self.stall_timeout_s,
            max_reply_bytes=int(self.max_reply_mb * (1 << 20)),
            vocab_size=self.vocab_size(),
        )

    def vocab_size(self) -> int | None:
        """The served model's vocabulary size (``vocab_size`` of its config.json, of ``text_config`` for a
        multimodal wrapper): reply token ids must be below it. None when the model directory is not configured
        or has no readable config.json (external mode without ``external_tokenizer_path``)."""
        try:
            value = text_config(self.tokenizer_path()).get("vocab_size")
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def tokenizer_path(self) -> Path:
        """Target model directory for the tokenizer stage, matching what the servers run.

        local: ``local_model``'s directory (:func:`~dflash_assets.generation.local_model.local_model_dir`);
        sglang: ``model_path``;
        vllm: ``vllm.model_path``, else ``local_model``'s directory;
        external: ``external_tokenizer_path``.

        Raises:
            ValueError: the mode's path is not configured.
        """
        if self.mode == "local" or (self.mode == "vllm" and not self.vllm.model_path):
            from dflash_assets.generation.local_model import local_model_dir

            return local_model_dir(self.local_model)
        if self.mode == "vllm":
            return Path(self.vllm.model_path)
        if self.mode == "sglang":
            if not self.model_path:
                raise ValueError("mode 'sglang' needs model_path")
            return Path(self.model_path)
        if not self.external_tokenizer_path:
            raise ValueError("mode 'external' needs external_tokenizer_path (the served model's directory)")
        return Path(self.external_tokenizer_path)


def _is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1); a wildcard or any other name is not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
