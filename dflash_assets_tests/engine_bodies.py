"""Every kind of chat body the project sends a server, built by the project's own code (issue 49, item 3): the
contract tests hand them to SGLang's and vLLM's own code and compare what those hand the chat template with what
the project renders (:func:`~dflash_assets.generation.engines.engine_render.template_inputs`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_assets.common.conversation import api_messages, api_tools
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.bfcl import ground_truth_record, load_tasks
from dflash_assets.data.on_policy import Trajectory
from dflash_assets.generation.engines.chat_render import PROBE_MESSAGES, PROBE_TOOLS
from dflash_assets.generation.rows.continuation import continuation_body
from dflash_assets.generation.rows.tail_chunks import TailChunker
from dflash_assets.generation.servers.pool import ServerPool
from dflash_assets.generation.servers.probe import probe_chat
from dflash_simulators.behaviours import Raw
from dflash_simulators.stand_in_server import FakeServer

TOJSON_TEMPLATE = Path(__file__).parent / "data" / "smollm2_tools_tojson.jinja"
#: a function without a description, one with ``strict``: the dumps add or keep keys there
BARE_TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}, "strict": True}},
]


#: an earlier assistant turn with its thinking (reasoning_content: SGLang reads it, vLLM only as "reasoning")
THOUGHT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
    {"role": "user", "content": "And 3+3?"},
]


@dataclass
class Body:
    """One body as sent (``body``), the context it was made from (``messages``, ``tools``: stored or API shape)
    and what the engine's chat template gets besides (``template_kwargs``)."""

    name: str
    body: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: Any
    continued: bool = False

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return dict(self.body.get("chat_template_kwargs") or {})

    @property
    def api_messages(self) -> list[dict[str, Any]]:
        return api_messages(self.messages)

    @property
    def api_tools(self):
        return api_tools(self.tools)


def bfcl_row(turns: int = 6) -> tuple[list[dict[str, Any]], str]:
    """A BFCL conversation's context after ``turns`` messages (user, tool calls, tool results; ending on a
    tool result) and its tools as stored (JSON text, every involved function: 31 for the first task)."""
    record = ground_truth_record(load_tasks()[0], "involved")
    messages = record["messages"][:turns]
    while messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    return messages, json.dumps(record["tools"], ensure_ascii=False)


def project_bodies(backend: str, model: str = "m", settings: GenerationSettings | None = None) -> list[Body]:
    """The bodies the project sends a ``backend`` server, each made by the code that sends it (a tail chunk and
    continuations only to SGLang: ``continue_final_message`` is SGLang's, ``ContinuationPlanner.gate``)."""
    settings = settings or GenerationSettings(max_output_tokens=16, seed=11)
    pool = ServerPool(["http://x/v1"], model, None, 4, backend)
    bfcl_messages, bfcl_tools = bfcl_row()
    plain = [{"role": "user", "content": "What is 2+2?"}]
    out = [
        Body("plain prompt", pool.adapt_body(settings.request_body(model, plain, 3)), plain, None),
        Body(
            "tool conversation (BFCL, 31 tools)",
            pool.adapt_body(settings.request_body(model, bfcl_messages, 4, bfcl_tools)),
            bfcl_messages,
            bfcl_tools,
        ),
        Body(
            "the template probe (tools, a call, a result)",
            pool.adapt_body(settings.request_body(model, PROBE_MESSAGES, 5, PROBE_TOOLS)),
            PROBE_MESSAGES,
            PROBE_TOOLS,
        ),
        Body(
            "a follow-up after a turn that thought",
            pool.adapt_body(settings.request_body(model, THOUGHT, 7)),
            THOUGHT,
            None,
        ),
        Body(
            "tools without a description, with strict",
            pool.adapt_body(settings.request_body(model, plain, 6, BARE_TOOLS)),
            plain,
            BARE_TOOLS,
        ),
    ]
    # an on-policy conversation's second turn: the first reply (text with a tool call) and its result appended
    task = load_tasks()[0]
    tools = json.dumps(ground_truth_record(task, "used")["tools"], ensure_ascii=False)
    anchor = {"index": 7, "conversation_id": f"bfcl_multi_turn_base:{task.id}", "source": "bfcl_multi_turn_base"}
    trajectory = Trajectory(task, tools, anchor, max_rounds=4, max_turns=8)
    call = json.loads(tools)[0]["function"]["name"]
    reply = f'<tool_call>\n{{"name": "{call}", "arguments": {{}}}}\n</tool_call>'
    trajectory.answer({"role": "assistant", "content": reply})
    out.append(
        Body(
            "on-policy turn after a tool result",
            pool.adapt_body(trajectory.request_body(settings, model)),
            [dict(m) for m in trajectory.messages],
            tools,
        )
    )
    if backend == "sglang":
        out += sglang_continuations(pool, settings, model, bfcl_messages, bfcl_tools, plain)
    out.append(Body("start-up probe", start_up_probe_body(pool), [{"role": "user", "content": "Hi"}], None))
    return out


def sglang_continuations(pool, settings, model, bfcl_messages, bfcl_tools, plain) -> list[Body]:
    """The bodies that continue a text: the end of a run in chunks (a first chunk and its follow-up) and a row cut
    by a lower cap, continued."""
    out = []
    chunker = TailChunker(settings, model, pool.adapt_body, opened=False, chunk_tokens=4, window_rows=1, total_rows=1)
    prompt = {"index": 8, "messages": bfcl_messages, "tools": bfcl_tools}
    first = chunker.first_body(1, prompt, pool.adapt_body(settings.request_body(model, bfcl_messages, 8, bfcl_tools)))
    out.append(Body("tail chunk", first, bfcl_messages, bfcl_tools))
    reply = type(
        "Result",
        (),
        {"index": 8, "latency_s": 0.1, "attempts": 1, "error": None, "reasoning_content": None,
         "content": "<think>\nSo far", "prompt_tokens": 10, "completion_tokens": 4, "finish_reason": "length"},
    )  # fmt: skip
    follow = chunker.follow_up(reply)
    out.append(Body("tail chunk follow-up", follow, bfcl_messages, bfcl_tools, continued=True))
    continued = pool.adapt_body(
        continuation_body(settings, model, plain, {"completion_tokens": 4}, "<think>\nSo far", 9, None)
    )
    out.append(Body("continuation of a cut row", continued, plain, None, continued=True))
    return out


def start_up_probe_body(pool: ServerPool) -> dict[str, Any]:
    """The body :func:`~dflash_assets.generation.servers.probe.probe_chat` sends, caught on a real socket."""
    reply = {"choices": [{"message": {"content": "ok"}, "finish_reason": "length"}]}
    with FakeServer(Raw(200, json.dumps(reply).encode())) as server:
        probe_chat(server.url, pool.model, extra_body=dict(pool.extra_body) or None)
        sent = server.bodies[0]
    assert isinstance(sent, dict)
    return sent


__all__ = ["BARE_TOOLS", "TOJSON_TEMPLATE", "Body", "bfcl_row", "project_bodies", "start_up_probe_body"]
