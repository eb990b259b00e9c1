"""The stand-in servers' shared HTTP/1.1 layer (``dflash_simulators.http11``) and their process
behaviour: requests parsed as sent over a real socket, keep-alive, and a stand-in that dies on SIGTERM
even when its parent left SIGTERM ignored (a bench's cleanup waited on one that did not)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx

from dflash_simulators.http11 import ServerThread, read_request


def test_read_request_over_a_socket_keep_alive_then_close():
    seen = []

    async def handler(reader, writer):
        while (request := await read_request(reader)) is not None:
            seen.append(request)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            if request.wants_close:
                return

    listener = ServerThread("test-http11")
    port = listener.start(handler)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
            assert http.post("/v1/chat/completions?x=1", content=b'{"a": 1}', headers={"X-Key": "v"}).text == "ok"
            assert http.get("/health", headers={"Connection": "close"}).text == "ok"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:  # two requests, one connection
            raw.sendall(b"POST /a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcGET /b HTTP/1.1\r\nconnection: close\r\n\r\n")
            replies = b""
            while chunk := raw.recv(4096):
                replies += chunk
            assert replies.count(b"HTTP/1.1 200 OK") == 2
    finally:
        listener.stop()
    first = seen[0]
    assert (first.method, first.target, first.body) == ("POST", "/v1/chat/completions?x=1", b'{"a": 1}')
    assert first.header("x-key") == "v" and first.header("CONTENT-LENGTH") == "8" and not first.wants_close
    assert seen[1].wants_close and seen[1].body == b""
    assert [(r.method, r.target, r.body) for r in seen[2:]] == [("POST", "/a", b"abc"), ("GET", "/b", b"")]
    assert listener.loop is None  # stopped, thread joined


def test_stand_in_server_dies_on_sigterm_even_when_inherited_ignored():
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_simulators.stand_in_server"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("PORT ")
        proc.terminate()
        assert proc.wait(10) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
