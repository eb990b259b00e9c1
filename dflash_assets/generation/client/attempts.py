"""The completion client's requests: one HTTP attempt with every failure classified (retried or not, the
server's fault or not), and all the attempts of one row with backoff (tenacity)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from dflash_assets.generation.api.replies import (
    ReplyError,
    decode_reply,
    parse_chat_completion,
    printable,
    server_error_message,
)
from dflash_assets.generation.client.http_exchange import ReplyTooLarge, ReplyUnreadable, bounded_exchange
from dflash_assets.generation.client.results import CompletionResult
from dflash_assets.generation.client.routing import ServerState

# HTTP statuses worth another attempt: request timeout, rate limit, and server-side errors.
_TRANSIENT_STATUSES = frozenset({408, 429})

# A 400 that says the prompt (with max_tokens) does not fit the server's context: SGLang "The input (N tokens)
# is longer than the model's context length (C tokens)." / "Requested token count exceeds the model's maximum
# context length of C tokens..."; vLLM "This model's maximum context length is C tokens..." / "Input length (N)
# exceeds model's maximum context length (C)."
_CONTEXT_REFUSAL = re.compile(r"context[ _]length|max_model_len", re.IGNORECASE)

#: How the error of a row the server refused as too long for its context begins.
CONTEXT_REFUSED = "prompt_too_long (refused by the server)"


class AttemptError(Exception):
    """One failed HTTP attempt; ``transient`` decides whether another attempt may be made."""

    def __init__(
        self,
        message: str,
        transient: bool,
        server: str,
        *,
        server_fault: bool = False,
        rerouted: bool = False,
        context_refused: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.transient = transient
        self.server = server
        self.rerouted = rerouted  # cancelled because its server was taken out: re-send at once
        # the prompt does not fit the server's context: that row's fault, not the server's nor the run's
        self.context_refused = context_refused
        # Connection failures and 5xx say the server itself is unwell: route around it for a while.
        self.server_fault = server_fault


class RequestAttempts:
    """Part of :class:`~dflash_assets.generation.client.completion_client.CompletionClient` (split out by concern):
    sending a row's request with retries. Uses the client's settings and state (``_headers``, ``_timeouts``,
    ``max_attempts``, ``backoff_*``, ``_stopping``, ``_pick_server``, ``_note_fault``, ``_log``...)."""

    async def _attempt(
        self, http: httpx.AsyncHTTPTransport, payload: bytes, prefer: str | None = None
    ) -> tuple[dict[str, Any], ServerState]:
        """One HTTP attempt on the least-loaded server (or ``prefer``, see :meth:`_pick_server`); raises
        :class:`AttemptError` on any failure."""
        await self._wait_while_every_server_restarts()
        server = self._pick_server(prefer)
        if server.in_flight == 0:
            server.last_progress = time.monotonic()  # busy from now: the stall clock starts
        server.in_flight += 1
        self._requests_sent += 1
        self._sent_per_server[server.label] += 1
        try:
            response, reply = await self._post(http, server, payload)
            fields = self._reply_fields(server, response, reply)
            server.recent_faults = 0
            server.avoid_until = 0.0
            server.last_progress = time.monotonic()
            return fields, server
        except AttemptError as exc:
            if exc.server_fault:
                self._note_fault(server)
            raise
        finally:
            server.in_flight -= 1

    async def _wait_while_every_server_restarts(self) -> None:
        """Every server is down and being restarted: wait for one rather than fail rows."""
        while (
            self.supervisor is not None
            and getattr(self.supervisor, "can_restart", False)
            and not self._stopping
            and all(s.down_reason is not None for s in self._servers)
            and any(s.recovering for s in self._servers)
        ):
            await asyncio.sleep(0.1)

    async def _post(self, http: httpx.AsyncHTTPTransport, server: ServerState, payload: bytes) -> tuple[Any, bytes]:
        """``(response, reply body)`` of one POST of ``payload`` to ``server``, its reply read with a bound on its
        size and time; every failure raised as an :class:`AttemptError` saying whether a retry can help and
        whether it is the server's fault (a request in flight on a server taken out is re-sent elsewhere)."""
        try:
            request = httpx.Request(
                "POST",
                server.url,
                headers=self._headers,
                content=payload,
                extensions={"timeout": self._timeouts},
            )
            exchange = asyncio.ensure_future(
                bounded_exchange(http, request, self.max_reply_bytes, self.request_timeout_s)
            )
            server.tasks.add(exchange)
            try:
                return await exchange
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if exchange.cancelled() and server.down_reason is not None and not (current and current.cancelling()):
                    self._rerouted += 1
                    raise AttemptError(
                        f"{server.label} was taken out ({server.down_reason}) with this request in flight; "
                        "re-sent to another server",
                        transient=True,
                        server=server.label,
                        rerouted=True,
                    ) from None
                raise
            finally:
                server.tasks.discard(exchange)
        except httpx.ReadTimeout as exc:
            raise AttemptError(
                f"read timeout after {self.read_timeout_s:g} s from {server.label} (the server may "
                f"still be generating): {type(exc).__name__}",
                transient=self.retry_read_timeouts,
                server=server.label,
            ) from None
        except TimeoutError:  # the whole-request deadline (asyncio.timeout in _exchange)
            raise AttemptError(
                f"request timeout after {self.request_timeout_s:g} s from {server.label}: no whole reply in "
                "that time (the server may still be generating, or sends its reply too slowly)",
                transient=self.retry_read_timeouts,
                server=server.label,
            ) from None
        except ReplyTooLarge as exc:
            said = "its Content-Length says" if exc.declared else "read so far:"
            raise AttemptError(
                f"reply from {server.label} is over the {self.max_reply_bytes:,}-byte cap ({said} "
                f"{exc.size:,} bytes); no chat completion of this run is that large",
                transient=False,
                server=server.label,
            ) from None
        except ReplyUnreadable as exc:
            raise AttemptError(
                f"malformed reply from {server.label}: {exc}", transient=False, server=server.label
            ) from None
        except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            detail = str(exc) or "no detail"
            raise AttemptError(
                f"{type(exc).__name__} talking to {server.label}: {detail}",
                transient=True,
                server=server.label,
                server_fault=True,
            ) from None
        except httpx.HTTPError as exc:  # unsupported protocol, bad URL, ...: retrying cannot help
            raise AttemptError(
                f"{type(exc).__name__} talking to {server.label}: {exc}", transient=False, server=server.label
            ) from None
        except AttemptError:
            raise
        except Exception as exc:
            raise AttemptError(
                f"{type(exc).__name__} talking to {server.label}: {exc}", transient=False, server=server.label
            ) from None

    def _reply_fields(self, server: ServerState, response: Any, reply: bytes) -> dict[str, Any]:
        """The chat completion's fields of a reply; an HTTP error status or a malformed reply raised as an
        :class:`AttemptError` (a context refusal named as one)."""
        status = response.status_code
        if status != 200:
            transient = status in _TRANSIENT_STATUSES or status >= 500
            said = server_error_message(reply)
            refused = status == 400 and bool(_CONTEXT_REFUSAL.search(said))
            raise AttemptError(
                f"{CONTEXT_REFUSED + ': ' if refused else ''}HTTP {status} from {server.label}: {said}",
                transient=transient,
                server=server.label,
                server_fault=status >= 500,
                context_refused=refused,
            )
        try:
            return parse_chat_completion(decode_reply(reply), self.vocab_size)
        except Exception as exc:
            # The server finished (and paid for) the generation: re-sending would redo it.
            detail = str(exc) if isinstance(exc, ReplyError) else f"{type(exc).__name__}: {exc}"
            raise AttemptError(
                f"malformed reply from {server.label}: {detail}", transient=False, server=server.label
            ) from None

    async def _request(
        self, http: httpx.AsyncHTTPTransport, index: int, body: dict[str, Any], prefer: str | None = None
    ) -> CompletionResult:
        """All attempts for one row; never raises for request failures (they become ``error``). The first
        attempt goes to ``prefer`` when it can take it (:meth:`_pick_server`), retries to any server."""
        start = time.monotonic()
        payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        attempts = 0
        last_error: AttemptError | None = None

        def should_retry(exc: BaseException) -> bool:
            return isinstance(exc, AttemptError) and exc.transient and not self._stopping

        def log_retry(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            wait = state.next_action.sleep if state.next_action else 0.0
            self._log.warning(
                "row %d: attempt %d/%d failed (%s); retrying in %.1f s",
                index,
                state.attempt_number,
                self.max_attempts,
                self._redact(str(exc)),
                wait,
            )

        backoff = wait_exponential_jitter(
            multiplier=self.backoff_base_s, max=self.backoff_max_s, exp_base=2, jitter=self.backoff_base_s
        )

        def wait(state: RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            return 0.0 if getattr(exc, "rerouted", False) else backoff(state)

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_attempts),
            wait=wait,
            retry=retry_if_exception(should_retry),
            before_sleep=log_retry,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    if attempts and self._stopping and last_error is not None:
                        # Stop was decided during our backoff: do not send again.
                        raise AttemptError(
                            last_error.message + " (not retried: generation is stopping)",
                            transient=False,
                            server=last_error.server,
                        )
                    attempts += 1
                    try:
                        fields, server = await self._attempt(http, payload, prefer if attempts == 1 else None)
                    except AttemptError as exc:
                        last_error = exc
                        raise
        except AttemptError as exc:
            message = printable(self._redact(exc.message))  # stored in the journal: valid UTF-8 only
            if exc.transient and attempts >= self.max_attempts:
                message += f" (gave up after {attempts} attempts)"
            self._log.error("row %d failed: %s", index, message)
            return CompletionResult(
                index=index,
                reasoning_content=None,
                content=None,
                finish_reason=None,
                prompt_tokens=None,
                completion_tokens=None,
                output_token_ids=None,
                latency_s=time.monotonic() - start,
                server=exc.server,
                attempts=attempts,
                error=message,
                context_refused=exc.context_refused,
            )
        return CompletionResult(
            index=index,
            latency_s=time.monotonic() - start,
            server=server.label,
            attempts=attempts,
            error=None,
            **self._redact_fields(fields),
        )
