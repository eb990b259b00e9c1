"""Acceptance length as vLLM counts it: prompts decoded one at a time on a vLLM server running the export as a
DFlash drafter, tau read from the server's own Prometheus counters.

vLLM 0.32 counts, per verification step of a request, one draft (``vllm:spec_decode_num_drafts``), its
``num_speculative_tokens`` drafted tokens (``..._num_draft_tokens``), the drafted tokens the target accepted
(``..._num_accepted_tokens``) and, per draft position, whether it was accepted
(``..._num_accepted_tokens_per_pos{position="k"}``). A step yields its accepted tokens plus the target's own
next token, so a prompt's tau is ``(accepted + drafts) / drafts = 1 + accepted / drafts``: tokens per target
verification step with the bonus token counted and the prefill's token left out, as the in-process evaluation
counts it. Prompts are sent one at a time so the difference of the counters around a request is that request's.

Target forwards, the unit that compares methods (:mod:`~dflash_assets.stages.evaluation.baseline`): vLLM counts a
draft only for a step that had one, so a method that sometimes proposes nothing (n-gram lookup) has decode steps
the spec counters never see. The forwards are read from the count of ``vllm:iteration_tokens_total`` (a histogram
vLLM observes once per engine step that returned tokens: the prefill step and every decode step, one request at a
time here); ``generated - accepted`` is not exact, as vLLM counts a final step's accepted drafts before it trims
the tokens past the stop (read in vLLM 0.32's ``Scheduler.update_from_output``; seen: 33 forwards where
``generated - accepted`` said 30).

A reply is checked before it counts (size cap, JSON, field types); a bad reply costs its prompt, never the run.
So do counters that cannot be counts (NaN, +-Inf, negative), a ``position`` label outside the drafter's block
(never a list as long as the label says), and counters that went down around a request (a restart, a reset): that
prompt is not measured, its record says why, and the dataset's figures count only measured prompts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dflash_assets.dflash.decoding.tau import tau_from_sums
from dflash_assets.generation.api.replies import MAX_TOKEN_VALUE, ReplyError, decode_reply, printable
from dflash_assets.generation.api.urls import origin, redact
from dflash_assets.generation.servers.sglang_dflash import GREEDY_SAMPLING, EngineError, EnginePrompt, input_sha
from dflash_assets.stages.evaluation.baseline import engine_forward_figures

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"
ITERATIONS = "vllm:iteration_tokens_total_count"  # the histogram's sample count: engine steps that returned tokens
MAX_METRICS_BYTES = 4 << 20
MAX_REPLY_BYTES = 8 << 20
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


def _bounded_get_or_post(client: httpx.Client, method: str, url: str, max_bytes: int, **kw) -> tuple[int, bytes]:
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
    status, body = _bounded_get_or_post(client, "GET", origin(base_url) + "/metrics", MAX_METRICS_BYTES)
    if status != 200:
        raise ReplyError(f"/metrics answered HTTP {status}")
    return parse_spec_counters(body.decode("utf-8", errors="replace"), block_size)


def parse_completion(payload: Any, vocab_size: int | None = None) -> dict[str, Any]:
    """``output_ids``, ``finish_reason`` and ``completion_tokens`` of a ``/v1/completions`` reply asked with
    ``return_token_ids``.

    Raises:
        ReplyError: a field missing or of the wrong type, an id outside ``[0, vocab_size)``, or a token count
            that disagrees with the ids.
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list) or not payload["choices"]:
        raise ReplyError("the reply has no choices[0]")
    choice = payload["choices"][0]
    if not isinstance(choice, dict):
        raise ReplyError("choices[0] is not an object")
    ids = choice.get("token_ids")
    limit = vocab_size or MAX_TOKEN_VALUE
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ReplyError("choices[0].token_ids is not a list of integers (is return_token_ids supported?)")
    bad = [t for t in ids if not 0 <= t < limit]
    if bad:
        raise ReplyError(f"choices[0].token_ids holds {bad[0]}, outside [0, {limit})")
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise ReplyError("choices[0].finish_reason is not a string")
    usage = payload.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens != len(ids):
        raise ReplyError(f"usage.completion_tokens {printable(repr(tokens))[:40]} is not the {len(ids)} ids returned")
    return {"output_ids": ids, "finish_reason": finish, "completion_tokens": tokens}


def _settled(
    before: SpecCounters, read: Callable[[], SpecCounters], completion_tokens: int, wait_s: float
) -> SpecCounters:
    """The counters once they account for the request's tokens, or as they are after ``wait_s``: vLLM records a
    step's stats just after it sends the step's tokens, the spec counters first, then the generated tokens and the
    step count in one call, so ``generation_tokens`` reaching the reply's count means all of them are in. Without
    that counter (an older vLLM): drafts + accepted >= tokens - 1, true when every decode step drafted."""
    deadline = time.monotonic() + wait_s
    while True:
        now = read()
        if now.went_down(before):
            return now  # no wait will make this difference the request's: the caller refuses it
        delta = now.minus(before)
        done = (
            delta.generation_tokens >= completion_tokens
            if now.generation_tokens > 0
            else delta.drafts + delta.accepted >= completion_tokens - 1
        )
        if done or time.monotonic() > deadline:
            return now
        time.sleep(0.02)


def vllm_decode(
    base_url: str,
    model_name: str,
    prompts: Sequence[EnginePrompt],
    max_new_tokens: int,
    *,
    stop_token_ids: Sequence[int] = (),
    api_key: str | None = None,
    timeout_s: float = 3600.0,
    vocab_size: int | None = None,
    block_size: int | None = None,
    progress: Callable[[int, int, dict], None] | None = None,
) -> list[dict[str, Any]]:
    """Decode each prompt greedily, one at a time, on the vLLM server at ``base_url`` and return one record per
    prompt, in order: ``dataset``, ``position``, ``input_sha``, ``output_ids``, ``completion_tokens``,
    ``finish_reason``, ``drafts``, ``draft_tokens``, ``accepted``, ``accepted_per_position``, ``forwards`` (target
    forwards, prefill included: the engine steps that returned tokens; None when vLLM exposes no step count)
    (this request's counter differences) and ``tau`` (``1 + accepted / drafts``; None without a verification
    step), or ``error`` (a reply that was not a valid completion, an HTTP error, ``/metrics`` values
    :func:`parse_spec_counters` refuses or counters that went down: that prompt alone is lost, the reason in
    ``error``). ``block_size``: the drafter's block, bounding the draft positions ``/metrics`` may name.

    Every sampling field that could differ from greedy is sent (vLLM fills an omitted one from the model's
    ``generation_config.json``).

    Raises:
        EngineError: every prompt failed (the first error quoted); the key redacted.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(connect=30.0, read=timeout_s, write=60.0, pool=None)
    url = origin(base_url) + "/v1/completions"
    records: list[dict[str, Any]] = []
    with httpx.Client(headers=headers, timeout=timeout) as client:

        def read() -> SpecCounters:
            return read_counters(client, base_url, block_size)

        def baseline() -> tuple[SpecCounters | None, str | None]:
            try:
                return read(), None
            except (httpx.HTTPError, ReplyError) as exc:
                return None, redact(f"{type(exc).__name__}: {exc}", api_key)[:500]

        before, unread = baseline()
        for i, prompt in enumerate(prompts):
            record: dict[str, Any] = {
                "dataset": prompt.dataset,
                "position": prompt.position,
                "input_sha": input_sha(prompt.input_ids),
            }
            body = {
                "model": model_name,
                "prompt": list(prompt.input_ids),
                "max_tokens": int(max_new_tokens),
                **GREEDY_SAMPLING,
                "stop_token_ids": [int(t) for t in stop_token_ids],
                "skip_special_tokens": False,
                "return_token_ids": True,
            }
            if before is None:
                before, unread = baseline()  # the last read failed: this prompt needs a baseline of its own
            try:
                if before is None:
                    raise ReplyError(f"no /metrics baseline before the request ({unread})")
                status, raw = _bounded_get_or_post(client, "POST", url, MAX_REPLY_BYTES, json=body)
                if status != 200:
                    raise ReplyError(f"HTTP {status}: {printable(raw[:300].decode('utf-8', errors='replace'))}")
                record.update(parse_completion(decode_reply(raw), vocab_size))
                after = _settled(before, read, record["completion_tokens"], wait_s=5.0)
                delta, before = after.minus(before), after
                record.update(
                    drafts=int(delta.drafts),
                    draft_tokens=int(delta.draft_tokens),
                    accepted=int(delta.accepted),
                    forwards=int(delta.iterations) if after.iterations > 0 else None,
                    accepted_per_position=[int(x) for x in delta.per_position],
                    tau=(1.0 + delta.accepted / delta.drafts) if delta.drafts > 0 else None,
                )
            except (httpx.HTTPError, ReplyError) as exc:
                record["error"] = redact(f"{type(exc).__name__}: {exc}", api_key)[:500]
                before, unread = baseline()  # the next request's: whatever this one left counted
            records.append(record)
            if progress is not None:
                progress(i + 1, len(prompts), record)
    if records and all("error" in r for r in records):
        raise EngineError(f"vLLM {origin(base_url)}: every request failed; the first: {records[0]['error']}")
    return records


def vllm_tau_by_dataset(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per dataset: :func:`~dflash_assets.dflash.decoding.tau.tau_from_sums` over ``(accepted + drafts, drafts)`` per
    prompt (``tau``: the mean of per-prompt means, z-lab's figure; ``tau_pooled``: all tokens over all steps),
    ``acceptance_per_position`` (accepted / drafts at each draft position, pooled), ``requests``,
    ``requests_measured`` (no error and at least one verification step: only these count in any figure),
    ``errors``, ``first_error`` and ``forwards`` (tokens per target forward and acceptance per decode step:
    :func:`~dflash_assets.stages.evaluation.baseline.engine_forward_figures`)."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["dataset"] for r in records):
        rows = [r for r in records if r["dataset"] == name]
        measured = [r for r in rows if "error" not in r and (r.get("drafts") or 0) > 0]
        sums = tau_from_sums([(r["accepted"] + r["drafts"], r["drafts"]) for r in measured])
        drafts = sum(r["drafts"] for r in measured)
        width = max((len(r["accepted_per_position"]) for r in measured), default=0)
        per_pos = [
            sum(r["accepted_per_position"][k] for r in measured if k < len(r["accepted_per_position"])) / drafts
            for k in range(width)
        ]
        out[name] = {
            **{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in sums.items()},
            "acceptance_per_position": per_pos,
            "num_speculative_tokens": width,
            "requests": len(rows),
            "requests_measured": len(measured),
            "errors": sum("error" in r for r in rows),
            "forwards": engine_forward_figures(rows),
            "first_error": next((r["error"] for r in rows if "error" in r), None),
        }
    return out


__all__ = [
    "SpecCounters",
    "parse_completion",
    "parse_spec_counters",
    "read_counters",
    "vllm_decode",
    "vllm_tau_by_dataset",
]
