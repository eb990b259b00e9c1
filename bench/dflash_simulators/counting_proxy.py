"""A counting HTTP proxy on 127.0.0.1 in front of a real OpenAI-compatible server (for resume tests).

Every request is forwarded unchanged to the upstream server and its reply relayed back; requests are
counted *at the server side of the client*, i.e. what actually went over the wire, keyed by
``key(body)`` (default: the last user message of a chat-completions body). That is how a test proves
that a resumed run does not request a finished row again, even when the run that sent the first
requests was killed with SIGKILL (its counters died with it; the proxy's did not).

Minimal HTTP/1.1 on asyncio streams (:mod:`~dflash_simulators.http11`), run on its own event
loop in a background thread. The upstream leg uses ``httpx.AsyncClient`` with no timeout.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from dflash_simulators.http11 import ServerThread, read_request

# Hop-by-hop or recomputed headers: not forwarded in either direction.
_SKIP_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "accept-encoding",
        "content-encoding",
        "proxy-connection",
        "upgrade",
        "te",
    }
)


def last_user_message(body: Any) -> str | None:
    """``messages[-1]["content"]`` of the last ``user`` turn in a chat-completions body, else None."""
    if not isinstance(body, dict):
        return None
    for message in reversed(body.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else json.dumps(content)
    return None


class CountingProxy:
    """Forwarding proxy that counts requests per key. Context manager, or ``start()`` / ``stop()``.

    Args:
        upstream_base_url: the real server's base URL, e.g. ``http://127.0.0.1:8000/v1``.
        key: ``key(decoded JSON body) -> hashable | None``; None-keyed requests (non-JSON, probes
            without a user turn) are counted under None.

    Attributes:
        base_url: the proxy's base URL, same path as the upstream one (``http://127.0.0.1:<port>/v1``).
        requested: Counter of keys of requests received (counted on arrival, before forwarding).
        answered: Counter of keys whose upstream reply was written back completely to the caller.
        upstream_errors: number of requests the upstream leg failed (the caller then got a 502).
    """

    def __init__(self, upstream_base_url: str, key: Callable[[Any], Any] = last_user_message) -> None:
        parts = urlsplit(upstream_base_url.rstrip("/"))
        self._upstream_origin = urlunsplit((parts.scheme, parts.netloc, "", "", ""))
        self._path = parts.path
        self._key = key
        self._lock = threading.Lock()
        self._requested: Counter = Counter()
        self._answered: Counter = Counter()
        self.upstream_errors = 0
        self._http: httpx.AsyncClient | None = None
        self._listener = ServerThread("counting-proxy")

    @property
    def port(self) -> int:
        return self._listener.port

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self._path}"

    @property
    def requested(self) -> Counter:
        with self._lock:
            return Counter(self._requested)

    @property
    def answered(self) -> Counter:
        with self._lock:
            return Counter(self._answered)

    def reset(self) -> None:
        """Zero the counters (e.g. between a killed run and its resume)."""
        with self._lock:
            self._requested.clear()
            self._answered.clear()
            self.upstream_errors = 0

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> CountingProxy:
        """Bind a free port on 127.0.0.1 and serve from a background thread.

        Raises:
            OSError: the socket could not be bound.
        """

        def make_client() -> None:  # on the listener's loop, which it belongs to
            self._http = httpx.AsyncClient(
                base_url=self._upstream_origin, timeout=None, limits=httpx.Limits(max_connections=None)
            )

        async def close_client() -> None:
            if self._http is not None:
                await self._http.aclose()

        self._listener.start(self._handle, on_start=make_client, on_exit=close_client)
        return self

    def stop(self) -> None:
        """Close the listener and every open connection; idempotent."""
        self._listener.stop()

    def __enter__(self) -> CountingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- serving ------------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            if request is None:
                return
            try:
                key = self._key(json.loads(request.body)) if request.body else None
            except ValueError:
                key = None
            with self._lock:
                self._requested[key] += 1
            forward = [(n, v) for n, v in request.headers if n.lower() not in _SKIP_HEADERS]
            try:
                assert self._http is not None
                reply = await self._http.request(request.method, request.target, headers=forward, content=request.body)
                status, body, reply_headers = reply.status_code, reply.content, reply.headers.multi_items()
            except httpx.HTTPError as exc:
                with self._lock:
                    self.upstream_errors += 1
                status, body, reply_headers = 502, f"proxy: upstream failed: {exc!r}".encode(), []
            out = [f"HTTP/1.1 {status} {httpx.codes.get_reason_phrase(status) or 'Status'}"]
            out += [f"{n}: {v}" for n, v in reply_headers if n.lower() not in _SKIP_HEADERS]
            out.append(f"Content-Length: {len(body)}")
            writer.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()  # raises when the caller is gone (e.g. SIGKILLed): not answered
            if status == 200:
                with self._lock:
                    self._answered[key] += 1
            if request.wants_close:
                return
