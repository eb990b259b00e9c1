"""Acceptance as vLLM counts it: the evaluation prompts decoded concurrently on a vLLM server, each request's
verification steps read from vLLM's own per-request figures.

vLLM 0.32 started with ``--per-request-spec-decode-metrics detailed`` returns, in every ``/v1/completions``
reply, ``metrics.speculative_decoding`` with ``per_step_accepted`` and ``per_step_drafted``: for each
verification step of that request, in order, the drafted tokens the target accepted and the tokens drafted
(``vllm/v1/metrics/stats.py`` ``RequestSpecDecodeMetrics``, observed by the scheduler at every step that
verified a draft: ``vllm/v1/core/sched/scheduler.py`` ``update_from_output``). So the prompts go to the server
together (it batches them) and each prompt's figures are its own, not counter differences around it.

Units. A step yields its accepted drafts plus the target's own next token; tau (``1 + accepted / drafts``)
counts verification steps only. *Target forwards* count every engine step of the request, the prefill's
included (:mod:`~dflash_assets.stages.evaluation.baseline`): for a drafter that drafts at every decode step
(DFlash) that is ``1 + steps``; n-gram lookup drafts nothing where no suffix recurs, and vLLM observes no
figure for such a step, so its forwards come from replaying the lookup rule on the output
(:func:`~dflash_assets.dflash.decoding.ngram.ngram_steps`), which must reproduce vLLM's drafted steps in order;
plain decoding makes one token per forward. vLLM observes a final step's accepted drafts before it trims the
tokens past the stop, so the last step may count drafts the reply does not carry (seen: 2 accepted past a
48-token stop); forwards are unaffected.

Whole-run check. The server's Prometheus counters (``vllm:spec_decode_num_drafts``,
``..._num_accepted_tokens``) are read before and after the run; their differences must equal the sums of the
per-request figures (the same scheduler figures, summed by vLLM itself). The outcome is recorded, never a
reason to drop a prompt.

A reply is checked before it counts (size cap, JSON, field types, ids inside the vocabulary, the prompt ids
vLLM read equal to those sent, step figures that are counts a block allows): a bad reply costs its prompt,
never the run; the record's ``error`` says why.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import httpx

from dflash_assets.dflash.decoding.ngram import ngram_steps
from dflash_assets.dflash.decoding.tau import tau_from_sums
from dflash_assets.generation.api.replies import MAX_TOKEN_VALUE, ReplyError, decode_reply, printable
from dflash_assets.generation.api.urls import origin, redact
from dflash_assets.generation.servers.sglang_dflash import GREEDY_SAMPLING, EngineError, EnginePrompt, input_sha
from dflash_assets.stages.evaluation.baseline import engine_forward_figures
from dflash_assets.stages.evaluation.vllm_counters import bounded_request, counter_check, try_counters

MAX_REPLY_BYTES = 8 << 20


def parse_completion(payload: Any, vocab_size: int | None = None) -> dict[str, Any]:
    """``output_ids``, ``finish_reason``, ``completion_tokens`` and ``prompt_ids`` (``choices[0].prompt_token_ids``,
    the ids vLLM read; None when the reply has none) of a ``/v1/completions`` reply asked with ``return_token_ids``.

    Raises:
        ReplyError: a field missing or of the wrong type, an id outside ``[0, vocab_size)``, or a token count
            that disagrees with the ids.
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list) or not payload["choices"]:
        raise ReplyError("the reply has no choices[0]")
    choice = payload["choices"][0]
    if not isinstance(choice, dict):
        raise ReplyError("choices[0] is not an object")
    limit = vocab_size or MAX_TOKEN_VALUE
    ids = _id_list(choice.get("token_ids"), "choices[0].token_ids", limit)
    if ids is None:
        raise ReplyError("choices[0].token_ids is not a list of integers (is return_token_ids supported?)")
    prompt_ids = _id_list(choice.get("prompt_token_ids"), "choices[0].prompt_token_ids", limit)
    if prompt_ids is None and choice.get("prompt_token_ids") is not None:
        raise ReplyError("choices[0].prompt_token_ids is not a list of integers")
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise ReplyError("choices[0].finish_reason is not a string")
    usage = payload.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not _count(tokens) or tokens != len(ids):
        raise ReplyError(f"usage.completion_tokens {printable(repr(tokens))[:40]} is not the {len(ids)} ids returned")
    return {"output_ids": ids, "finish_reason": finish, "completion_tokens": tokens, "prompt_ids": prompt_ids}


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _id_list(value: Any, field_name: str, limit: int) -> list[int] | None:
    """``value`` as token ids (None when it is not a list of integers).

    Raises:
        ReplyError: an id outside ``[0, limit)``."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None
    bad = next((t for t in value if not 0 <= t < limit), None)
    if bad is not None:
        raise ReplyError(f"{field_name} holds {bad}, outside [0, {limit})")
    return value


def parse_step_metrics(payload: Any, num_speculative_tokens: int, completion_tokens: int) -> list[tuple[int, int]]:
    """The request's verification steps, ``(drafted, accepted)`` each, in order, from the reply's
    ``metrics.speculative_decoding`` (``per_step_drafted``, ``per_step_accepted``; vLLM 0.32 with
    ``--per-request-spec-decode-metrics detailed``). A request whose decoding never verified a draft has none.

    Raises:
        ReplyError: no such figures (the flag is missing or the server is no vLLM 0.32), lists of other lengths or
            of values that are not counts, a step drafting more than ``num_speculative_tokens`` or accepting more
            than it drafted, more steps than ``completion_tokens`` allows (each step returns at least one token,
            the prefill one more), or summary fields that disagree with the lists.
    """
    metrics = payload.get("metrics") if isinstance(payload, dict) else None
    spec = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if not isinstance(spec, dict):
        raise ReplyError(
            "the reply has no metrics.speculative_decoding (is the server vLLM 0.32 started with "
            "--per-request-spec-decode-metrics detailed?)"
        )
    accepted, drafted = spec.get("per_step_accepted", []), spec.get("per_step_drafted", [])
    steps = spec.get("num_spec_steps")
    if not _count(steps) or not isinstance(accepted, list) or not isinstance(drafted, list):
        raise ReplyError("metrics.speculative_decoding: num_spec_steps or the per-step lists are not counts")
    if steps > max(completion_tokens - 1, 0) and steps > 0:
        raise ReplyError(f"metrics.speculative_decoding: {steps} steps for {completion_tokens} tokens")
    if len(accepted) != steps or len(drafted) != steps:
        raise ReplyError(
            f"metrics.speculative_decoding: {len(accepted)} accepted and {len(drafted)} drafted per step for "
            f"num_spec_steps {steps}"
        )
    out = []
    for d, a in zip(drafted, accepted):
        if not (_count(d) and _count(a) and a <= d <= num_speculative_tokens):
            raise ReplyError(
                f"metrics.speculative_decoding: a step drafted {printable(repr(d))[:20]} and accepted "
                f"{printable(repr(a))[:20]}, not counts with accepted <= drafted <= {num_speculative_tokens}"
            )
        out.append((d, a))
    total = spec.get("num_accepted_draft_tokens")
    if total is not None and total != sum(a for _, a in out):
        raise ReplyError(
            f"metrics.speculative_decoding: num_accepted_draft_tokens {printable(repr(total))[:20]} is "
            f"not the sum of per_step_accepted ({sum(a for _, a in out)})"
        )
    return out


def forwards_of(record: Mapping[str, Any], method: str, prompt_ids: Sequence[int], ngram: Mapping[str, int]) -> dict:
    """Target forwards of one measured request (prefill included) and how they were found: ``{"forwards",
    "forwards_source"}`` (+ ``forwards_check`` when the n-gram replay disagreed with vLLM's steps, then the lower
    bound ``1 + steps + untracked`` is used).

    ``method``: ``"dflash"`` (a decode step per verification step, plus any the reply's tokens need beyond them),
    ``"ngram"`` (the lookup rule replayed on the output, :func:`~dflash_assets.dflash.decoding.ngram.ngram_steps`,
    with ``ngram``'s ``prompt_lookup_min``, ``prompt_lookup_max``, ``num_speculative_tokens``; its drafted steps
    must equal vLLM's in order, the last step's accepted count excepted, which vLLM takes before trimming) or
    ``"plain"`` (one token per forward)."""
    tokens = int(record["completion_tokens"])
    if method == "plain":
        return {"forwards": max(tokens, 1), "forwards_source": "one token per forward"}
    steps = [tuple(s) for s in record["steps"]]
    untracked = max(0, tokens - 1 - sum(1 + a for _, a in steps))  # decode steps that drafted nothing
    bound = 1 + len(steps) + untracked
    if method == "dflash":
        return {"forwards": bound, "forwards_source": "1 + vLLM's verification steps"}
    replay = ngram_steps(
        prompt_ids,
        record["output_ids"],
        ngram["prompt_lookup_min"],
        ngram["prompt_lookup_max"],
        ngram["num_speculative_tokens"],
    )
    drafted = [s for s in replay if s[0] > 0]
    same = len(drafted) == len(steps) and all(
        d == vd and (a == va or (i == len(steps) - 1 and va > a))
        for i, ((d, a), (vd, va)) in enumerate(zip(drafted, steps))
    )
    if same:
        return {"forwards": 1 + len(replay), "forwards_source": "the n-gram rule replayed, vLLM's steps matched"}
    return {
        "forwards": bound,
        "forwards_source": "lower bound: 1 + vLLM's steps + the tokens no step accounts for",
        "forwards_check": f"the n-gram replay's drafted steps ({len(drafted)}) differ from vLLM's ({len(steps)})",
    }


def _record_steps(record: dict[str, Any], steps: list[tuple[int, int]], width: int) -> None:
    accepted = sum(a for _, a in steps)
    record.update(
        steps=[list(s) for s in steps],
        drafts=len(steps),
        draft_tokens=sum(d for d, _ in steps),
        accepted=accepted,
        accepted_per_position=[sum(1 for _, a in steps if a > k) for k in range(width)],
        tau=(1.0 + accepted / len(steps)) if steps else None,
    )


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
    num_speculative_tokens: int = 0,
    concurrency: int = 16,
    progress: Callable[[int, int, dict], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Decode every prompt greedily on the vLLM server at ``base_url``, ``concurrency`` requests in flight.

    Returns:
        ``(records, counter_check)``. One record per prompt, in prompt order: ``dataset``, ``position``,
        ``input_sha``, ``output_ids``, ``completion_tokens``, ``finish_reason``, ``prompt_ids_match`` (the ids vLLM
        read equal those sent; None when it returned none), ``wall_s``; with speculation
        (``num_speculative_tokens > 0``) also ``steps`` (``[drafted, accepted]`` per verification step:
        :func:`parse_step_metrics`), ``drafts``, ``draft_tokens``, ``accepted``, ``accepted_per_position`` and
        ``tau`` (``1 + accepted / drafts``; None without a step); or ``error`` (that prompt alone is lost: an
        invalid reply, other prompt ids read than sent, an HTTP error). ``counter_check``: the whole run's
        Prometheus counter differences beside the sums of the per-request figures (``agrees``), or why they could
        not be read.

    Every sampling field that could differ from greedy is sent (vLLM fills an omitted one from the model's
    ``generation_config.json``).

    Raises:
        EngineError: every prompt failed (the first error quoted); the key redacted.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(connect=30.0, read=timeout_s, write=60.0, pool=None)
    url = origin(base_url) + "/v1/completions"
    width = max(int(num_speculative_tokens), 0)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(headers=headers, timeout=timeout, limits=limits) as client:
        before = try_counters(client, base_url, width or None, api_key)

        def one(prompt: EnginePrompt) -> dict[str, Any]:
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
            started = time.monotonic()
            try:
                status, raw = bounded_request(client, "POST", url, MAX_REPLY_BYTES, json=body)
                if status != 200:
                    raise ReplyError(f"HTTP {status}: {printable(raw[:300].decode('utf-8', errors='replace'))}")
                payload = decode_reply(raw)
                parsed = parse_completion(payload, vocab_size)
                seen = parsed.pop("prompt_ids")
                if seen is not None and [int(t) for t in seen] != list(prompt.input_ids):
                    where = next((i for i, (a, b) in enumerate(zip(seen, prompt.input_ids)) if a != b), None)
                    raise ReplyError(
                        f"vLLM read other prompt ids than sent ({len(seen)} vs {len(prompt.input_ids)} ids, first "
                        f"difference at {where if where is not None else min(len(seen), len(prompt.input_ids))})"
                    )
                record.update(parsed, prompt_ids_match=None if seen is None else True)
                if width:
                    _record_steps(record, parse_step_metrics(payload, width, parsed["completion_tokens"]), width)
            except (httpx.HTTPError, ReplyError) as exc:
                record["error"] = redact(f"{type(exc).__name__}: {exc}", api_key)[:500]
            record["wall_s"] = round(time.monotonic() - started, 3)
            return record

        records: list[dict[str, Any] | None] = [None] * len(prompts)
        with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="vllm-eval") as pool:
            futures = {pool.submit(one, p): i for i, p in enumerate(prompts)}
            for done, future in enumerate(as_completed(futures), start=1):
                records[futures[future]] = record = future.result()
                if progress is not None:
                    progress(done, len(prompts), record)
        finished = [r for r in records if r is not None]
        check = counter_check(client, base_url, width, before, finished, api_key)
    if finished and all("error" in r for r in finished):
        raise EngineError(f"vLLM {origin(base_url)}: every request failed; the first: {finished[0]['error']}")
    return finished, check


def vllm_tau_by_dataset(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per dataset: :func:`~dflash_assets.dflash.decoding.tau.tau_from_sums` over ``(accepted + drafts, drafts)``
    per prompt (``tau``: the mean of per-prompt means, z-lab's figure; ``tau_pooled``: all tokens over all steps),
    ``acceptance_per_position`` (accepted / drafts at each draft position, pooled), ``requests``,
    ``requests_measured`` (no error and at least one verification step: only these count in tau), ``errors``,
    ``first_error`` and ``forwards`` (tokens per target forward and acceptance per decode step of every prompt
    with ``forwards``: :func:`~dflash_assets.stages.evaluation.baseline.engine_forward_figures`)."""
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


__all__ = ["forwards_of", "parse_completion", "parse_step_metrics", "vllm_decode", "vllm_tau_by_dataset"]
