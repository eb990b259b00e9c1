"""What the completion client delivers: one result per prompt, the run's progress, and the error that stops
a run after too many failures in a row."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class TooManyFailuresError(RuntimeError):
    """Raised by :meth:`~dflash_assets.generation.client.completion_client.CompletionClient.generate` after
    ``max_consecutive_failures`` rows failed in a row.

    Attributes:
        consecutive_failures: the number of final failures in a row that triggered the stop.
        servers: labels (URLs without credentials) of the servers those failures came from.
        last_error: the last failure's message (API key scrubbed).
    """

    def __init__(self, consecutive_failures: int, servers: list[str], last_error: str) -> None:
        self.consecutive_failures = consecutive_failures
        self.servers = servers
        self.last_error = last_error
        super().__init__(
            f"stopped after {consecutive_failures} requests failed in a row (after retries) on "
            f"server(s) {', '.join(servers) or '?'}; last error: {last_error}. Requests already in "
            f"flight were finished and delivered; no new requests were sent."
        )


@dataclass(frozen=True)
class CompletionResult:
    """One prompt's outcome, delivered to ``on_result`` exactly once per ``(index, body)`` item.

    Attributes:
        index: the prompt index given with the request body.
        reasoning_content: ``choices[0].message.reasoning_content`` (SGLang/vLLM with a reasoning parser;
            ``message.reasoning`` is accepted too), None when absent.
        content: ``choices[0].message.content`` (the answer text), None when absent.
        finish_reason: ``choices[0].finish_reason`` as the server said it ("stop", "length", "abort", ...).
        prompt_tokens: ``usage.prompt_tokens`` (tokens), None when absent.
        completion_tokens: ``usage.completion_tokens`` (tokens, reasoning + answer), None when absent.
        output_token_ids: generated token ids when the server returns them (with ``return_token_ids: true``:
            SGLang's chat ``choices[0].response_token_ids``, vLLM's ``choices[0].token_ids``; also
            ``choices[0].output_ids`` or integer ``token_id`` entries in ``choices[0].logprobs.content``),
            else None.
        latency_s: wall seconds from the first attempt's start to this result, retries and backoff included.
        server: label (URL without credentials) of the server that answered the last attempt.
        attempts: HTTP attempts made (1 = no retry).
        error: None on success; otherwise why the row failed finally (API key scrubbed). When set, the
            text fields are None.
        prompt_token_ids: prompt token ids when the server returns them (``choices[0].prompt_token_ids``
            or top-level ``prompt_token_ids``; SGLang ``return_prompt_token_ids``), else None.
        output_token_ids_source: the reply field ``output_token_ids`` came from (``response_token_ids``,
            ``token_ids``, ``output_ids``, ``logprobs``), ``none`` when it is None.
        context_refused: the server refused the prompt as too long for its context (HTTP 400): the row fails,
            but it never counts toward ``max_consecutive_failures`` (it says nothing of the server's health).
        origin: what the servers said of themselves (:func:`~dflash_assets.generation.servers.origin.
            server_origin`: ``engine``, ``engine_version``, ``template_sha256``), which the row records; empty when
            the client was given none.
    """

    index: int
    reasoning_content: str | None
    content: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    output_token_ids: list[int] | None
    latency_s: float
    server: str
    attempts: int
    error: str | None
    prompt_token_ids: list[int] | None = None
    output_token_ids_source: str = "none"
    context_refused: bool = False
    origin: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def ok(self) -> bool:
        """True when the request succeeded (``error`` is None)."""
        return self.error is None


@dataclass(frozen=True)
class GenerationProgress:
    """A snapshot of a running (or finished)
    :meth:`~dflash_assets.generation.client.completion_client.CompletionClient.generate` call.

    Attributes:
        rows_done: results delivered so far (successes + final failures).
        rows_failed: of those, final failures.
        requests_sent: HTTP attempts started (>= rows_done when retries happened).
        in_flight: requests currently being processed (attempts on the wire or waiting to retry).
        output_tokens: sum of ``completion_tokens`` of the successful rows, and of every part of a row
            made in parts (``generate``'s ``follow_up``) (tokens).
        elapsed_s: seconds since the ``generate`` call started.
        requests_per_s: rows_done / elapsed_s.
        output_tokens_per_s: output_tokens / elapsed_s.
    """

    rows_done: int
    rows_failed: int
    requests_sent: int
    in_flight: int
    output_tokens: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float

    def eta_s(self, rows_total: int) -> float | None:
        """Seconds left to finish ``rows_total`` rows at the current rate; None before any row is done."""
        if self.requests_per_s <= 0:
            return None
        return max(rows_total - self.rows_done, 0) / self.requests_per_s

    def format(self, rows_total: int | None = None) -> str:
        """One log line, e.g. ``"120/1000 rows (2 failed), 3.1 req/s, 7450 output tok/s, 64 in flight, ETA 283 s"``."""
        total = f"/{rows_total}" if rows_total is not None else ""
        line = (
            f"{self.rows_done}{total} rows ({self.rows_failed} failed), {self.requests_per_s:.1f} req/s, "
            f"{self.output_tokens_per_s:.0f} output tok/s, {self.in_flight} in flight"
        )
        if rows_total is not None:
            eta = self.eta_s(rows_total)
            line += f", ETA {eta:.0f} s" if eta is not None else ", ETA ?"
        return line
