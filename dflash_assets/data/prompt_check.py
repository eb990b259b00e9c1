"""The project's rendering of a row's context held against the server's prompt ids (no Dagster imports).

Where a reply carried the prompt's ids, they are the row (:mod:`dflash_assets.data.tokenization`); the project's
own rendering, which the length pre-filter and the in-process evaluation rely on, becomes a check. A difference
is reported, not raised: :func:`explain` names the first differing token, its text on both sides and which input
made it (``template kwargs``, ``tools``, ``messages``), found by rendering again with that input changed the ways
the engines are known to change it (:mod:`~dflash_assets.generation.engines.engine_render`), else by where the
token falls in the rendered text.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dflash_assets.common.conversation import api_messages, api_tools
from dflash_assets.generation.engines.chat_render import first_difference
from dflash_assets.generation.engines.engine_render import (
    ENGINES,
    engine_messages,
    engine_tools,
    render_engine_inputs,
    template_inputs,
)

__all__ = ["PromptCheck", "PromptDifference", "TokenizeCounts", "explain"]


@dataclass(frozen=True)
class PromptDifference:
    """Where the project's rendering of row ``index``'s context parts from the server's ``prompt_token_ids``:
    token ``position`` (of ``mine_tokens`` / ``server_tokens``), the text of the tokens from there on each side,
    and the ``cause`` :func:`explain` found."""

    index: int
    prompt_id: str | None
    engine: str
    position: int
    mine_tokens: int
    server_tokens: int
    mine_text: str
    server_text: str
    cause: str

    def message(self) -> str:
        return (
            f"row {self.index} (prompt_id {self.prompt_id}): the project's rendering of the context as {self.engine} "
            f"hands it to the template parts from the server's prompt_token_ids at token {self.position} of "
            f"{self.mine_tokens} (project) / {self.server_tokens} (server): project {self.mine_text!r}, server "
            f"{self.server_text!r}; cause: {self.cause}"
        )


@dataclass
class PromptCheck:
    """The comparison over a partition: rows ``compared``, the indexes of those that ``differ`` and the first
    difference explained (:class:`PromptDifference`)."""

    compared: int = 0
    checked: set[int] = field(default_factory=set)
    differ: list[int] = field(default_factory=list)
    first: PromptDifference | None = None


class TokenizeCounts(Counter):
    """A partition's counts by outcome (a Counter), with the first prompt difference's message
    (``first_prompt_difference``, None when the rendering matched every server's ids)."""

    first_prompt_difference: str | None = None


def explain(
    builder, engine: str, messages: list[dict[str, Any]], tools: Any, thinking: bool, mine: list[int], server: list[int]
) -> str:
    """Which input makes the project's rendering ``mine`` of stored ``messages`` / ``tools`` (as ``engine`` hands
    them over, ``builder``'s template) differ from the server's ``server`` ids: the first of these renderings that
    gives exactly the server's ids names it (template kwargs: the thinking flag the other way; tools: another
    engine's dump, each tool's bare function, none; messages: another engine's message shape); else the input
    whose rendered text the first differing token falls in."""
    api, offered = api_messages(messages), api_tools(tools)
    shaped, dumped, kwargs = template_inputs(engine, api, offered, builder.template_kwargs(thinking))

    def gives_server(messages_: list, tools_: list | None, kwargs_: dict) -> bool:
        try:
            text = render_engine_inputs(builder.tokenizer, engine, [messages_], tools_, kwargs_)[0]
        except Exception:  # a template that cannot take this shape says nothing of the cause
            return False
        return builder.encode_texts([text])[0] == server

    others = [e for e in (*ENGINES, "openai") if e != engine]
    if builder.template_knows_thinking and gives_server(shaped, dumped, {**kwargs, "enable_thinking": not thinking}):
        return f"template kwargs: the server rendered enable_thinking={not thinking}, the row's settings say {thinking}"
    if offered:
        for other in others:
            if gives_server(shaped, engine_tools(other, offered), kwargs):
                return f"tools: the server handed the template the tools as {other} dumps them, not as {engine} does"
        if gives_server(shaped, [t.get("function", t) for t in dumped or []], kwargs):
            return "tools: the server handed the template each tool's bare function (no OpenAI wrapper)"
        if gives_server(shaped, None, kwargs):
            return "tools: the server rendered no tools (tool_choice none, or a template that drops them)"
    for other in others:
        if gives_server(engine_messages(other, api), dumped, kwargs):
            return f"messages: the server handed the template the messages as {other} shapes them, not as {engine} does"
    return _where(builder, engine, api, offered, kwargs, mine, server)


def _where(builder, engine: str, api, offered, kwargs, mine: list[int], server: list[int]) -> str:
    """The input whose text in the project's rendering holds the first differing token."""
    at = first_difference(mine, server) or 0
    decode = builder.tokenizer.decode
    try:
        shaped, tools, _ = template_inputs(engine, api, offered, kwargs)
        text = render_engine_inputs(builder.tokenizer, engine, [shaped], tools, kwargs)[0]
    except Exception:
        return "unknown: the project's template fails on this conversation"
    offset = len(decode(mine[:at], skip_special_tokens=False))
    spans, start = [], 0
    for k, message in enumerate(api):
        content = message.get("content")
        if isinstance(content, str) and content:
            found = text.find(content, start)
            if found >= 0:
                spans.append((found, found + len(content), k))
                start = found + len(content)
    names = [t.get("function", {}).get("name") for t in offered or []]
    tool_at = [found for n in names if n and (found := text.find(f'"{n}"')) >= 0]
    before = 0
    for begin, end, k in spans:
        if offset <= end:
            if offset >= begin:
                return f"messages: inside messages[{k}] ({api[k].get('role')})"
            if any(before <= t <= offset for t in tool_at):
                return "tools: inside the template's tool block"
            if k == 0:
                return "messages: before the first message (a system prompt or header the server adds?)"
            return f"messages: the template's framing between messages[{k - 1}] and messages[{k}]"
        before = end
    return "template kwargs or the generation prompt: after the last message (add_generation_prompt, thinking)"
