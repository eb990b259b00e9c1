"""The inference-server resource: where completions come from (local CPU server, SGLang on GPUs, or
servers someone else runs)."""

from __future__ import annotations

import contextlib
import ipaddress
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

import dagster as dg
from pydantic import ConfigDict, Field

from dflash_assets.common.config import SECRET_ENV
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.dflash.target.layers import text_config
from dflash_assets.generation.engines.environments import (
    SGLANG_SERVER_MODULE,
    EngineEnvironment,
    environment_python,
    sglang_environment,
    vllm_environment,
)
from dflash_assets.generation.processes.ports import free_port_block
from dflash_assets.generation.servers.group import LaunchCommand
from dflash_assets.generation.servers.pool import API_KEY_ENV, ServerPool
from dflash_assets.generation.servers.probe import probe_external
from dflash_assets.generation.servers.registry import orphan_message, reap_orphaned_servers
from dflash_assets.generation.servers.sglang_servers import SGLangServers, build_router_command, build_sglang_commands
from dflash_assets.generation.servers.supervision import ProbeSupervisor, ProcessSupervisor
from dflash_assets.generation.servers.transformers_server import LocalTransformersServer
from dflash_assets.generation.servers.vllm_servers import VLLMServers, build_vllm_commands
from dflash_assets.stages.resources.inference_sections import (
    ClientSettings,
    ExternalSettings,
    LocalSettings,
    SGLangSettings,
    VLLMSettings,
    migrate_flat_keys,
)

__all__ = ["InferenceServerResource"]

LOCAL_MAX_RUNNING_REQUESTS = 16  # measured best on 2 CPU cores (~55 output tok/s with 48-token replies)
SGLANG_MAX_RUNNING_REQUESTS = 40  # the production setting (16 -> 40 raised throughput on B200s)


class InferenceServerResource(dg.ConfigurableResource):
    """Inference servers for the ``completions`` stage, in sections: the launch settings of each mode apart from
    one another and from the client's.

    Modes (``mode``), each configured by its own section:
        ``local`` (default), section ``local``: one ``transformers serve`` on CPU over ``local.model``: the
            embedded SmolLM2 model, or the Qwen3.6-architecture stand-in (served without continuous batching,
            which has no cache for its linear-attention layers). Replies carry text only (re-tokenized).
        ``sglang``, section ``sglang``: ``num_servers`` SGLang servers, one per GPU (``tp_size`` GPUs each), or
            one ``sglang_router`` with ``--dp-size num_servers`` when ``use_router``, from SGLang's own environment
            (``sglang.packages``, made on first use, or ``sglang.python``).
        ``vllm``, section ``vllm``: ``num_servers`` vLLM OpenAI servers from vLLM's own environment, made on first
            use; on CPU over ``vllm.local_model`` unless ``vllm.model_path`` is set.
        ``external``, section ``external``: servers already running at ``base_urls``.

    SGLang and vLLM replies carry the generated token ids (``return_token_ids``), so their rows are exact.
    Section ``client`` (:class:`~dflash_assets.stages.resources.inference_sections.ClientSettings`) holds how requests
    are sent in every mode. The flat keys of earlier releases (``num_servers``, ``base_urls``, ...) still work for
    one release: :func:`~dflash_assets.stages.resources.inference_sections.migrate_flat_keys` moves each to its section
    with a warning naming the new key; a key given both ways, or an unknown key, is an error.

    ``api_key`` comes from the environment only: ``api_key=dg.EnvVar("DFLASH_SERVER_API_KEY")`` (a value in
    the config file is refused); it is sent as a bearer token and given to SGLang in a ``--config`` file only
    this user can read, to vLLM in its environment (never on a command line, where ``ps`` shows it to every
    local user; see :mod:`~dflash_assets.generation.servers.sglang_servers`).

    ``max_running_requests`` is both the server's limit (SGLang ``--max-running-requests``, vLLM
    ``--max-num-seqs``) and the client's concurrency per server; None means 16 in local mode and vLLM on CPU
    (measured best for 2 cores) and 40 otherwise.

    Raises (on construction): ValueError naming the key: an unknown key, or a flat key given with its new key.
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
        strict=True, default=1800.0, gt=0, description="Seconds to wait for servers to start (local, sglang, vllm)."
    )
    server_retry_s: float = Field(
        strict=True,
        default=30.0,
        gt=0,
        description="Seconds between attempts to bring back a server left out: a probe (external), a restart "
        "(sglang, vllm).",
    )
    max_server_restarts: int = Field(
        strict=True,
        default=5,
        ge=0,
        description="sglang, vllm: restarts of one server within an hour before it is left out (its log named) "
        "instead of restarted again: a server that crashes at every start is not restarted forever. 0: never.",
    )

    local: LocalSettings = Field(default_factory=LocalSettings, description="Mode local: the model served.")
    sglang: SGLangSettings = Field(default_factory=SGLangSettings, description="Mode sglang: the launch settings.")
    vllm: VLLMSettings = Field(default_factory=VLLMSettings, description="Mode vllm: the launch settings.")
    external: ExternalSettings = Field(
        default_factory=ExternalSettings, description="Mode external: the servers' URLs and model."
    )
    client: ClientSettings = Field(
        default_factory=ClientSettings, description="Every mode: timeouts, retries, reply bounds, continuations."
    )

    def __init__(self, **data) -> None:
        fields = migrate_flat_keys(data)
        known = type(self).model_fields
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise ValueError(f"inference: unknown key(s) {unknown}; valid keys: {', '.join(sorted(known))}")
        for name, value in fields.items():
            section = known[name].annotation
            if isinstance(value, Mapping) and isinstance(section, type) and issubclass(section, dg.Config):
                # checked whole here: Dagster drops a section's value equal to its default (YAML true == 1)
                fields[name] = section(**value)
        super().__init__(**fields)

    @classmethod
    def migrate_config(cls, fields: dict, where: str = "resources.inference") -> dict:
        """The config file's fields in the current shape (:func:`migrate_flat_keys`): called by the config loader
        before it checks the keys, so a flat key of an earlier release is warned about, not refused."""
        return migrate_flat_keys(fields, where)

    def backend(self) -> str:
        """What answers requests in this mode: ``transformers`` (local), ``sglang``, ``vllm``, or
        ``external.backend``."""
        return {"local": "transformers", "sglang": "sglang", "vllm": "vllm"}.get(self.mode, self.external.backend)

    def exposure_warnings(self) -> list[str]:
        """What these settings expose, one line each (never the key's value); empty when nothing:

        - ``sglang`` or ``vllm`` mode, the servers' host not loopback (``0.0.0.0``, a LAN address) and no API
          key: anyone who reaches the port can send requests (and read or spend the GPUs);
        - an API key sent over ``http://`` to a host that is not loopback (``external`` mode): it travels in
          clear text, readable by anyone on the path.

        ``serve`` logs them as warnings; ``completions`` keeps them in its metadata (``security_warnings``).
        """
        warnings = []
        if self.mode == "sglang" and not self.api_key and not _is_loopback(self.sglang.host):
            warnings.append(
                f"inference.sglang.host {self.sglang.host!r} with no API key: the servers take requests from anyone "
                f"who can reach port {self.sglang.port_base}; set {API_KEY_ENV}, or host: 127.0.0.1"
            )
        if self.mode == "vllm" and not self.api_key and not _is_loopback(self.vllm.host):
            warnings.append(
                f"inference.vllm.host {self.vllm.host!r} with no API key: the servers take requests from anyone who "
                f"can reach their ports; set {API_KEY_ENV}, or host: 127.0.0.1"
            )
        if self.mode == "external" and self.api_key:
            for url in self.external.base_urls:
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

    def uses_router(self, use_router: bool | None = None) -> bool:
        """Whether sglang mode starts one ``sglang_router`` (``use_router``, else ``inference.sglang.use_router``)."""
        return self.sglang.use_router if use_router is None else use_router

    def sglang_environment(self, use_router: bool | None = None) -> EngineEnvironment | None:
        """The environment SGLang's servers run from: ``sglang.packages`` in SGLang's own environment (made on
        first use), or ``sglang.python`` as is; None when ``sglang.launch_module`` is not SGLang's (a simulator,
        run from the project's own interpreter) and no router is started."""
        router = self.uses_router(use_router)
        if self.sglang.launch_module != SGLANG_SERVER_MODULE and not router:
            return None
        return sglang_environment(self.sglang.python, self.sglang.packages, router=router)

    def sglang_commands(
        self,
        extra_args: Sequence[str] = (),
        use_router: bool | None = None,
        root: Path | None = None,
        chat_template: Path | None = None,
    ) -> list[LaunchCommand]:
        """The launch commands ``serve`` uses in sglang mode (key by variable name, never by value), with the
        interpreter of :meth:`sglang_environment` (its path whether made yet or not; ``serve`` makes it first), or
        this process's own for a simulator.

        ``extra_args`` come after ``inference.sglang.extra_args`` (``drafter_evaluation`` adds the DFLASH flags);
        ``use_router`` overrides ``inference.sglang.use_router``; ``root`` is the engines' cache root (None: the
        cache); ``chat_template``: ``target_model.chat_template``'s file, given as ``--chat-template``.

        Raises:
            ValueError: ``sglang.model_path`` is empty, or ``gpu_ids`` do not fit ``num_servers x tp_size``.
        """
        g = self.sglang
        if not g.model_path:
            raise ValueError("mode 'sglang' needs inference.sglang.model_path")
        common = dict(
            model_path=g.model_path,
            num_servers=g.num_servers,
            gpu_ids=g.gpu_ids,
            host=g.host,
            max_running_requests=self.effective_max_running_requests(),
            max_mamba_cache_size=g.max_mamba_cache_size,
            mem_fraction_static=g.mem_fraction_static,
            context_length=g.context_length,
            tp_size=g.tp_size,
            reasoning_parser=g.reasoning_parser,
            api_key_env=API_KEY_ENV if self.api_key else None,
            extra_args=[*template_flags(chat_template), *g.extra_args, *extra_args],
        )
        environment = self.sglang_environment(use_router)
        common["python"] = str(environment_python(environment, root)) if environment else sys.executable
        if self.uses_router(use_router):
            return [build_router_command(port=g.port_base, **common)]
        return build_sglang_commands(port_base=g.port_base, module=g.launch_module, **common)

    def vllm_environment(self) -> EngineEnvironment:
        """The environment mode ``vllm`` runs its servers from (``vllm.packages`` minus ``vllm.remove_packages``, by
        default vLLM's CPU build on ``device: cpu`` and its CUDA wheel on ``cuda``, or ``vllm.python``); the same one
        ``drafter_evaluation``'s ``engine: vllm`` uses for the same pins."""
        requirements, remove = self.vllm.environment_packages()
        return vllm_environment(requirements, remove, self.vllm.python)

    def vllm_commands(
        self, python: str | Path, port_base: int | None = None, chat_template: Path | None = None
    ) -> list[LaunchCommand]:
        """The launch commands ``serve`` uses in vllm mode: ``vllm.num_servers`` servers of the model
        :meth:`tokenizer_path` names, ``max_running_requests`` each (``--max-num-seqs``); the key by variable
        name, never by value.

        Args:
            python: the engine environment's interpreter.
            port_base: server i listens on ``port_base + i``; None: ``vllm.port_base``, else a free block.
            chat_template: ``target_model.chat_template``'s file, given as ``--chat-template``; None: the model's.

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
            extra_args=[*template_flags(chat_template), *v.extra_args],
        )

    @contextlib.contextmanager
    def serve(
        self, log_dir: Path | str, settings: GenerationSettings | None = None, chat_template: Path | None = None
    ) -> Iterator[ServerPool]:
        """Make servers ready, yield a :class:`ServerPool`, and stop what was started on exit.

        Args:
            log_dir: directory for server logs (``transformers_serve.log``, ``sglang_<i>.log``, ``vllm_<i>.log``).
            settings: local mode only: the sampling ``transformers serve`` is frozen with at startup
                (its continuous batcher keeps the first request's sampling); None = model defaults
                (greedy for SmolLM2). SGLang and vLLM honour per-request sampling, so they need none.
            chat_template: ``target_model.chat_template``'s file (:meth:`~dflash_assets.stages.resources.target_model.
                TargetModelResource.chat_template_path`): every server started renders with it (vLLM and SGLang
                ``--chat-template``, the local server a model directory with it); None: the model's own. Servers
                of ``external`` mode are someone else's: their template is theirs.

        Raises:
            RuntimeError, TimeoutError: a server did not start or failed the generation probe.
            EngineEnvironmentError (a RuntimeError): vllm or sglang mode, the engine's environment could not be made.
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
            from dflash_assets.generation.engines.local_model import local_model_dir

            with LocalTransformersServer(
                local_model_dir(self.local.model),
                log_path=log_dir / "transformers_serve.log",
                extra_args=self.local.extra_args,
                settings=settings,
                startup_timeout_s=self.startup_timeout_s,
                chat_template=chat_template,
            ) as server:
                yield server.pool(mrr)
        elif self.mode == "external":
            x = self.external
            if not x.base_urls or not x.served_model_name:
                raise ValueError("mode 'external' needs inference.external.base_urls and served_model_name")
            for url in x.base_urls:
                probe_external(url, x.served_model_name, self.api_key, timeout_s=min(self.startup_timeout_s, 300.0))
            supervisor = ProbeSupervisor(x.base_urls, x.served_model_name, self.api_key, self.server_retry_s)
            yield ServerPool(
                list(x.base_urls), x.served_model_name, self.api_key, mrr, x.backend, supervisor=supervisor
            )
        elif self.mode == "vllm":
            python = self.vllm_environment().ensure(dg.get_dagster_logger().info)  # first use: a few minutes
            commands = self.vllm_commands(python, chat_template=chat_template)
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
            if environment := self.sglang_environment():  # first use: several minutes (SGLang's own torch)
                environment.ensure(dg.get_dagster_logger().info)
            commands = self.sglang_commands(chat_template=chat_template)
            with SGLangServers(commands, log_dir, self.api_key, self.startup_timeout_s) as servers:
                # Behind a router one URL fronts num_servers servers: scale its concurrency to match.
                per_url = mrr * self.sglang.num_servers if self.sglang.use_router else mrr
                yield ServerPool(
                    servers.base_urls,
                    self.sglang.model_path,
                    self.api_key,
                    per_url,
                    "sglang",
                    supervisor=ProcessSupervisor(servers, self.server_retry_s, self.max_server_restarts),
                )

    def completion_client(self, pool: ServerPool):
        """A :class:`CompletionClient` for ``pool`` with the ``client`` section's settings: concurrency = servers x
        max_running_requests."""
        from dflash_assets.generation.client.completion_client import CompletionClient

        c = self.client
        return CompletionClient(
            pool.base_urls,
            api_key=pool.api_key,
            concurrency=pool.max_running_requests * len(pool.base_urls),
            read_timeout_s=c.request_timeout_s,
            request_timeout_s=c.request_timeout_s,
            max_attempts=c.max_attempts,
            backoff_base_s=c.backoff_base_s,
            max_consecutive_failures=c.max_consecutive_failures,
            supervisor=pool.supervisor,
            stall_timeout_s=c.stall_timeout_s,
            max_reply_bytes=int(c.max_reply_mb * (1 << 20)),
            vocab_size=self.vocab_size(),
        )

    def vocab_size(self) -> int | None:
        """The served model's vocabulary size (``vocab_size`` of its config.json, of ``text_config`` for a
        multimodal wrapper): reply token ids must be below it. None when the model directory is not configured
        or has no readable config.json (external mode without ``external.tokenizer_path``)."""
        try:
            value = text_config(self.tokenizer_path()).get("vocab_size")
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def tokenizer_path(self) -> Path:
        """Target model directory for the tokenizer stage, matching what the servers run.

        local: ``local.model``'s directory (:func:`~dflash_assets.generation.engines.local_model.local_model_dir`);
        sglang: ``sglang.model_path``;
        vllm: ``vllm.model_path``, else ``vllm.local_model``'s directory;
        external: ``external.tokenizer_path``.

        Raises:
            ValueError: the mode's path is not configured.
        """
        from dflash_assets.generation.engines.local_model import local_model_dir

        if self.mode == "local":
            return local_model_dir(self.local.model)
        if self.mode == "vllm":
            return Path(self.vllm.model_path) if self.vllm.model_path else local_model_dir(self.vllm.local_model)
        if self.mode == "sglang":
            if not self.sglang.model_path:
                raise ValueError("mode 'sglang' needs inference.sglang.model_path")
            return Path(self.sglang.model_path)
        if not self.external.tokenizer_path:
            raise ValueError("mode 'external' needs inference.external.tokenizer_path (the served model's directory)")
        return Path(self.external.tokenizer_path)

    def context_length(self) -> int | None:
        """The servers' context in tokens, against which each prompt is judged before it is sent.

        The mode's setting: ``sglang.context_length`` / ``vllm.max_model_len`` / ``external.context_length``,
        else the same flag in the mode's ``extra_args`` (``--context-length``, ``--max-model-len``); else what
        SGLang and vLLM themselves default to, the served model's ``max_position_embeddings`` (of its
        ``text_config`` for a multimodal wrapper; :meth:`tokenizer_path`'s ``config.json``). None when none of
        these is known (external mode without ``tokenizer_path``, a config without the key, a flag value that is
        not a plain integer): prompts are then not checked before they are sent.
        """
        flag, configured, extra = {
            "sglang": ("--context-length", self.sglang.context_length, self.sglang.extra_args),
            "vllm": ("--max-model-len", self.vllm.max_model_len, self.vllm.extra_args),
            "external": (None, self.external.context_length, []),
        }.get(self.mode, (None, None, []))
        if configured is not None:
            return configured
        for i, arg in enumerate(extra):
            if flag and (arg == flag or arg.startswith(flag + "=")):
                value = arg.split("=", 1)[1] if "=" in arg else (extra[i + 1] if i + 1 < len(extra) else "")
                return int(value) if value.isdigit() and int(value) > 0 else None
        try:
            value = text_config(self.tokenizer_path()).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def local_model_name(self) -> str | None:
        """The local model this mode serves (``local.model``; ``vllm.local_model`` without ``vllm.model_path``),
        None when it serves a model directory or someone else's servers."""
        if self.mode == "local":
            return self.local.model
        if self.mode == "vllm" and not self.vllm.model_path:
            return self.vllm.local_model
        return None


#: Server flags that make an engine parse the model's tool-call markup out of its reply (vLLM, SGLang): the rows
#: keep the model's own output ids and text, so the servers run without them (issue 43, "Exact context").
TOOL_PARSER_FLAGS = ("--tool-call-parser", "--enable-auto-tool-choice")


def template_flags(chat_template: Path | None) -> list[str]:
    """``["--chat-template", path]`` (vLLM and SGLang spell it alike), or nothing for the model's own template."""
    return [] if chat_template is None else ["--chat-template", str(chat_template)]


def tool_parser_flag(extra_args: Sequence[str]) -> str | None:
    """The first of :data:`TOOL_PARSER_FLAGS` in ``extra_args`` (``--flag`` or ``--flag=value``), or None."""
    for arg in extra_args:
        for flag in TOOL_PARSER_FLAGS:
            if arg == flag or arg.startswith(flag + "="):
                return flag
    return None


def _is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1); a wildcard or any other name is not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
