"""What the simulated model answers: how long it wants to write for a conversation (a lognormal draw keyed
by its content), and the reply fields for the part written under a cap."""

from __future__ import annotations

import hashlib
import json
import math
from statistics import NormalDist
from typing import Any

REASONING_SHARE = 0.9  # tokens of thinking before the answer starts
#: the simulated model's token ids for a thinking token (text ``"t "``) and an answer token (``"a "``)
THINK_TOKEN_ID, ANSWER_TOKEN_ID = 83, 64
_NORMAL = NormalDist()


def drawn_length(messages: Any, median: float, sigma: float, seed: str = "") -> int:
    """Output tokens the simulated model wants for ``messages``: a lognormal draw keyed by their hash.

    ``exp(ln(median) + sigma * z)`` with ``z`` the standard-normal quantile of a uniform taken from
    sha256(seed + messages JSON); at least 1 token.
    """
    digest = hashlib.sha256((seed + json.dumps(messages, sort_keys=True)).encode()).digest()
    u = (int.from_bytes(digest[:8], "big") + 0.5) / 2**64
    return max(1, round(math.exp(math.log(median) + sigma * _NORMAL.inv_cdf(u))))


def reply_fields(length: int, max_tokens: int, done: int = 0, raw: bool = False) -> dict[str, Any]:
    """finish_reason, completion_tokens, reasoning_content and content of a request wanting ``length``
    tokens in all, ``done`` of them already written (a continued prefix), under cap ``max_tokens`` on the
    new ones. Text is two bytes per token: ``"t "`` while thinking, ``"a "`` after. ``raw``: no reasoning
    parser: the text as generated, ``<think>`` / ``</think>`` included, in ``content``.

    As SGLang 0.5.23's reasoning parser sends them: ``content`` is ``""`` (not None) when the cap cut inside
    the thinking, ``reasoning_content`` None when the part written holds no thinking."""
    thinking, answering = _split(length, max_tokens, done)
    n = thinking + answering
    start, end, think = done, done + n, max(1, round(length * REASONING_SHARE))
    fields = {"finish_reason": "length" if length - done > max_tokens else "stop", "completion_tokens": n}
    if raw:
        opened = "<think>\n" if start == 0 else ""
        closed = (
            "</think>\n\n"
            if start <= think < end or (start < think and end == think and fields["finish_reason"] == "stop")
            else ""
        )
        return {**fields, "reasoning_content": None, "content": opened + "t " * thinking + closed + "a " * answering}
    return {**fields, "reasoning_content": "t " * thinking if thinking else None, "content": "a " * answering}


def reply_token_ids(length: int, max_tokens: int, done: int = 0) -> list[int]:
    """The ids of the tokens :func:`reply_fields` writes (same arguments): :data:`THINK_TOKEN_ID` per thinking
    token, then :data:`ANSWER_TOKEN_ID` per answer token; ``completion_tokens`` of them."""
    thinking, answering = _split(length, max_tokens, done)
    return [THINK_TOKEN_ID] * thinking + [ANSWER_TOKEN_ID] * answering


def _split(length: int, max_tokens: int, done: int) -> tuple[int, int]:
    """(thinking, answering) tokens written by a request continuing ``done`` tokens under ``max_tokens``."""
    n = max(0, min(length - done, max_tokens))
    think = max(1, round(length * REASONING_SHARE))
    start, end = done, done + n
    return max(0, min(end, think) - start), max(0, end - max(start, think))


def prompt_tokens_of(messages: Any) -> int:
    """``usage.prompt_tokens`` of ``messages``: their contents' words + 5 (the chat template's tokens)."""
    return sum(len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict)) + 5
