"""Hostile replies for the stand-in server: what a broken or malicious OpenAI-compatible server (or a gateway
in front of one) can send back, chosen by the prompt, so one server process serves every case of a test.

A request whose last user message is ``hostile:<kind>`` gets :data:`HOSTILE` ``[kind]``; any other prompt gets a
normal reply naming it (``"Answer to: <prompt>"``, 5 completion tokens, ids ``[1, 2, 3, 4, 5]``). Kinds ending
in ``-once`` are hostile on a prompt's first arrival only (a transient fault: the retry gets a normal reply);
``gzipped`` is a well-formed reply that is merely gzip-encoded.

Served from its own process: ``python -m dflash_simulators.stand_in_server --script hostile``.
"""

from __future__ import annotations

import functools
import gzip
import json
import threading
from collections import Counter
from typing import Any

from dflash_simulators.behaviours import Behaviour, Raw, Reply, Trickle
from dflash_simulators.counting_proxy import last_user_message

PREFIX = "hostile:"
DEEP = 100_000  # levels: far past the JSON reader's ~1,000
OVERSIZE_BYTES = 9 << 20  # over the client's default 8 MiB cap
TEST_VOCAB_SIZE = 1000  # what a test configures as the served model's vocabulary for "token-id-vocab"


def _reply_bytes(text: str = "fine") -> bytes:
    return json.dumps(Reply(content=text, reasoning=None).payload()).encode()


def _with_text(field: str, escaped: str) -> bytes:
    """A normal reply whose ``field`` (content or reasoning_content) is the JSON string ``escaped`` as written."""
    payload = Reply(content="PLACEHOLDER", reasoning="PLACEHOLDER_R").payload()
    text = json.dumps(payload)
    return text.replace('"PLACEHOLDER"' if field == "content" else '"PLACEHOLDER_R"', escaped).encode()


@functools.cache
def _deep() -> bytes:
    return b'{"choices": ' + b"[" * DEEP + b"]" * DEEP + b"}"


@functools.cache
def _oversize() -> bytes:
    return json.dumps(Reply(content="x" * OVERSIZE_BYTES, reasoning=None).payload()).encode()


@functools.cache
def _gzip_of_zeros() -> bytes:
    """~64 KB of gzip that inflates to 64 MiB."""
    return gzip.compress(b"\0" * (64 << 20), 9)


HOSTILE: dict[str, Any] = {
    # bodies that do not decode, or decode past the reader's depth
    "deep": lambda: Raw(200, _deep()),
    # text that is not valid Unicode (JSON escapes of lone surrogates): UTF-8 cannot store it
    "surrogate-content": lambda: Raw(200, _with_text("content", '"answer \\ud800 here"')),
    "surrogate-reasoning": lambda: Raw(200, _with_text("reasoning", '"thinking \\udfff"')),
    # token ids past Int32 or past the vocabulary, and negative
    "token-id-2^31": lambda: Reply(content="ids", reasoning=None, token_ids=[5, 2**31]),
    "token-id-vocab": lambda: Reply(content="ids", reasoning=None, token_ids=[5, TEST_VOCAB_SIZE]),
    "token-id-negative": lambda: Reply(content="ids", reasoning=None, token_ids=[-1, 5]),
    # token counts past Int64, and negative
    "prompt-tokens-2^63": lambda: Reply(content="counts", reasoning=None, prompt_tokens=2**63),
    "completion-tokens-2^64": lambda: Reply(content="counts", reasoning=None, completion_tokens=2**64),
    "completion-tokens-negative": lambda: Reply(content="counts", reasoning=None, completion_tokens=-3),
    # bodies over the size cap: declared, undeclared (read until the connection closes), and a gzip bomb
    "oversize": lambda: Raw(200, _oversize()),
    "oversize-undeclared": lambda: Raw(200, _oversize(), declare_length=False),
    "gzip-bomb": lambda: Raw(200, _gzip_of_zeros(), headers=(("Content-Encoding", "gzip"),)),
    # a reply trickled a byte every 50 ms: ~15 s for its ~300 bytes, every read well inside any read timeout
    "trickle": lambda: Trickle(every_s=0.05, chunk_bytes=1, payload=_reply_bytes("trickled")),
    "trickle-once": lambda: Trickle(every_s=0.05, chunk_bytes=1, payload=_reply_bytes("trickled")),
    # not hostile: a well-formed reply gzip-encoded unasked (a gateway's doing) is read as any other
    "gzipped": lambda: Raw(200, gzip.compress(_reply_bytes("gzipped fine")), headers=(("Content-Encoding", "gzip"),)),
    # error replies whose text is hostile (the row's error is stored too)
    "error-deep": lambda: Raw(500, b'{"error": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    "error-surrogate": lambda: Raw(400, b'{"error": {"message": "bad \\ud800 input"}}'),
}


def normal_reply(prompt: str) -> Reply:
    """The reply a non-hostile prompt gets."""
    return Reply(
        content=f"Answer to: {prompt}", reasoning=None, prompt_tokens=9, completion_tokens=5, token_ids=[1, 2, 3, 4, 5]
    )


def hostile_script() -> Any:
    """A stand-in server script: ``script(n, body) -> Behaviour`` per the module's rule (thread-safe)."""
    arrivals: Counter[str] = Counter()
    lock = threading.Lock()

    def script(n: int, body: dict[str, Any]) -> Behaviour:
        prompt = last_user_message(body) or ""
        kind = prompt[len(PREFIX) :] if prompt.startswith(PREFIX) else None
        with lock:
            arrivals[prompt] += 1
            first = arrivals[prompt] == 1
        if kind in HOSTILE and (first or not kind.endswith("-once")):
            return HOSTILE[kind]()
        return normal_reply(prompt)

    return script
