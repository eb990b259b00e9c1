"""One HTTP exchange of the completion client, its reply body read with a bound on its decoded size (a
gzip bomb is refused, not inflated) and on its time."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable

import httpx


class ReplyTooLarge(Exception):
    """A reply body over the size limit: ``size`` bytes, ``declared`` by Content-Length or counted."""

    def __init__(self, size: int, declared: bool) -> None:
        super().__init__(size, declared)
        self.size, self.declared = size, declared


class ReplyUnreadable(Exception):
    """A body that cannot be decoded as its Content-Encoding says (the message says why)."""


def body_reader(encoding: str, max_bytes: int) -> Callable[[bytes], list[bytes]]:
    """``feed(raw chunk) -> decoded pieces`` for a Content-Encoding, never holding more than ``max_bytes + 1``
    decoded bytes at once: a gzip bomb is refused after ``max_bytes``, not inflated whole (httpx's own
    decoders inflate each raw chunk whole: ~66 MB from one 64 KB chunk of a gzip of zeros).

    Raises (from ``feed``): ReplyTooLarge past ``max_bytes`` decoded; ReplyUnreadable for an encoding the
    client did not ask for (it asks for none) or bytes that do not decode."""
    size = 0

    def count(piece: bytes) -> bytes:
        nonlocal size
        size += len(piece)
        if size > max_bytes:
            raise ReplyTooLarge(size, declared=False)
        return piece

    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return lambda chunk: [count(chunk)]
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise ReplyUnreadable(
            f"the reply's Content-Encoding is {encoding[:40]!r}; the client asks for none and "
            "decodes only gzip and deflate"
        )
    inflate = zlib.decompressobj(zlib.MAX_WBITS | 32)  # a gzip or zlib header, whichever the body has

    def feed(chunk: bytes) -> list[bytes]:
        pieces = []
        try:
            while chunk:
                pieces.append(count(inflate.decompress(chunk, max_bytes - size + 1)))
                chunk = inflate.unconsumed_tail
        except zlib.error as exc:
            raise ReplyUnreadable(f"the body does not decode as {encoding} ({exc})") from None
        return pieces

    return feed


async def bounded_exchange(
    http: httpx.AsyncHTTPTransport, request: httpx.Request, max_bytes: int, deadline_s: float | None
) -> tuple[httpx.Response, bytes]:
    """Send ``request`` and read the whole reply, at most ``max_bytes`` of it (decoded), within ``deadline_s``
    (a task of its own, so a server taken out can cancel it).

    Raises:
        ReplyTooLarge: the body (as declared by Content-Length, or as read and decoded) is over ``max_bytes``.
        ReplyUnreadable: a Content-Encoding the client cannot decode, or a body that does not decode.
        TimeoutError: ``deadline_s`` passed before the whole reply was read.
        httpx.HTTPError: as the transport raises.
    """

    async def read() -> tuple[httpx.Response, bytes]:
        response = await http.handle_async_request(request)
        try:
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise ReplyTooLarge(int(declared), declared=True)
            feed = body_reader(response.headers.get("content-encoding", ""), max_bytes)
            chunks: list[bytes] = []
            async for chunk in response.aiter_raw():
                chunks.extend(feed(chunk))
        finally:
            await response.aclose()
        return response, b"".join(chunks)

    if deadline_s is None:
        return await read()
    async with asyncio.timeout(deadline_s):
        return await read()
