"""One prompt record of any supported shape as a checked conversation, and the contexts of its assistant turns
(no Dagster imports). :mod:`dflash_assets.data.shapes` reads files of such records into the corpus; its module
docstring says which shapes are read, what becomes a row and what is set aside.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_TURNS",
    "SHAPES_ACCEPTED",
    "TURNS",
    "TURN_KINDS",
    "Conversation",
    "RowError",
    "TurnContext",
    "content_text",
    "conversation_turns",
    "normalize_conversation",
    "normalize_record",
    "record_tools",
    "turn_kind",
]

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "function_call": "assistant",  # ShareGPT (LLaMA-Factory): an assistant turn whose value is the call(s)
    "system": "system",
    "tool": "tool",
    "ipython": "tool",
    "function": "tool",  # legacy OpenAI function result
    "observation": "tool",  # ShareGPT (LLaMA-Factory): a tool result
}
TURNS = ("last", "every")
#: ``every``: the drafter serves every turn of an agentic session; single-turn records give one row either way.
DEFAULT_TURNS = "every"
TURN_KINDS = ("prompt", "after_tool", "follow_up")

SHAPES_ACCEPTED = (
    "OpenAI 'messages' [{role, content, tool_calls, tool_call_id}] (+ 'tools'), ShareGPT 'conversations' "
    "[{from, value}] (function_call / observation turns, + 'tools'), Alpaca 'instruction' (+ 'input'), plain 'prompt'"
)


class RowError(ValueError):
    """One record is unusable; the message is the rejection reason."""


@dataclass(frozen=True)
class Conversation:
    """One record, normalized. ``messages``: API-shaped (null fields absent, ``tool_calls`` a list of
    ``{"id", "type": "function", "function": {"name", "arguments": JSON text}}``), every one checked, without a
    final assistant reply; ``tools``: JSON text of the OpenAI tools list, or None; ``final_reply``: the record
    ended with an assistant reply (regenerated, so not kept)."""

    messages: list[dict[str, Any]]
    tools: str | None
    final_reply: bool

    @property
    def uses_tools(self) -> bool:
        """Whether the conversation offers tools, calls one or holds a tool result."""
        return self.tools is not None or any(m["role"] == "tool" or "tool_calls" in m for m in self.messages)


@dataclass(frozen=True)
class TurnContext:
    """The context of one assistant turn: ``messages`` (API-shaped) before it, its 0-based ``turn`` among the
    conversation's assistant turns, and its ``turn_kind`` (:data:`TURN_KINDS`)."""

    messages: list[dict[str, Any]]
    turn: int
    turn_kind: str


def normalize_record(record: Any) -> list[dict[str, Any]]:
    """The context one record gives with ``turns: last``: its messages with the trailing assistant turns dropped
    (a plain conversation: up to and including its last user message), API-shaped
    (:func:`~dflash_assets.common.conversation.api_messages` form). The record's ``tools`` are not in it: see
    :func:`normalize_conversation`.

    Raises:
        RowError: as :func:`normalize_conversation`.
    """
    return conversation_turns(normalize_conversation(record), "last")[0].messages


def normalize_conversation(record: Any) -> Conversation:
    """One record of any supported shape as a :class:`Conversation`: every message checked and API-shaped
    except a final assistant reply (regenerated, never context: not checked, not kept), and the offered tools.

    Raises:
        RowError: not an object, unknown shape, unknown role, missing/empty content (a system or user message
            without text, an assistant message with neither text nor tool calls), a non-text content part, a
            bad tool call (not an object, no function name, arguments that are not a JSON object, a repeated
            id), a tool result answering no call of the assistant turn before it, a call left without result
            before the next non-tool message, a malformed ``tools`` list, no user message.
    """
    if not isinstance(record, dict):
        raise RowError(f"not a JSON object: got {type(record).__name__}")
    if "messages" in record:
        messages, final_reply = _Conversation("messages", "role", "content").read(record["messages"])
    elif "conversations" in record:
        messages, final_reply = _Conversation("conversations", "from", "value").read(record["conversations"])
    elif "instruction" in record:
        instruction = record["instruction"]
        if not isinstance(instruction, str) or not instruction.strip():
            raise RowError("empty content: 'instruction' is missing or empty")
        extra = record.get("input")
        if extra is not None and not isinstance(extra, str):
            raise RowError(f"bad field: 'input' must be a string, got {type(extra).__name__}")
        text = instruction.strip() + (f"\n\n{extra.strip()}" if extra and extra.strip() else "")
        messages, final_reply = [{"role": "user", "content": text}], False
    elif "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise RowError("empty content: 'prompt' is missing or empty")
        messages, final_reply = [{"role": "user", "content": prompt}], False
    else:
        raise RowError(f"unknown shape: keys {sorted(record)[:8]}; expected {SHAPES_ACCEPTED}")
    return Conversation(messages, record_tools(record), final_reply)


def record_tools(record: dict[str, Any]) -> str | None:
    """The record's ``tools`` (or legacy OpenAI ``functions``) as the JSON text of an OpenAI tools list
    (``[{"type": "function", "function": {"name", ...}}]``, in the source's order and key order); a bare
    function schema (``{"name", "description", "parameters"}``, as LLaMA-Factory's ``tools`` holds) is
    wrapped. None when the record offers none (missing, null or an empty list).

    Raises:
        RowError: ``tools`` is not JSON, not a list, or an entry is not a function schema with a name.
    """
    key = "tools" if record.get("tools") is not None else "functions"
    raw = record.get(key)
    if raw is None:
        return None
    if isinstance(raw, str):
        if not raw.strip():
            return None
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RowError(f"bad tools: '{key}' is a string that is not JSON ({exc})") from None
    if not isinstance(raw, list):
        raise RowError(f"bad tools: '{key}' must be a list of function schemas, got {type(raw).__name__}")
    tools = []
    for j, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise RowError(f"bad tools: {key}[{j}] is a {type(tool).__name__}, expected an object")
        if "type" in tool or "function" in tool:
            if tool.get("type", "function") != "function":
                raise RowError(f"bad tools: {key}[{j}] has type {tool.get('type')!r}; only 'function' tools are read")
            schema = tool.get("function")
        else:
            schema, tool = tool, {"type": "function", "function": tool}
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str) or not schema["name"].strip():
            raise RowError(f"bad tools: {key}[{j}] is not a function schema with a name ({{'name', 'parameters'}})")
        tools.append(tool)
    return json.dumps(tools, ensure_ascii=False) if tools else None


def content_text(content: Any, where: str) -> str | None:
    """The text of one message's content: a string, or a list of parts whose text parts are joined
    with ``\n`` (``{"type": "text", "text": ...}``, ``{"text": ...}`` or plain strings).

    Returns None for a missing content. Raises RowError for a part that is not text (naming its type)
    or content of another type.
    """
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RowError(
            f"bad content: {where} content is a {type(content).__name__}, expected a string or a list of parts"
        )
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type", "text" if "text" in part else None) if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RowError(f"non-text content: {where} part {j} has type {kind!r}; only text parts are supported")
        texts.append(part["text"])
    return "\n".join(texts)


class _Conversation:
    """Reads one ``messages`` / ``conversations`` list: roles, content, tool calls and the results answering them."""

    def __init__(self, field_name: str, role_key: str, content_key: str) -> None:
        self.field_name, self.role_key, self.content_key = field_name, role_key, content_key
        self.n_calls = 0  # calls seen so far: a call without an id gets "call_<n>"
        self.open: list[tuple[str, str]] = []  # (id, name) of the calls of the assistant turn before
        self.open_where = ""
        self.answered: set[str] = set()

    def read(self, raw: Any) -> tuple[list[dict[str, Any]], bool]:
        """``(messages, final_reply)``: the checked, API-shaped messages before a final assistant reply, and
        whether there was one (dropped)."""
        name = self.field_name
        if not isinstance(raw, list) or not raw:
            raise RowError(f"empty content: '{name}' must be a non-empty list")
        roles = []
        for k, turn in enumerate(raw):
            if not isinstance(turn, dict):
                raise RowError(f"bad message: {name}[{k}] is not an object")
            role_raw = turn.get(self.role_key, turn.get("role"))
            role = ROLE_ALIASES.get(str(role_raw).lower()) if role_raw is not None else None
            if role is None:
                raise RowError(f"unknown role: {name}[{k}] has role {role_raw!r}")
            roles.append((role, str(role_raw).lower()))
        if not any(role == "user" for role, _ in roles):
            raise RowError("no user message")
        final_reply = roles[-1][0] == "assistant"
        messages = []
        for k in range(len(raw) - final_reply):
            messages.append(self.message(raw[k], k, *roles[k]))
        self.close(f"{name}[{len(raw) - 1}]" if final_reply else "the end of the conversation")
        return messages, final_reply

    def message(self, turn: dict[str, Any], k: int, role: str, raw_role: str) -> dict[str, Any]:
        where = f"{self.field_name}[{k}] ({role})"
        content_raw = turn.get(self.content_key, turn.get("content"))
        if role == "tool":
            return self.tool_result(turn, k, raw_role, content_text(content_raw, where))
        self.close(f"{self.field_name}[{k}]")
        if role in ("system", "user"):
            content = content_text(content_raw, where)
            if not isinstance(content, str) or not content.strip():
                raise RowError(f"empty content: {where} has no text")
            return {"role": role, "content": content}
        if raw_role == "function_call":  # ShareGPT (LLaMA-Factory): the value is the call(s) as JSON text
            try:
                parsed = json.loads(content_raw) if isinstance(content_raw, str) else content_raw
            except json.JSONDecodeError as exc:
                raise RowError(f"bad tool call: {where} function_call value is not JSON ({exc})") from None
            message: dict[str, Any] = {"role": "assistant", "tool_calls": self.calls(parsed, where)}
        else:
            content = content_text(content_raw, where)
            raw_calls = turn.get("tool_calls") or turn.get("function_call")
            calls = self.calls(raw_calls, where) if raw_calls else []
            if not calls and (content is None or not content.strip()):
                raise RowError(f"empty content: {where} has neither text nor tool_calls")
            message = {"role": "assistant"}
            if content is not None:
                message["content"] = content
            if calls:
                message["tool_calls"] = calls
        reasoning = turn.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise RowError(f"bad field: {where} reasoning_content is a {type(reasoning).__name__}, not a string")
            message["reasoning_content"] = reasoning
        return message

    def calls(self, raw: Any, where: str) -> list[dict[str, Any]]:
        """OpenAI ``tool_calls`` (or a legacy ``function_call`` / ShareGPT call object, or a list of them) as
        ``[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]``; opens them for results."""
        if isinstance(raw, dict):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise RowError(f"bad tool call: {where} tool_calls is a {type(raw).__name__}, expected a non-empty list")
        out, ids = [], set()
        for j, call in enumerate(raw):
            at = f"{where} tool_calls[{j}]"
            if not isinstance(call, dict):
                raise RowError(f"bad tool call: {at} is a {type(call).__name__}, expected an object")
            if call.get("type", "function") != "function":
                raise RowError(f"bad tool call: {at} has type {call.get('type')!r}; only function calls are read")
            function = call.get("function", call)  # legacy function_call / ShareGPT: {"name", "arguments"} itself
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str) or not name.strip():
                raise RowError(f"bad tool call: {at} has no function name")
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments)
                except json.JSONDecodeError as exc:
                    raise RowError(f"bad tool call: {at} ({name}) arguments are not JSON ({exc})") from None
            else:
                parsed = arguments
                arguments = json.dumps(arguments, ensure_ascii=False)
            if not isinstance(parsed, dict):
                raise RowError(
                    f"bad tool call: {at} ({name}) arguments are not a JSON object (got {type(parsed).__name__})"
                )
            try:  # JSON text may escape a lone surrogate ("\ud800"): valid in the file, refused by the tokenizer
                json.dumps(parsed, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = exc.object[exc.start : exc.start + 1].encode("unicode_escape").decode()
                raise RowError(
                    f"bad tool call: {at} ({name}) arguments hold a lone surrogate ({bad}), not valid Unicode: the "
                    "tokenizer cannot render them; fix or remove the record"
                ) from None
            call_id = call.get("id")
            call_id = str(call_id) if isinstance(call_id, (str, int)) and call_id != "" else f"call_{self.n_calls}"
            if call_id in ids:
                raise RowError(f"bad tool call: {at} repeats the call id {call_id!r}")
            ids.add(call_id)
            self.n_calls += 1
            out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        self.open = [(c["id"], c["function"]["name"]) for c in out]
        self.open_where, self.answered = where, set()
        return out

    def tool_result(self, turn: dict[str, Any], k: int, raw_role: str, content: str | None) -> dict[str, Any]:
        """A tool message matched to a call of the assistant turn before it (by ``tool_call_id``; without one,
        the first call with no result yet, of the same name for a legacy ``function`` message)."""
        where = f"{self.field_name}[{k}] (tool)"
        if not self.open:
            raise RowError(f"tool message: {where} is a tool result with no assistant tool call before it")
        call_id, name = turn.get("tool_call_id"), turn.get("name")
        ids = [i for i, _ in self.open]
        if call_id not in (None, ""):
            call_id = str(call_id)
            if call_id not in ids:
                raise RowError(
                    f"tool message: {where} answers call id {call_id!r}, which the assistant turn before it "
                    f"did not make (its calls: {ids})"
                )
            if call_id in self.answered:
                raise RowError(f"tool message: {where} answers call id {call_id!r} a second time")
        else:
            free = [
                (i, n)
                for i, n in self.open
                if i not in self.answered and (raw_role != "function" or not isinstance(name, str) or n == name)
            ]
            if not free:
                raise RowError(
                    f"tool message: {where} answers no call: each call of the assistant turn before it "
                    f"({ids}) already has its result"
                )
            call_id = free[0][0]
            if raw_role in ("function", "observation") and not isinstance(name, str):
                name = free[0][1]  # a converted result names its call, as an OpenAI tool message does
        self.answered.add(call_id)
        message = {"role": "tool", "content": content if content is not None else "", "tool_call_id": call_id}
        if isinstance(name, str):
            message["name"] = name
        return message

    def close(self, before: str) -> None:
        """A non-tool message (or the end) comes: every call of the last assistant turn must have its result."""
        missing = [i for i, _ in self.open if i not in self.answered]
        if missing:
            raise RowError(
                f"unanswered tool call: {self.open_where} calls {missing} get no tool result before {before}"
            )
        self.open = []


def turn_kind(context: list[dict[str, Any]], tools: str | None) -> str:
    """The kind of assistant turn a context asks for: ``"prompt"`` (only system/user messages, one user message,
    no tools), ``"after_tool"`` (the last message is a tool result) or ``"follow_up"`` (anything else)."""
    if context[-1]["role"] == "tool":
        return "after_tool"
    roles = [m["role"] for m in context]
    if tools is None and set(roles) <= {"system", "user"} and roles.count("user") == 1:
        return "prompt"
    return "follow_up"


def conversation_turns(conversation: Conversation, turns: str) -> list[TurnContext]:
    """The contexts one conversation gives, in turn order.

    ``turns="last"``: one, the conversation with its trailing assistant turns dropped. ``turns="every"``: one per
    assistant turn (the conversation's own messages before it; the source's assistant turns stay as context of
    later ones), plus one for a trailing user or tool message with no reply. A context without a user message
    (an assistant turn before the first user message) gives no row; its turn is still counted.

    Raises:
        ValueError: ``turns`` is neither ``"last"`` nor ``"every"``.
    """
    messages = conversation.messages
    if turns == "last":
        end = len(messages)
        while end and messages[end - 1]["role"] == "assistant":
            end -= 1
        ends = [end]
    elif turns == "every":
        ends = [p for p, m in enumerate(messages) if m["role"] == "assistant"] + [len(messages)]
    else:
        raise ValueError(f"turns: {turns!r} is not one of {list(TURNS)}")
    out = []
    for end in ends:
        context = messages[:end]
        if not any(m["role"] == "user" for m in context):
            continue
        turn = sum(m["role"] == "assistant" for m in context)
        out.append(TurnContext(context, turn, turn_kind(context, conversation.tools)))
    return out
