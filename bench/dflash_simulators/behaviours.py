"""What the stand-in server does with one request: the behaviours a script returns (a reply, an error, a hang,
a dropped connection, raw bytes, a trickle) and small scripts built of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Reply:
    """A normal 200 chat-completion reply (after ``delay_s`` seconds)."""

    content: str | None = "The answer."
    reasoning: str | None = "Some thinking."
    reasoning_field: str = "reasoning_content"  # SGLang name; vLLM >= 0.10 says "reasoning"
    finish_reason: str | None = "stop"
    prompt_tokens: int | None = 12
    completion_tokens: int | None = 7
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    delay_s: float = 0.0

    def payload(self) -> dict[str, Any]:
        """The reply JSON."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message[self.reasoning_field] = self.reasoning
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": self.finish_reason}
        if self.token_ids is not None:
            choice["token_ids"] = self.token_ids
        if self.prompt_token_ids is not None:
            choice["prompt_token_ids"] = self.prompt_token_ids
        payload: dict[str, Any] = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": "fake",
            "choices": [choice],
        }
        if self.prompt_tokens is not None or self.completion_tokens is not None:
            payload["usage"] = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": (self.prompt_tokens or 0) + (self.completion_tokens or 0),
            }
        return payload


@dataclass(frozen=True)
class Error:
    """An HTTP error reply in SGLang's shape ``{"object": "error", "message", "type", "code"}``.

    ``echo_auth`` appends the request's Authorization header to the message (a leaky server, to
    prove the client scrubs the API key).
    """

    status: int = 503
    message: str = "Service Unavailable"
    echo_auth: bool = False
    delay_s: float = 0.0


@dataclass(frozen=True)
class Hang:
    """Read the request, then never answer (sleeps ``seconds``, cancelled when the server stops)."""

    seconds: float = 3600.0


@dataclass(frozen=True)
class Drop:
    """Send the status line, headers and part of the body, then close the connection mid-reply."""

    delay_s: float = 0.0


@dataclass(frozen=True)
class Raw:
    """A reply with this exact status and body (e.g. a 200 whose body is not JSON). ``headers``: extra
    header lines (e.g. ``("Content-Encoding", "gzip")``); ``declare_length`` False: no Content-Length, the
    body ends when the connection closes."""

    status: int = 200
    payload: bytes = b"not json"
    headers: tuple[tuple[str, str], ...] = ()
    declare_length: bool = True


@dataclass(frozen=True)
class Trickle:
    """A 200 reply whose body is sent ``chunk_bytes`` at a time, one chunk every ``every_s`` seconds (a
    server, or a proxy, that holds a connection alive without ever finishing its reply)."""

    every_s: float = 0.2
    chunk_bytes: int = 1
    payload: bytes = b""


Behaviour = Reply | Error | Hang | Drop | Raw | Trickle
Script = Callable[[int, dict[str, Any]], Behaviour]


def fail_first(k: int, failure: Behaviour | None = None, then: Behaviour | None = None) -> Script:
    """Script: requests 0..k-1 get ``failure`` (default 503), the rest ``then`` (default a Reply)."""
    failure = failure if failure is not None else Error(503)
    then = then if then is not None else Reply()
    return lambda n, body: failure if n < k else then
