"""vLLM's Prometheus counters of speculative decoding (``GET /metrics``), read and checked: the whole-run check of
:func:`~dflash_assets.stages.evaluation.vllm_engine.vllm_decode` compares their differences over a run with the
sums of the per-request figures vLLM returned.

A value that cannot be a count (NaN, +-Inf, negative), a ``position`` label outside the drafter's block (never a
list as long as the label says) and counters that went down (a restart, a reset) make the check say so; they never
cost a prompt, whose figures are its own.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dflash_assets.generation.api.replies import ReplyError, printable
from dflash_assets.generation.api.urls import origin, redact

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"
ITERATIONS = "vllm:iteration_tokens_total_count"  # the histogram's sample count: engine steps that returned tokens
MAX_METRICS_BYTES = 4 << 20
#: positions accepted when the caller names no block size (DFlash blocks are 16; no allocation per hostile label)
MAX_POSITIONS = 256


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters, summed over engines and models (counts, not rates).

    Attributes:
        drafts: verification steps that checked a draft; draft_tokens: tokens drafted; accepted: drafted tokens
        accepted; per_position: accepted count per draft position (index 0 = the first drafted token);
        generation_tokens: tokens returned to requests; iterations: engine steps that returned tokens (target
        forwards: the prefill's and every decode step's, drafted or not).
    """

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: list[float] = field(default_factory=list)
    generation_tokens: float = 0.0
    iterations: float = 0.0

    def went_down(self, before: SpecCounters) -> str | None:
        """Which counter is lower now than ``before`` (``"drafts 120 -> 80"``), None when none is: counters only
        grow, so a lower one means the server restarted or reset them and no difference is this request's."""
        pairs = [("drafts", self.drafts, before.drafts), ("draft_tokens", self.draft_tokens, before.draft_tokens)]
        pairs += [("accepted", self.accepted, before.accepted)]
        pairs += [("generation_tokens", self.generation_tokens, before.generation_tokens)]
        pairs += [("iterations", self.iterations, before.iterations)]
        pairs += [
            (f"accepted at position {k}", now, before.per_position[k] if k < len(before.per_position) else 0.0)
            for k, now in enumerate(self.per_position)
        ]
        pairs += [
            (f"accepted at position {k}", 0.0, then)
            for k, then in enumerate(before.per_position)
            if k >= len(self.per_position) and then > 0
        ]
        return next((f"{name} {then:g} -> {now:g}" for name, now, then in pairs if now < then), None)

    def minus(self, before: SpecCounters) -> SpecCounters:
        """The counts since ``before`` (positions padded to the longer list).

        Raises:
            ReplyError: a counter went down since ``before`` (see :meth:`went_down`).
        """
        if why := self.went_down(before):
            raise ReplyError(f"/metrics counters went down ({why}): the server restarted or reset them")
        n = max(len(self.per_position), len(before.per_position))
        mine = self.per_position + [0.0] * (n - len(self.per_position))
        theirs = before.per_position + [0.0] * (n - len(before.per_position))
        return SpecCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            [a - b for a, b in zip(mine, theirs)],
            self.generation_tokens - before.generation_tokens,
            self.iterations - before.iterations,
        )


def parse_spec_counters(text: str, block_size: int | None = None) -> SpecCounters:
    """The :class:`SpecCounters` in a Prometheus text exposition (``GET /metrics``). Counters vLLM has not
    registered (no speculative decoding configured) read as 0 and ``per_position`` as [].

    Args:
        block_size: the drafter's block (draft positions ``0 .. block_size - 1`` at most); None:
            :data:`MAX_POSITIONS`.

    Raises:
        ReplyError: the text is not a Prometheus exposition; a speculative-decoding counter that is not a finite,
            non-negative count (NaN, +-Inf, < 0); a ``position`` label that is not an integer in
            ``[0, block_size)``. Each names the counter and the value.
    """
    out = SpecCounters()
    positions: dict[int, float] = {}
    limit = block_size if block_size is not None else MAX_POSITIONS
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ReplyError(f"/metrics is not a Prometheus exposition ({printable(str(exc))[:200]})") from None
    for family in families:
        for sample in family.samples:
            if sample.name == ITERATIONS:
                name = ITERATIONS
            elif sample.name.endswith("_total"):  # not the _created gauges beside each counter
                name = sample.name[: -len("_total")]
            else:
                continue
            if name not in (DRAFTS, DRAFT_TOKENS, ACCEPTED, ACCEPTED_PER_POSITION, GENERATION_TOKENS, ITERATIONS):
                continue
            if not math.isfinite(sample.value) or sample.value < 0:
                raise ReplyError(f"/metrics: {sample.name} is {sample.value!r}, not a count")
            if name == ITERATIONS:
                out.iterations += sample.value
            elif name == GENERATION_TOKENS:
                out.generation_tokens += sample.value
            elif name == DRAFTS:
                out.drafts += sample.value
            elif name == DRAFT_TOKENS:
                out.draft_tokens += sample.value
            elif name == ACCEPTED:
                out.accepted += sample.value
            else:
                label = sample.labels.get("position", "")
                if not (label.isdecimal() and len(label) <= 6 and int(label) < limit):
                    raise ReplyError(
                        f"/metrics: {sample.name} has position={printable(label)[:40]!r}, not a draft position of "
                        f"a block of {limit} (0 .. {limit - 1})"
                    )
                positions[int(label)] = positions.get(int(label), 0.0) + sample.value
    out.per_position = [positions.get(k, 0.0) for k in range(max(positions) + 1)] if positions else []
    return out


def bounded_request(client: httpx.Client, method: str, url: str, max_bytes: int, **kw) -> tuple[int, bytes]:
    with client.stream(method, url, **kw) as response:
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise ReplyError(f"{method} {url}: the reply declares {int(declared):,} bytes, over {max_bytes:,}")
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise ReplyError(f"{method} {url}: the reply is over {max_bytes:,} bytes")
        return response.status_code, bytes(body)


def read_counters(client: httpx.Client, base_url: str, block_size: int | None = None) -> SpecCounters:
    """The server's :class:`SpecCounters` now (``GET <origin>/metrics``, at most 4 MiB read).

    Raises:
        ReplyError: not 200, too large, or what :func:`parse_spec_counters` refuses.
        httpx.HTTPError: the server did not answer.
    """
    status, body = bounded_request(client, "GET", origin(base_url) + "/metrics", MAX_METRICS_BYTES)
    if status != 200:
        raise ReplyError(f"/metrics answered HTTP {status}")
    return parse_spec_counters(body.decode("utf-8", errors="replace"), block_size)


def try_counters(client: httpx.Client, base_url: str, block: int | None, api_key: str | None):
    try:
        return read_counters(client, base_url, None if block is None else block + 1)
    except (httpx.HTTPError, ReplyError) as exc:
        return redact(f"{type(exc).__name__}: {exc}", api_key)[:300]


def counter_check(client, base_url, width, before, records, api_key) -> dict[str, Any]:
    """The run's counter differences against the per-request sums (see the module docstring)."""
    if not width:
        return {"compared": False, "why": "no speculation"}
    ok = [r for r in records if "error" not in r]
    tokens = sum(r["completion_tokens"] for r in ok)
    sums = {"drafts": sum(r["drafts"] for r in ok), "accepted": sum(r["accepted"] for r in ok)}
    if isinstance(before, str):
        return {"compared": False, "why": f"no /metrics before the run ({before})", "per_request": sums}
    deadline = time.monotonic() + 5.0
    while True:  # vLLM records a step's counters just after it sends the step's tokens
        after = try_counters(client, base_url, width, api_key)
        if isinstance(after, str):
            return {"compared": False, "why": f"no /metrics after the run ({after})", "per_request": sums}
        if after.went_down(before):
            return {"compared": False, "why": f"counters went down ({after.went_down(before)})", "per_request": sums}
        delta = after.minus(before)
        settled = delta.generation_tokens >= tokens if after.generation_tokens > 0 else True
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    counted = {"drafts": int(delta.drafts), "accepted": int(delta.accepted)}
    # lost prompts may have run on the server: the counters then exceed the sums of the measured ones
    agrees = counted == sums if len(ok) == len(records) else all(counted[k] >= sums[k] for k in sums)
    return {"compared": True, "agrees": agrees, "per_request": sums, "counters": counted}


__all__ = ["SpecCounters", "counter_check", "parse_spec_counters", "read_counters", "try_counters"]
