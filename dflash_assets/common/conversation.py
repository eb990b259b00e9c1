"""How a corpus row's conversation is stored and handed to a server or a chat template (no Dagster imports).

A corpus row holds the context one assistant turn is generated from: ``messages`` (the turns before it) and
``tools`` (the function schemas the conversation offered, or null). Stored as Arrow columns, a message is a
struct of nullable strings, :data:`MESSAGE_FIELDS`; ``tool_calls`` is the JSON text of an OpenAI
``tool_calls`` list and ``tools`` the JSON text of an OpenAI ``tools`` list, so one schema holds every
conversation (a struct of lists of free-form JSON schemas would not). :func:`api_messages` and
:func:`api_tools` turn them back into what ``POST /v1/chat/completions`` and ``apply_chat_template`` take:
null fields dropped, JSON parsed. Every renderer and request builder goes through them, so the tokens a row
trains on as context are rendered from the same objects the server received.
"""

from __future__ import annotations

import json
from typing import Any

import polars as pl

# role, content: every message. reasoning_content: an earlier assistant turn's thinking, as the source
# gave it. tool_calls: JSON text of [{"id", "type": "function", "function": {"name", "arguments"}}].
# tool_call_id, name: a tool result's answer to a call.
MESSAGE_FIELDS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")
MESSAGE_STRUCT = pl.Struct(dict.fromkeys(MESSAGE_FIELDS, pl.String))
MESSAGES_SCHEMA = pl.List(MESSAGE_STRUCT)

__all__ = ["MESSAGES_SCHEMA", "MESSAGE_FIELDS", "MESSAGE_STRUCT", "api_messages", "api_tools", "stored_message"]


def stored_message(message: dict[str, Any]) -> dict[str, str | None]:
    """One API-shaped message as stored: every :data:`MESSAGE_FIELDS` key present, ``tool_calls`` as JSON text.

    Raises:
        ValueError: a key outside :data:`MESSAGE_FIELDS`.
    """
    unknown = set(message) - set(MESSAGE_FIELDS)
    if unknown:
        raise ValueError(f"message fields {sorted(unknown)} are not stored; stored fields: {MESSAGE_FIELDS}")
    out: dict[str, str | None] = dict.fromkeys(MESSAGE_FIELDS)
    out.update(message)
    if out["tool_calls"] is not None and not isinstance(out["tool_calls"], str):
        out["tool_calls"] = json.dumps(out["tool_calls"], ensure_ascii=False, sort_keys=True)
    return out


def api_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored messages (any subset of :data:`MESSAGE_FIELDS`, missing or null fields allowed) as the
    OpenAI chat API and chat templates take them: null fields dropped, ``tool_calls`` parsed from JSON.

    A plain ``{"role", "content"}`` message comes back equal to itself, so rows without tools render and
    are requested exactly as before tool conversations were stored.
    """
    out = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        if isinstance(m.get("tool_calls"), str):
            m["tool_calls"] = json.loads(m["tool_calls"])
        out.append(m)
    return out


def api_tools(tools: str | list | None) -> list[dict[str, Any]] | None:
    """A row's stored ``tools`` (JSON text, an already parsed list, or null) as the list a request and a chat
    template take; None when the conversation offered no tools (then no ``tools`` key is sent at all)."""
    if tools is None:
        return None
    parsed = json.loads(tools) if isinstance(tools, str) else tools
    return parsed or None
