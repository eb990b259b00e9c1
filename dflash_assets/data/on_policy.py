"""On-policy agentic trajectories (no Dagster imports): the target is the assistant of a BFCL multi-turn task.

A :class:`Trajectory` holds one conversation: the task's first user turn and its tools are sent; the reply's tool
calls are read from the generated text in the format the target's template writes (``<tool_call>`` blocks of
Hermes JSON or of Qwen3.6's ``<function=...>`` XML, :func:`parse_tool_calls`) and executed by the task's
:class:`~dflash_assets.data.bfcl.ToolEnvironment`; their results go back as ``tool`` messages and the target is
asked again. A reply without a call (or the ``max_rounds``-th reply to one user turn) moves on to the task's next
user turn; the conversation ends after its last user turn, or at ``max_turns`` assistant turns.

The context of each later turn keeps the model's own reply exactly as generated (its text, tool-call markup
included, as the assistant message's ``content``), never a parsed call re-rendered. A call that cannot be read
(not JSON, no name, not closed before the cap) or that the environment refuses (unknown function, bad
arguments, a raising tool) becomes an ``{"error": ...}`` tool result in the conversation, never a crash.

Each assistant turn gives one completions row (:meth:`Trajectory.row`): the completions schema, keyed by
:func:`row_key` (the conversation's corpus index x :data:`TURN_STRIDE` + turn), plus :data:`ON_POLICY_COLUMNS`:
the context the turn was generated from (``messages``, ``tools``), the reply as appended (``reply``) and the tool
results it got (``tool_messages``). A rerun rebuilds a conversation from its rows (:meth:`Trajectory.replay`:
the calls executed again, no request sent) and goes on at its first turn without a row.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import polars as pl

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.bfcl import BfclTask, ToolEnvironment
from dflash_assets.data.shapes import content_hash
from dflash_assets.data.tool_sandbox import DEFAULT_MAX_RESULT_BYTES, checked_result
from dflash_assets.generation.rows.records import COMPLETIONS_SCHEMA, TOOL_CALL_OPEN, row_from_result

__all__ = [
    "ON_POLICY_COLUMNS",
    "ON_POLICY_SCHEMA",
    "TOOL_CALL_CLOSE",
    "TURN_STRIDE",
    "ToolCall",
    "Trajectory",
    "parse_tool_calls",
    "row_key",
]

TOOL_CALL_CLOSE = "</tool_call>"
#: Row keys: the conversation's corpus index x TURN_STRIDE + its assistant turn (0-based); ``max_turns`` < it.
TURN_STRIDE = 1 << 12
#: ``ops.completions.config``'s defaults (freshness compares a partition's limits with the configured ones).
DEFAULT_MAX_ROUNDS = 8
DEFAULT_MAX_TURNS = 64
#: What an on-policy row holds beyond the completions schema (JSON text: the context as sent, the reply as
#: appended to it, the tool messages its calls got).
ON_POLICY_COLUMNS = {
    "conversation_id": pl.String,
    "turn": pl.Int64,
    "messages": pl.String,
    "tools": pl.String,
    "reply": pl.String,
    "tool_messages": pl.String,
}
ON_POLICY_SCHEMA = {**COMPLETIONS_SCHEMA, **ON_POLICY_COLUMNS}


def row_key(corpus_index: int, turn: int) -> int:
    """The row (and journal) key of assistant turn ``turn`` of the conversation at corpus index ``corpus_index``.

    Raises:
        ValueError: ``turn`` outside ``[0, TURN_STRIDE)``.
    """
    if not 0 <= turn < TURN_STRIDE:
        raise ValueError(f"turn {turn} is outside [0, {TURN_STRIDE})")
    return corpus_index * TURN_STRIDE + turn


@dataclass(frozen=True)
class ToolCall:
    """One tool call read from a reply: ``name`` and ``arguments`` (JSON text), or ``error`` (why it cannot be
    executed: ``name`` None, ``arguments`` the raw text between the tags)."""

    name: str | None
    arguments: str
    error: str | None = None


def parse_tool_calls(text: str | None, tools: list[dict[str, Any]] | None = None) -> list[ToolCall]:
    """The tool calls in a reply's text, in order: each ``<tool_call>...</tool_call>`` block holds one, in either
    format a target's template asks for:

    - Hermes JSON (Qwen2.5, the shipped SmolLM2 template): ``{"name": str, "arguments": object or JSON text}`` (a
      missing or null ``arguments`` is ``{}``);
    - Qwen3.6's XML: ``<function=NAME>`` then ``<parameter=KEY>\\nVALUE\\n</parameter>`` blocks, then
      ``</function>``. A value is text as written when ``tools`` (the OpenAI tools list offered) gives the
      parameter type ``string``, else JSON when it parses as JSON, else text (the template writes a string as is
      and any other value as JSON).

    A block in neither format, or a ``<tool_call>`` never closed (the cap cut it), is a call with its ``error``;
    text outside the blocks is not read. Never raises."""
    calls: list[ToolCall] = []
    rest = text or ""
    while (start := rest.find(TOOL_CALL_OPEN)) >= 0:
        rest = rest[start + len(TOOL_CALL_OPEN) :]
        end = rest.find(TOOL_CALL_CLOSE)
        if end < 0:
            calls.append(ToolCall(None, rest, f"the tool call is not closed by {TOOL_CALL_CLOSE} (cut by the cap?)"))
            break
        body = rest[:end]
        calls.append(_read_xml_call(body, tools) if body.strip().startswith(_FUNCTION_OPEN) else _read_call(body))
        rest = rest[end + len(TOOL_CALL_CLOSE) :]
    return calls


_FUNCTION_OPEN, _FUNCTION_CLOSE = "<function=", "</function>"
_XML_CALL = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _read_xml_call(body: str, tools: list[dict[str, Any]] | None) -> ToolCall:
    match = _XML_CALL.fullmatch(body)
    if match is None:
        return ToolCall(None, body, f"the tool call is not one {_FUNCTION_OPEN}NAME>...{_FUNCTION_CLOSE} block")
    name, inner = match.group(1).strip(), match.group(2)
    types = {}
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            types = {k: v.get("type") for k, v in properties.items() if isinstance(v, dict)}
    arguments: dict[str, Any] = {}
    for key, value in _XML_PARAMETER.findall(inner):
        key = key.strip()
        if key in arguments:
            return ToolCall(None, body, f"the tool call gives parameter {key!r} twice")
        if types.get(key) == "string":
            arguments[key] = value
            continue
        try:
            arguments[key] = json.loads(value)
        except (ValueError, RecursionError):
            arguments[key] = value
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _read_call(body: str) -> ToolCall:
    try:
        call = json.loads(body.strip())
    except (ValueError, RecursionError) as exc:
        return ToolCall(None, body, f"the tool call is not JSON ({str(exc)[:200]})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ToolCall(None, body, 'the tool call is not a JSON object with a "name" string')
    arguments = call.get("arguments")
    if arguments is None:
        arguments = {}
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(call["name"], text)


def error_result(message: str) -> str:
    """A tool result saying why a call was not executed (the environment's own error shape)."""
    return json.dumps({"error": message}, ensure_ascii=False)


class Trajectory:
    """One on-policy conversation of a BFCL task (see the module docstring).

    Args:
        task: the task; its user turns are asked in order.
        tools: the OpenAI tools list offered (the corpus row's: ``tools=used`` or ``involved``), as JSON text.
        anchor: the corpus row of the conversation's first turn (``index``, ``conversation_id``, ``source``).
        max_rounds: replies to one user turn after which the next user turn is asked, calls or not (>= 1).
        max_turns: assistant turns after which the conversation ends (1 .. TURN_STRIDE - 1).
        env: what executes the calls (``call(name, arguments) -> str``): default the task's own
            :class:`~dflash_assets.data.bfcl.ToolEnvironment` in this process; a run passes a
            :class:`~dflash_assets.data.tool_sandbox.SandboxedEnvironment` (bounded in time and size).
        max_result_bytes: results over this many UTF-8 bytes, or not valid Unicode, become error results
            (:func:`~dflash_assets.data.tool_sandbox.checked_result`), as any other row text is checked.

    Attributes:
        messages: the conversation so far (API-shaped): the context of the next request while not ``done``.
        turn: assistant turns so far; ``kind``: the next turn's kind (``prompt``, ``after_tool``, ``follow_up``).
        ended_by: why it is done (``task``: its last user turn answered, ``max_turns``, ``context``: the next turn
            no longer fits the servers' context), None while not done.
        rounds_capped: user turns left for the next one at ``max_rounds`` although the last reply called a tool;
        rounds_max: the most replies given to one user turn (freshness: which limit changes touch it).

    Raises:
        ValueError: a limit out of range. BfclError: the environment cannot be built (see ToolEnvironment).
    """

    def __init__(
        self,
        task: BfclTask,
        tools: str,
        anchor: dict[str, Any],
        max_rounds: int,
        max_turns: int,
        env: Any = None,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    ):
        if max_rounds < 1 or not 1 <= max_turns < TURN_STRIDE:
            raise ValueError(f"max_rounds must be >= 1 and max_turns in [1, {TURN_STRIDE}): {max_rounds}, {max_turns}")
        self.task, self.tools, self.anchor = task, tools, anchor
        self.max_rounds, self.max_turns = max_rounds, max_turns
        self.env = env if env is not None else ToolEnvironment(task)
        self.max_result_bytes = max_result_bytes
        self.ended_by: str | None = None
        self.rounds_capped = self.rounds_max = 0
        self._offered = json.loads(tools) if tools else []
        self.messages: list[dict[str, Any]] = []
        self.user_turn, self.rounds, self.turn = -1, 0, 0
        self.kind, self.done = "prompt", False
        self._next_user_turn()

    def _next_user_turn(self) -> None:
        self.rounds = 0
        while True:
            self.user_turn += 1
            if self.user_turn >= len(self.task.turns):
                self.end("task")
                return
            users = self.task.turns[self.user_turn]
            if users:  # a turn without a user message adds nothing to ask
                self.messages.extend({"role": m["role"], "content": m["content"]} for m in users)
                self.kind = "prompt" if self.turn == 0 else "follow_up"
                return

    def end(self, why: str) -> None:
        """The conversation is done, ``why`` (:attr:`ended_by`)."""
        self.done, self.ended_by = True, why

    @property
    def key(self) -> int:
        """The key of the next turn's row."""
        return row_key(int(self.anchor["index"]), self.turn)

    def context_hash(self) -> str:
        """The content hash of the next turn's context (messages and tools, as the corpus hashes a row)."""
        return content_hash(self.messages, self.tools)

    def request_body(self, settings: GenerationSettings, model: str) -> dict[str, Any]:
        """The next turn's request: the conversation so far and its tools (``seed`` offset by the row key)."""
        return settings.request_body(model, self.messages, self.key, self.tools)

    def row(self, result: Any, settings: GenerationSettings) -> dict[str, Any]:
        """The row of the next turn, from the server's ``result`` for it (a successful CompletionResult); then the
        reply is taken (:meth:`answer`) and its tool results are in ``tool_messages``."""
        prompt = {
            "index": self.key,
            "prompt_id": f"{self.anchor['conversation_id']}#on_policy{self.turn}",
            "content_hash": self.context_hash(),
            "source": self.anchor["source"],
            "turn_kind": self.kind,
        }
        row = row_from_result(result, prompt, settings)
        turn, context = self.turn, json.dumps(self.messages, ensure_ascii=False)
        reply = self._reply(result.content, result.reasoning_content)
        results = self.answer(reply)
        row.update(
            conversation_id=self.anchor["conversation_id"],
            turn=turn,
            messages=context,
            tools=self.tools,
            reply=json.dumps(reply, ensure_ascii=False),
            tool_messages=json.dumps(results, ensure_ascii=False),
        )
        return row

    @staticmethod
    def _reply(content: str | None, reasoning: str | None) -> dict[str, Any]:
        reply: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if reasoning is not None:
            reply["reasoning_content"] = reasoning
        return reply

    def answer(self, reply: dict[str, Any]) -> list[dict[str, Any]]:
        """Take the model's reply to the current context: append it as generated, execute its tool calls in order
        and append their results, then go on (ask again after calls, else the next user turn; or end). Returns
        the tool messages appended.

        Raises:
            RuntimeError: the conversation is done.
        """
        if self.done:
            raise RuntimeError(f"conversation {self.anchor['conversation_id']} is done: no turn to answer")
        self.messages.append(reply)
        calls = parse_tool_calls(reply.get("content"), self._offered)
        results = []
        for k, call in enumerate(calls):
            if call.error is None:
                text = checked_result(call.name, self.env.call(call.name, call.arguments), self.max_result_bytes)
            else:
                text = error_result(call.error)
            message = {"role": "tool", "tool_call_id": f"call_{self.turn}_{k}", "content": text}
            if call.name is not None:
                message["name"] = call.name
            results.append(message)
        self.messages.extend(results)
        self.turn += 1
        self.rounds += 1
        self.rounds_max = max(self.rounds_max, self.rounds)
        if self.turn >= self.max_turns:
            more = (calls and self.rounds < self.max_rounds) or any(self.task.turns[self.user_turn + 1 :])
            self.end("max_turns" if more else "task")  # only a conversation the limit cut is touched by raising it
        elif calls and self.rounds < self.max_rounds:
            self.kind = "after_tool"
        else:
            self.rounds_capped += bool(calls)
            self._next_user_turn()
        return results

    def replay(self, row: dict[str, Any]) -> bool:
        """Take a stored row of this conversation's next turn without a request: its reply is appended and its
        calls executed again (the environment's state is rebuilt). False, and nothing changed, when the row is
        not the next turn's or was generated from another context than the conversation's now (then it and
        every later row of the conversation are generated again)."""
        if self.done or row.get("turn") != self.turn or row.get("prompt_hash") != self.context_hash():
            return False
        self.answer(json.loads(row["reply"]))
        return True
