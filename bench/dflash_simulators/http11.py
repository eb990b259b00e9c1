"""Minimal HTTP/1.1 for the project's stand-in servers: one request read from an asyncio stream, and a
listener on its own event loop in a background thread.

What the stand-ins need and no more: keep-alive, ``Content-Length`` bodies (what
:class:`~dflash_assets.generation.client.completion_client.CompletionClient`, ``httpx`` and ``openai`` send; no chunked
uploads). Used by :mod:`~dflash_simulators.stand_in_server`,
:mod:`~dflash_simulators.counting_proxy` and :mod:`~dflash_simulators.sglang_stub`. Stdlib only.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass(frozen=True)
class HttpRequest:
    """One request as read off the wire.

    Attributes:
        method, target: from the request line (``target`` keeps its query string).
        headers: ``(name, value)`` pairs in the order sent, names as sent.
        body: the ``Content-Length`` bytes (``b""`` without a body).
    """

    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def header(self, name: str, default: str = "") -> str:
        """The last value of header ``name`` (case-insensitive), else ``default``."""
        name = name.lower()
        found = default
        for key, value in self.headers:
            if key.lower() == name:
                found = value
        return found

    @property
    def wants_close(self) -> bool:
        """The client sent ``Connection: close``: answer, then close the connection."""
        return self.header("connection").lower() == "close"


async def read_request(reader: asyncio.StreamReader) -> HttpRequest | None:
    """Read one request; None when the peer closed the connection (or sent a head too long to be HTTP).

    Raises:
        asyncio.IncompleteReadError: the peer closed inside the body.
        ValueError: the request line has no method and target, or ``Content-Length`` is not a number.
    """
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = request_line.split(" ")
    if len(parts) < 2:
        raise ValueError(f"not an HTTP request line: {request_line[:100]!r}")
    headers = []
    for line in header_lines:
        if ":" in line:
            name, value = line.split(":", 1)
            headers.append((name.strip(), value.strip()))
    request = HttpRequest(parts[0], parts[1], tuple(headers), b"")
    length = int(request.header("content-length") or 0)
    body = await reader.readexactly(length) if length else b""
    return HttpRequest(request.method, request.target, request.headers, body)


class ServerThread:
    """``asyncio.start_server(handler)`` on 127.0.0.1, on an event loop of its own in a daemon thread,
    so that the code under test can keep the main thread's loop.

    Every connection's writer and handler task are tracked, so :meth:`stop` can die the way a killed
    server does: listener closed, open connections reset, handlers cancelled.

    Args:
        name: the thread's name.
        backlog: the listen backlog (a bench opens hundreds of connections at once).
    """

    def __init__(self, name: str, backlog: int = 1024) -> None:
        self.name = name
        self.backlog = backlog
        self.port = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()

    def start(
        self,
        handler: Handler,
        port: int = 0,
        *,
        on_start: Callable[[], object] | None = None,
        on_exit: Callable[[], Awaitable[object]] | None = None,
    ) -> int:
        """Bind 127.0.0.1:``port`` (0: any free port) and serve; returns the port.

        ``on_start`` runs on the loop's thread before the bind (e.g. to make an ``httpx.AsyncClient``
        there); ``on_exit`` is awaited on the loop after :meth:`stop` stopped it.

        Raises:
            OSError: the port could not be bound (or whatever ``on_start`` raised).
        """
        ready = threading.Event()
        errors: list[BaseException] = []

        async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            self._tasks.add(task)  # type: ignore[arg-type]
            self._writers.add(writer)
            try:
                await handler(reader, writer)
            except (asyncio.CancelledError, ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                self._writers.discard(writer)
                self._tasks.discard(task)  # type: ignore[arg-type]
                writer.close()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self.loop = loop
            asyncio.set_event_loop(loop)
            try:
                if on_start is not None:
                    on_start()
                self._server = loop.run_until_complete(
                    asyncio.start_server(tracked, "127.0.0.1", port, backlog=self.backlog)
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # surfaced to start()'s caller
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            if on_exit is not None:
                loop.run_until_complete(on_exit())
            loop.close()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        return self.port

    def stop(self) -> None:
        """Die abruptly: close the listener, reset every open connection, cancel pending handlers,
        stop the loop and join its thread. Idempotent."""
        loop, thread = self.loop, self._thread
        if loop is None or thread is None:
            return
        done = threading.Event()

        def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            for task in list(self._tasks):
                task.cancel()
            done.set()

        loop.call_soon_threadsafe(shutdown)
        done.wait(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self.loop = self._thread = None
