"""Where the completions client sends requests (:class:`ServerPool`), and names shared by every kind of server.

The servers themselves: :mod:`~dflash_assets.generation.servers.transformers_server` (``transformers serve`` on
CPU), :mod:`~dflash_assets.generation.servers.sglang_servers` (SGLang on GPUs) and
:mod:`~dflash_assets.generation.servers.vllm_servers` (vLLM, CPU or GPUs); their
processes and pidfiles: :mod:`~dflash_assets.generation.processes.sessions` and
:mod:`~dflash_assets.generation.servers.registry`; start-up probes: :mod:`~dflash_assets.generation.servers.probe`.
No Dagster here: ``dflash_assets.stages.resources.inference`` wraps these for the pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

#: Request fields ``transformers serve`` rejects with HTTP 422 (not in the OpenAI chat schema).
TRANSFORMERS_SERVE_REJECTED_FIELDS = frozenset({"top_k", "min_p", "repetition_penalty"})

#: Environment variable that holds the inference servers' API key (its value never goes into logs).
API_KEY_ENV = "DFLASH_SERVER_API_KEY"

Backend = Literal["transformers", "sglang", "vllm", "openai"]


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
    #: what may be done about a faulty server (:mod:`dflash_assets.generation.servers.supervision`); None: nothing
    supervisor: Any = field(default=None, compare=False, repr=False)
    #: fields added to every request body (a ``transformers serve`` without continuous batching gets the
    #: sampling as a per-request ``generation_config``); never secrets
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    #: what every row these servers make records of them (:func:`~dflash_assets.generation.servers.origin.
    #: server_origin`: ``engine``, ``engine_version``, ``template_sha256``, ``seed_honoured``); empty: not asked
    origin: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def headers(self) -> dict[str, str]:
        """HTTP headers for every request (the bearer token when an API key is set)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def adapt_body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Return ``body`` as this backend takes it.

        For ``transformers serve``: minus :data:`TRANSFORMERS_SERVE_REJECTED_FIELDS` (HTTP 422 otherwise);
        with continuous batching its sampling was fixed at startup by the probe, without it each request carries
        it in :attr:`extra_body` (see :mod:`~dflash_assets.generation.servers.transformers_server`).
        For SGLang and vLLM: plus ``return_token_ids`` (SGLang ``choices[0].response_token_ids``, vLLM
        ``choices[0].token_ids``: the model's own tokens, which
        tokenization trains on and a lowered cap cuts exactly; an SGLang without the field ignores it; vLLM
        0.32 also returns ``prompt_token_ids``).
        Others: unchanged copy. Every backend: plus :attr:`extra_body`.

        A body offering ``tools`` (:data:`~dflash_assets.common.settings.TOOL_CHOICE`, whose comment gives the
        engines' sources): SGLang gets ``tool_choice`` "auto" (its "none" leaves the tools out of the prompt);
        ``transformers serve`` gets no ``tool_choice`` (it ignores it) and each assistant tool call's arguments as
        an object, as vLLM and SGLang hand them to the template (:func:`~dflash_assets.generation.engines.chat_render.
        template_messages`). vLLM gets each assistant message's ``reasoning_content`` also as ``reasoning``, the
        only name it reads (``vllm/renderers/chat_utils.py``).
        """
        body = {**body, **self.extra_body}
        if self.backend == "vllm" and any("reasoning_content" in m for m in body.get("messages") or ()):
            body["messages"] = [
                {**m, "reasoning": m["reasoning_content"]} if m.get("reasoning_content") is not None else m
                for m in body["messages"]
            ]
        if "tools" in body and self.backend == "sglang":
            body["tool_choice"] = "auto"
        if self.backend == "transformers":
            body.pop("tool_choice", None)
            if any(m.get("tool_calls") for m in body.get("messages") or ()):
                from dflash_assets.generation.engines.chat_render import template_messages

                body["messages"] = template_messages(body["messages"])
        if self.backend == "transformers":
            return {k: v for k, v in body.items() if k not in TRANSFORMERS_SERVE_REJECTED_FIELDS}
        if self.backend in ("sglang", "vllm"):
            return {**body, "return_token_ids": True}
        return dict(body)

    def __repr__(self) -> str:  # keep the key out of logs
        key = "None" if self.api_key is None else "'***'"
        return (
            f"ServerPool(base_urls={self.base_urls!r}, model={self.model!r}, api_key={key}, "
            f"max_running_requests={self.max_running_requests}, backend={self.backend!r}"
            + (f", extra_body={dict(self.extra_body)!r})" if self.extra_body else ")")
        )
