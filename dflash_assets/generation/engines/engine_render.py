"""What each serving engine hands the chat template, reproduced for the project's own renderings (no Dagster).

The server's ids are the training row (:mod:`dflash_assets.data.tokenization`). The project renders a
conversation itself only where they are not at hand: the length pre-filter (before a prompt is sent), the
in-process evaluation, a reply without prompt ids, and the check that compares its rendering with the server's
ids. There it must render what the engine renders: the same messages, tools and keyword arguments reaching
``tokenizer.apply_chat_template``. :func:`template_inputs` gives them per engine, as read from the engines' code
(the versions this project pins; ``dflash_assets_tests/test_sglang_contract.py`` and ``test_vllm_contract.py``
compare them with what the engines' own code hands over, key order included):

SGLang 0.5.23 (``sglang/srt/entrypoints/openai``):

- tools: the request's ``tools`` are parsed into ``protocol.Tool`` and, ``tool_choice`` not "none", handed over as
  ``[item.model_dump() for item in request.tools]`` (``serving_chat.OpenAIServingChat._process_messages``).
  ``Tool`` has no serializer: every tool is ``{"type", "function", "defer_loading"}``, ``defer_loading`` null when
  not given. ``Function``'s serializer (``protocol.Function._serialize``) keeps the client's keys in the client's
  order, drops ``strict`` / ``defer_loading`` when null and appends ``description`` / ``parameters`` (null) when
  absent; keys outside the model are dropped. A function without a description thus renders ``"description":
  null`` through a ``{{ tool | tojson }}`` template (:func:`sglang_tool`).
- messages: ``msg.model_dump()`` each (``_apply_jinja_template``), assistant tool-call ``function.arguments``
  parsed from JSON (``normalize_assistant_tool_call_arguments``), a null ``content`` made ``""`` and every null
  top-level field dropped (``parser/jinja_template_utils.process_content_for_template_format``); a last assistant
  message becomes a user message unless ``continue_final_message`` (``_handle_last_assistant_message``). A message's
  keys come in its model's field order (``ChatCompletionMessageGenericParam``: role, content, tool_call_id, name,
  phase, reasoning_content, tool_calls, tools, prefix; ``ChatCompletionMessageUserParam``: role, content), each tool
  call as ``ToolCall`` dumps it: ``{"id", "index": null, "type", "function": {"name", "arguments"}}``.
- keyword arguments: ``add_generation_prompt=True``, ``tools`` and the request's ``chat_template_kwargs``
  (``_render_and_encode_chat_template``).

vLLM 0.32.0 (``vllm/renderers``, ``vllm/entrypoints/openai``):

- tools: ``[tool.model_dump() for tool in request.tools]`` (``renderers/online_renderer.OnlineRenderer.render_chat``)
  unless ``tool_choice`` is "none" and the server runs ``--exclude-tools-when-tool-choice-none``.
  ``ChatCompletionToolsParam`` and ``FunctionDefinition`` (``entrypoints/openai/chat_completion/protocol.py``,
  ``entrypoints/generate/base/protocol.py``) keep only their own fields in their own order: ``{"type": "function",
  "function": {"name", "description", "parameters"}}``, nulls kept, ``strict`` / ``defer_loading`` only when set
  (:func:`vllm_tool`).
- messages: ``renderers/chat_utils._parse_chat_message_content``: ``{"role", "content"}`` (text parts joined; no
  content: ``""``), an assistant's ``tool_calls`` as the request's message type orders them (``{"id", "function":
  {"arguments", "name"}, "type"}``, arguments parsed by ``_postprocess_messages``) and, when the request gave
  ``reasoning``, ``reasoning`` and ``reasoning_content``; a tool message's ``tool_call_id``; any ``name``.
- keyword arguments: those the template reads (``renderers/hf.resolve_chat_template_kwargs``) and
  ``add_generation_prompt``.

``transformers serve`` (transformers 5.24, ``cli/serving/chat_completion.py``) passes the request's messages and
``tools`` as sent; the pool sends it tool-call arguments parsed (:func:`~dflash_assets.generation.engines.chat_render.
template_messages`). Any other engine (``openai``: not known) is rendered that way too, and says so.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "ENGINES",
    "engine_messages",
    "engine_of",
    "engine_tools",
    "render_engine_inputs",
    "sglang_messages",
    "sglang_tool",
    "template_inputs",
    "vllm_messages",
    "vllm_tool",
]

#: Engines whose hand-over to the template is reproduced; anything else renders the project's own shape.
ENGINES = ("sglang", "vllm", "transformers")

# protocol.Function's fields in SGLang 0.5.23 (key_order is excluded from dumps)
_SGLANG_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")
# ChatCompletionMessageGenericParam's fields (a user message: role, content)
_SGLANG_MESSAGE_FIELDS = (
    "role",
    "content",
    "tool_call_id",
    "name",
    "phase",
    "reasoning_content",
    "tool_calls",
    "tools",
    "prefix",
)
# vLLM 0.32.0 FunctionDefinition's fields
_VLLM_FUNCTION_FIELDS = ("name", "description", "parameters", "strict", "defer_loading")


def engine_of(backend: str | None) -> str:
    """The engine whose hand-over a backend name stands for: one of :data:`ENGINES`, else ``openai`` (not known)."""
    return backend if backend in ENGINES else "openai"


def _arguments(arguments: Any) -> Any:
    """A tool call's ``function.arguments`` as the engines parse it for the template: JSON text to its value."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments else {}
        except ValueError:
            return {}
    return arguments


def sglang_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """One tool of a request as SGLang 0.5.23's ``Tool.model_dump()`` hands it to the template (module docstring)."""
    function = dict(tool.get("function") or {})
    if tool.get("defer_loading") is not None and function.get("defer_loading") is None:
        function["defer_loading"] = tool["defer_loading"]  # Tool._propagate_defer_loading
    dumped = {name: function.get(name) for name in _SGLANG_FUNCTION_FIELDS}
    for name in ("strict", "defer_loading"):
        if dumped[name] is None:
            del dumped[name]
    order = [k for k in function if k in dumped]  # the client's keys first, in the client's order
    dumped = {k: dumped[k] for k in order + [k for k in dumped if k not in order]}
    return {"type": tool.get("type", "function"), "function": dumped, "defer_loading": tool.get("defer_loading")}


def vllm_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """One tool of a request as vLLM 0.32.0's ``ChatCompletionToolsParam.model_dump()`` hands it to the template."""
    function = dict(tool.get("function") or {})
    if tool.get("defer_loading") is not None and function.get("defer_loading") is None:
        function["defer_loading"] = tool["defer_loading"]  # ChatCompletionToolsParam._propagate_defer_loading
    dumped = {name: function.get(name) for name in _VLLM_FUNCTION_FIELDS}
    for name in ("strict", "defer_loading"):
        if dumped[name] is None:
            del dumped[name]
    out: dict[str, Any] = {"type": "function", "function": dumped}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def engine_tools(engine: str, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """A request's ``tools`` (API-shaped) as ``engine`` hands them to the template; None when there are none."""
    if not tools:
        return None
    if engine == "sglang":
        return [sglang_tool(t) for t in tools]
    if engine == "vllm":
        return [vllm_tool(t) for t in tools]
    return [dict(t) for t in tools]


def sglang_messages(messages: list[dict[str, Any]], continue_final_message: bool = False) -> list[dict[str, Any]]:
    """API-shaped messages (text content) as SGLang 0.5.23 hands them to the template (module docstring); with
    ``continue_final_message`` a last assistant message is left out (SGLang appends its text's ids after
    rendering, ``_append_assistant_prefix_to_prompt_ids``)."""
    out = []
    for message in messages:
        if message.get("role") == "user":
            content = message.get("content")
            out.append({"role": "user", "content": "" if content is None else content})
            continue
        dumped: dict[str, Any] = {}
        for name in _SGLANG_MESSAGE_FIELDS:
            value = message.get(name)
            if name == "content" and value is None:
                value = ""
            if name == "tool_calls" and value is not None:
                value = [
                    {
                        "id": call.get("id"),
                        "index": call.get("index"),
                        "type": call.get("type", "function"),
                        "function": {
                            "name": (call.get("function") or {}).get("name"),
                            "arguments": _arguments((call.get("function") or {}).get("arguments")),
                        },
                    }
                    for call in value
                ]
            if value is not None:
                dumped[name] = value
        out.append(dumped)
    if out and out[-1].get("role") == "assistant" and isinstance(out[-1].get("content"), str):
        if continue_final_message:
            out = out[:-1]
        else:
            out[-1] = {"role": "user", "content": out[-1]["content"]}
    return out


def vllm_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """API-shaped messages (text content) as vLLM 0.32.0 hands them to the template (module docstring). An
    assistant's thinking reaches it only from the request's ``reasoning`` (what the pool sends vLLM beside
    ``reasoning_content``)."""
    out = []
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        item: dict[str, Any] = {"role": role, "content": "" if content is None else content}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls:  # an empty list is dropped (_postprocess_messages)
                item["tool_calls"] = [
                    {
                        "id": call.get("id"),
                        "function": {
                            "arguments": _arguments((call.get("function") or {}).get("arguments")),
                            "name": (call.get("function") or {}).get("name"),
                        },
                        "type": call.get("type", "function"),
                    }
                    for call in calls
                ]
            reasoning = message.get("reasoning", message.get("reasoning_content"))
            if reasoning is not None:
                item["reasoning"] = reasoning
                item["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            item["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            item["name"] = message["name"]
        out.append(item)
    return out


def engine_messages(engine: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """API-shaped messages (:func:`~dflash_assets.common.conversation.api_messages`) as ``engine`` hands them to the
    template (:data:`ENGINES`; any other: as sent, tool-call arguments parsed, the shape ``transformers serve``
    gets from the pool)."""
    if engine == "sglang":
        return sglang_messages(messages)
    if engine == "vllm":
        return vllm_messages(messages)
    out = []
    for message in messages:
        message = dict(message)
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function") or {})
                arguments = _arguments(function.get("arguments"))
                function["arguments"] = arguments if isinstance(arguments, dict) else {}
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        out.append(message)
    return out


def template_inputs(
    engine: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
    """``(messages, tools, kwargs)`` as ``engine`` hands them to ``apply_chat_template`` for a request of these
    API-shaped ``messages`` and ``tools`` (:func:`~dflash_assets.common.conversation.api_messages` /
    ``api_tools``) with ``chat_template_kwargs`` ``template_kwargs``: the generation prompt on, ``tools`` None when
    there are none."""
    kwargs = {"add_generation_prompt": True, **(template_kwargs or {})}
    return engine_messages(engine, messages), engine_tools(engine, tools), kwargs


def render_engine_inputs(
    tokenizer, engine: str, conversations: list[list[dict[str, Any]]], tools: list | None, kwargs: dict[str, Any]
) -> list[str]:
    """``tokenizer.apply_chat_template`` of ``conversations`` (each already as ``engine`` hands it over, sharing
    ``tools`` and ``kwargs`` from :func:`template_inputs`), as text. Where SGLang's own rendering fails with the
    tools as dumped it renders again with each tool's bare ``function`` ("Some templates (e.g. Mistral) expect
    tools without the OpenAI wrapper", ``_apply_jinja_template``): so does this, for ``sglang``."""
    extra = dict(kwargs)
    if tools is not None:
        extra["tools"] = tools
    try:
        return tokenizer.apply_chat_template(conversations, tokenize=False, **extra)
    except Exception:
        if engine != "sglang" or tools is None:
            raise
    extra["tools"] = [t.get("function", t) for t in tools]
    return tokenizer.apply_chat_template(conversations, tokenize=False, **extra)
