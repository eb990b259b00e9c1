"""A stand-in OpenAI-compatible ``/v1/chat/completions`` server on a real 127.0.0.1 socket, for fault tests.

It stands in only for faults a real server cannot be made to show on demand (503 bursts, hangs,
connections dropped mid-reply, malformed or hostile replies, replies trickled a byte at a time, sudden
death) and for a client throughput bench (instant replies).
Behaviour is scripted per request: ``script(n, body) -> Behaviour`` where ``n`` is the 0-based arrival
number of the request and ``body`` its decoded JSON.

Minimal HTTP/1.1 over asyncio streams (:mod:`~dflash_simulators.http11`), run on its own event
loop in a background thread so the client under test can use the main thread's loop. Stdlib only.

Run as a script (a server in its own process): ``python -m dflash_simulators.stand_in_server [--port P]
[--script instant|hostile|echo] [--log FILE]`` prints ``PORT <n>`` and serves until killed: instant replies
(the bench), :func:`~dflash_simulators.hostile_replies.hostile_script` (the reply a prompt names, for
tests) or :func:`echo_script` (a reply naming its prompt); ``--log`` records every request's prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

from dflash_simulators.behaviours import Behaviour, Drop, Error, Hang, Raw, Reply, Script, Trickle
from dflash_simulators.http11 import ServerThread, read_request

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    408: "Request Timeout",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


def _response(status: int, payload: bytes, headers: tuple[tuple[str, str], ...] = (), length: bool = True) -> bytes:
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
    size = f"Content-Length: {len(payload)}\r\n" if length else "Connection: close\r\n"
    head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\nContent-Type: application/json\r\n{size}{extra}\r\n"
    return head.encode() + payload


@dataclass
class _Stats:
    requests_received: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)
    replied_ok: list[dict[str, Any]] = field(default_factory=list)
    active: int = 0
    max_active: int = 0


class FakeServer:
    """Scriptable fake chat-completions server. Use as a context manager or ``start()``/``stop()``.

    Args:
        script: per-request behaviour, ``script(n, body)``; or one fixed :data:`Behaviour`; default Reply().
        record_bodies: keep every request body (turn off for the bench).

    Attributes (read from the test thread; appended under a lock):
        url: ``http://127.0.0.1:<port>``.
        requests_received: requests fully read so far.
        bodies: their JSON bodies in arrival order; auth_headers: their Authorization headers.
        replied_ok: bodies of requests whose 200 reply was completely written.
        max_concurrent: most requests being handled at once (read but not yet answered).
    """

    def __init__(self, script: Script | Behaviour | None = None, *, record_bodies: bool = True) -> None:
        if script is None:
            script = Reply()
        if not callable(script):
            fixed = script
            script = lambda n, body: fixed  # noqa: E731
        self._script: Script = script
        self._record = record_bodies
        self._stats = _Stats()
        self._lock = threading.Lock()
        self._listener = ServerThread("fake-openai-server")

    @property
    def port(self) -> int:
        return self._listener.port

    # stats, read from other threads
    @property
    def requests_received(self) -> int:
        return self._stats.requests_received

    @property
    def bodies(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._stats.bodies)

    @property
    def auth_headers(self) -> list[str | None]:
        with self._lock:
            return list(self._stats.auth_headers)

    @property
    def replied_ok(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._stats.replied_ok)

    @property
    def max_concurrent(self) -> int:
        return self._stats.max_active

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int = 0) -> FakeServer:
        """Bind 127.0.0.1:``port`` (0 = any free port) and serve from a background thread."""
        self._listener.start(self._handle, port)
        return self

    def stop(self) -> None:
        """Die abruptly: close the listener, reset every open connection, cancel pending handlers."""
        self._listener.stop()

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            if request is None:
                return
            try:
                body = json.loads(request.body) if request.body else {}
            except ValueError:
                body = {}
            headers = {name.lower(): value for name, value in request.headers}
            with self._lock:
                n = self._stats.requests_received
                self._stats.requests_received += 1
                if self._record:
                    self._stats.bodies.append(body)
                    self._stats.auth_headers.append(headers.get("authorization"))
                self._stats.active += 1
                self._stats.max_active = max(self._stats.max_active, self._stats.active)
            try:
                behaviour = self._script(n, body)
                keep_open = await self._respond(writer, behaviour, body, headers)
            finally:
                with self._lock:
                    self._stats.active -= 1
            if not keep_open or request.wants_close:
                return

    async def _respond(
        self, writer: asyncio.StreamWriter, behaviour: Behaviour, body: dict[str, Any], headers: dict[str, str]
    ) -> bool:
        """Act out one behaviour; False when the connection must end."""
        if isinstance(behaviour, Hang):
            await asyncio.sleep(behaviour.seconds)
            return False
        if getattr(behaviour, "delay_s", 0.0):
            await asyncio.sleep(behaviour.delay_s)
        if isinstance(behaviour, Reply):
            writer.write(_response(200, json.dumps(behaviour.payload()).encode()))
            await writer.drain()
            if self._record:
                with self._lock:
                    self._stats.replied_ok.append(body)
            return True
        if isinstance(behaviour, Error):
            message = behaviour.message
            if behaviour.echo_auth:
                message += f" (got Authorization: {headers.get('authorization')})"
            payload = {"object": "error", "message": message, "type": "BadRequestError", "code": behaviour.status}
            writer.write(_response(behaviour.status, json.dumps(payload).encode()))
            await writer.drain()
            return True
        if isinstance(behaviour, Raw):
            writer.write(_response(behaviour.status, behaviour.payload, behaviour.headers, behaviour.declare_length))
            await writer.drain()
            return behaviour.declare_length  # without a length the body ends with the connection
        if isinstance(behaviour, Trickle):
            payload = behaviour.payload or json.dumps(Reply().payload()).encode()
            head = _response(200, payload)[: -len(payload)]
            writer.write(head)
            for at in range(0, len(payload), behaviour.chunk_bytes):
                await writer.drain()
                await asyncio.sleep(behaviour.every_s)
                writer.write(payload[at : at + behaviour.chunk_bytes])
            await writer.drain()
            return True
        if isinstance(behaviour, Drop):
            full = json.dumps(Reply().payload()).encode()
            writer.write(_response(200, full)[: -len(full) // 2])
            await writer.drain()
            writer.transport.abort()
            return False
        raise TypeError(f"unknown behaviour {behaviour!r}")


def echo_script(n: int, body: dict[str, Any]) -> Behaviour:
    """A reply that names its prompt (the last user message): the answer ``Answer to: <prompt>``, no
    reasoning, so a test can tell from a stored row which prompt it answers."""
    from dflash_simulators.counting_proxy import last_user_message

    prompt = last_user_message(body) or ""
    return Reply(content=f"Answer to: {prompt}", reasoning=None, completion_tokens=8)


def logged(script: Script | Behaviour, path: str) -> Script:
    """``script`` that first appends the request's last user message to ``path`` (JSON line, flushed)."""
    from dflash_simulators.counting_proxy import last_user_message

    lock = threading.Lock()

    def run(n: int, body: dict[str, Any]) -> Behaviour:
        with lock, open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(last_user_message(body)) + "\n")
            f.flush()
        return script(n, body) if callable(script) else script

    return run


def main() -> None:
    """Serve until killed; prints ``PORT <n>`` once listening. ``--script instant`` (default, the bench):
    instant replies; ``hostile``: :func:`~dflash_simulators.hostile_replies.hostile_script`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--script", choices=("instant", "hostile", "echo"), default="instant")
    parser.add_argument(
        "--log",
        default=None,
        help="append each request's last user message to this file "
        "(one JSON string a line, flushed): requests counted at the server, by prompt",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # an inherited SIG_IGN must not make it unkillable by TERM
    # the package's module, not __main__: the hostile script's behaviours are its classes
    from dflash_simulators import stand_in_server as this

    script: Script | Behaviour = this.Reply()
    if args.script == "hostile":
        from dflash_simulators.hostile_replies import hostile_script

        script = hostile_script()
    elif args.script == "echo":
        script = this.echo_script
    if args.log:
        script = this.logged(script, args.log)
    server = this.FakeServer(script, record_bodies=False).start(args.port)
    print(f"PORT {server.port}", flush=True)
    threading.Event().wait()


__all__ = ["FakeServer"]


if __name__ == "__main__":
    main()
