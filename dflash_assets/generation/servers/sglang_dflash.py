"""SGLang serving a DFlash drafter: the server flags, and the per-request acceptance length it reports.

Flag names and behaviour from SGLang 0.5.23's source (``arg_groups/fields/spec.py``, ``fields/exec_.py``,
``arg_groups/speculative_hook.py`` ``_handle_dflash``):

* ``--speculative-algorithm DFLASH --speculative-draft-model-path DIR --speculative-num-draft-tokens N``
  (``N`` = the verify block; ``--speculative-dflash-block-size`` is an alias that must agree with it).
  SGLang sets ``--speculative-num-steps`` and ``--speculative-eagle-topk`` to 1 for DFLASH itself (other
  values are overridden with a warning), so they are not passed.
* ``--speculative-draft-attention-backend``: one of ``flashinfer fa3 fa4 triton trtllm_mha`` on CUDA
  (``DRAFT_ATTENTION_BACKEND_CHOICES``); unset, SGLang uses the target's attention backend or flashinfer.
  ``trtllm_mha`` is taken only when every draft layer slides or the draft is causal (this drafter's full
  layers attend non-causally), else SGLang falls back with a warning.
* ``--mamba-radix-cache-strategy {auto,no_buffer,extra_buffer,extra_buffer_lazy}`` for targets with
  recurrent (linear-attention) layers: ``extra_buffer`` keeps per-draft-position states. The flag was
  ``--mamba-scheduler-strategy`` before; 0.5.15 still accepted that as a deprecated alias, 0.5.20 and
  later reject it ("unrecognized arguments").

Per request, SGLang's native ``/generate`` returns ``meta_info.spec_accept_length`` =
``completion_tokens / spec_verify_ct`` (``managers/tokenizer_manager.py``), the token from the prefill
included, plus ``spec_verify_ct``, ``spec_accept_rate``, ``spec_num_correct_drafts``,
``spec_num_proposed_drafts`` and ``spec_correct_drafts_histogram``, once a request had a verify step.
z-lab's ``dflash/benchmark.py`` posts ``/generate`` and averages ``spec_accept_length`` over requests. The
OpenAI-compatible ``/v1/chat/completions`` carries the same fields only on request
(``return_meta_info: true`` -> ``choices[i].meta_info``, from 0.5.15; ``return_spec_tokens_details: true``
-> ``sglext.spec_tokens_details``, from 0.5.20), so this client uses ``/generate`` with the prompt's token
ids: the engine decodes exactly the ids the in-process evaluation decodes.

No Dagster here.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from dflash_assets.dflash.decoding.tau import tau_from_sums
from dflash_assets.dflash.export.sglang_check import is_hybrid_target
from dflash_assets.generation.api.replies import MAX_REPLY_BYTES, ReplyError, decode_reply, printable
from dflash_assets.generation.api.urls import origin, redact, strip_credentials

#: SGLang's ``DRAFT_ATTENTION_BACKEND_CHOICES`` (``arg_groups/choices.py``)
SGLANG_DRAFT_ATTENTION_BACKENDS = ("flashinfer", "fa3", "fa4", "triton", "ascend", "trtllm_mha", "intel_xpu")
#: the CUDA ones this project offers (``drafter_evaluation.draft_attention_backend``)
DRAFT_ATTENTION_BACKENDS = ("flashinfer", "fa3", "fa4", "triton", "trtllm_mha")
#: ``--mamba-radix-cache-strategy`` choices (``arg_groups/fields/exec_.py``)
MAMBA_STRATEGIES = ("auto", "no_buffer", "extra_buffer", "extra_buffer_lazy")
MAMBA_STRATEGY_FLAG = "--mamba-radix-cache-strategy"
#: what /server_info says about speculative decoding: the only fields copied into reports (never the whole
#: reply, which holds every server argument)
SERVER_INFO_FIELDS = (
    "version",
    "model_path",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_draft_tokens",
    "speculative_draft_attention_backend",
    "attention_backend",
    "mamba_radix_cache_strategy",
    "tp_size",
    "simulated",
)
SPEC_FIELDS = (
    "spec_accept_length",
    "spec_verify_ct",
    "spec_accept_rate",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
)


#: Greedy decoding with every sampling field that could differ from it named: SGLang and vLLM fill an omitted
#: one from the model's generation_config.json.
GREEDY_SAMPLING = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def mamba_strategy_for(target_config: Mapping[str, Any], configured: str | None) -> str | None:
    """The ``--mamba-radix-cache-strategy`` to pass: ``configured`` when set, else ``extra_buffer`` for a
    target with linear-attention layers (:func:`~dflash_assets.dflash.export.sglang_check.is_hybrid_target`), else
    None (not passed: a plain transformer has no recurrent state)."""
    if configured is not None:
        if configured not in MAMBA_STRATEGIES:
            raise ValueError(f"mamba strategy {configured!r}: use one of {list(MAMBA_STRATEGIES)}")
        return configured
    return "extra_buffer" if is_hybrid_target(dict(target_config)) else None


def dflash_server_flags(
    draft_model_path: str,
    num_draft_tokens: int,
    *,
    draft_attention_backend: str | None = None,
    mamba_strategy: str | None = None,
    draft_window_size: int | None = None,
) -> list[str]:
    """SGLang flags that load ``draft_model_path`` as a DFlash drafter (module docstring for each).

    Raises:
        ValueError: a backend or strategy SGLang does not offer, or a non-positive count.
    """
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    flags = [
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(draft_model_path),
        "--speculative-num-draft-tokens",
        str(num_draft_tokens),
    ]
    if draft_attention_backend is not None:
        if draft_attention_backend not in DRAFT_ATTENTION_BACKENDS:
            raise ValueError(
                f"draft attention backend {draft_attention_backend!r}: use one of {list(DRAFT_ATTENTION_BACKENDS)}"
            )
        flags += ["--speculative-draft-attention-backend", draft_attention_backend]
    if mamba_strategy is not None:
        if mamba_strategy not in MAMBA_STRATEGIES:
            raise ValueError(f"mamba strategy {mamba_strategy!r}: use one of {list(MAMBA_STRATEGIES)}")
        flags += [MAMBA_STRATEGY_FLAG, mamba_strategy]
    if draft_window_size is not None:
        flags += ["--speculative-draft-window-size", str(draft_window_size)]
    return flags


def ngram_server_flags(num_draft_tokens: int) -> list[str]:
    """SGLang flags for its n-gram speculation with ``num_draft_tokens`` tokens per verification (the same count
    ``--speculative-num-draft-tokens`` gives DFLASH: the last accepted token and ``num_draft_tokens - 1``
    drafted). Read from SGLang 0.5.23's ``ServerArgs`` (``arg_groups/fields/spec.py``, ``_handle_ngram``): NGRAM
    takes no draft model; it drafts from a trie of recent tokens of every request (``--speculative-ngram-*``
    left at SGLang's defaults: BFS breadth 1-10, trie depth 18), pads a step without a match and verifies it all
    the same, so its ``spec_verify_ct`` counts every decode forward. CUDA only; untested on a GPU here.

    Raises:
        ValueError: ``num_draft_tokens`` below 2 (nothing would be drafted).
    """
    if num_draft_tokens < 2:
        raise ValueError(f"num_draft_tokens must be >= 2 for n-gram drafts, got {num_draft_tokens}")
    return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(num_draft_tokens)]


def input_sha(input_ids: Sequence[int]) -> str:
    """16 hex of SHA-256 over the JSON list of ``input_ids``: names a request in logs and reports."""
    return hashlib.sha256(json.dumps([int(i) for i in input_ids]).encode()).hexdigest()[:16]


def server_info(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
    """:data:`SERVER_INFO_FIELDS` of the server's ``/server_info`` (``/get_server_info`` for older
    releases); an empty dict when neither answers. ``simulated`` is True only for the simulator."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for path in ("/server_info", "/get_server_info"):
        try:
            r = httpx.get(origin(base_url) + path, headers=headers, timeout=timeout_s)
        except httpx.TransportError:
            continue
        if r.status_code == 200:
            try:
                info = r.json()
            except ValueError:
                continue
            if isinstance(info, dict):
                picked = {k: info.get(k) for k in SERVER_INFO_FIELDS if k in info}
                return json.loads(redact(json.dumps(picked, default=str), api_key))
    return {}


@dataclass(frozen=True)
class EnginePrompt:
    """One prompt to decode: its dataset, its position in that dataset and its token ids (template applied)."""

    dataset: str
    position: int
    input_ids: tuple[int, ...]


class EngineError(RuntimeError):
    """The engine answered with an error or without the speculative fields; the message names the URL."""


async def _one(
    client: httpx.AsyncClient, url: str, prompt: EnginePrompt, sampling: dict, api_key: str | None, max_attempts: int
) -> dict[str, Any]:
    body = {"input_ids": list(prompt.input_ids), "sampling_params": sampling}
    shown = strip_credentials(url)
    for attempt in range(1, max_attempts + 1):
        try:
            r = await client.post(url, json=body)
        except httpx.TransportError as exc:
            if attempt == max_attempts:
                raise EngineError(f"POST {shown}: {type(exc).__name__}: {redact(str(exc), api_key)}") from None
            await asyncio.sleep(min(30.0, 0.5 * 2**attempt) * (0.5 + random.random()))
            continue
        if r.status_code >= 500 and attempt < max_attempts:
            await asyncio.sleep(min(30.0, 0.5 * 2**attempt) * (0.5 + random.random()))
            continue
        if r.status_code != 200:
            raise EngineError(f"POST {shown} got HTTP {r.status_code}: {redact(r.text, api_key)[:400]}")
        try:  # a malformed reply costs this prompt, never the evaluation
            meta = _checked_meta(r.content)
        except ReplyError as exc:
            return {
                "dataset": prompt.dataset,
                "position": prompt.position,
                "input_sha": input_sha(prompt.input_ids),
                "error": redact(f"ReplyError: {exc}", api_key)[:500],
                "server": strip_credentials(origin(url)),
            }
        finish = meta.get("finish_reason")
        return {
            "dataset": prompt.dataset,
            "position": prompt.position,
            "input_sha": input_sha(prompt.input_ids),
            "prompt_tokens": meta.get("prompt_tokens"),
            "completion_tokens": meta.get("completion_tokens"),
            "finish_reason": finish.get("type") if isinstance(finish, dict) else finish,
            **{k: meta.get(k) for k in SPEC_FIELDS},
            "server": strip_credentials(origin(url)),
        }
    raise AssertionError("unreachable")


def _checked_meta(body: bytes) -> dict[str, Any]:
    """``meta_info`` of a ``/generate`` reply, its counts and speculative fields checked.

    Raises:
        ReplyError: over :data:`MAX_REPLY_BYTES`, not JSON, not an object, or a field of the wrong type.
    """
    if len(body) > MAX_REPLY_BYTES:
        raise ReplyError(f"the reply is {len(body):,} bytes, over {MAX_REPLY_BYTES:,}")
    out = decode_reply(body)
    out = out[0] if isinstance(out, list) and out else out
    if not isinstance(out, dict) or not isinstance(out.get("meta_info", {}), dict):
        raise ReplyError("the reply is not an object with a meta_info object")
    meta = out.get("meta_info") or {}
    for key in ("prompt_tokens", "completion_tokens", "spec_verify_ct"):
        value = meta.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ReplyError(f"meta_info.{key} is {printable(repr(value))[:40]}, not a count")
    for key in ("spec_accept_length", "spec_accept_rate"):
        value = meta.get(key)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool) or value != value):
            raise ReplyError(f"meta_info.{key} is {printable(repr(value))[:40]}, not a number")
    return meta


async def _generate_all(
    base_urls: Sequence[str],
    prompts: Sequence[EnginePrompt],
    sampling: dict,
    api_key: str | None,
    concurrency: int,
    timeout_s: float,
    max_attempts: int,
) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(
        max_connections=concurrency * len(base_urls), max_keepalive_connections=concurrency * len(base_urls)
    )
    timeout = httpx.Timeout(connect=30.0, read=timeout_s, write=60.0, pool=None)
    gates = [asyncio.Semaphore(concurrency) for _ in base_urls]
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:

        async def run(i: int, prompt: EnginePrompt) -> dict[str, Any]:
            k = i % len(base_urls)  # round robin: each server gets every len(base_urls)-th prompt
            async with gates[k]:
                return await _one(client, origin(base_urls[k]) + "/generate", prompt, sampling, api_key, max_attempts)

        return list(await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts))))


def engine_generate(
    base_urls: Sequence[str],
    prompts: Sequence[EnginePrompt],
    max_new_tokens: int,
    *,
    stop_token_ids: Sequence[int] = (),
    api_key: str | None = None,
    concurrency: int = 16,
    timeout_s: float = 3600.0,
    max_attempts: int = 3,
) -> list[dict[str, Any]]:
    """Decode every prompt greedily on the engines (``POST /generate`` with ``input_ids``) and return one
    record per prompt, in order: ``dataset``, ``position``, ``input_sha``, ``prompt_tokens``,
    ``completion_tokens``, ``finish_reason``, the :data:`SPEC_FIELDS` as SGLang reported them (None when a
    request had no verify step, e.g. it stopped at the prefill's token) and ``server``.

    Every sampling field is sent, neutral ones included: SGLang fills an omitted one from the model's
    ``generation_config.json``. Transport errors and 5xx are retried (``max_attempts``, jittered backoff).

    Raises:
        EngineError: an HTTP error, or a request the engines could not answer; the key is redacted.
    """
    sampling = {**GREEDY_SAMPLING, "max_new_tokens": int(max_new_tokens)}
    if stop_token_ids:
        sampling["stop_token_ids"] = [int(t) for t in stop_token_ids]
    if not base_urls:
        raise ValueError("no engine URL")
    return asyncio.run(
        _generate_all(list(base_urls), list(prompts), sampling, api_key, concurrency, timeout_s, max_attempts)
    )


def engine_tau_by_dataset(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per dataset, tau from the engine's per-request figures (:func:`~dflash_assets.dflash.decoding.tau.tau_from_sums`
    over ``(spec_accept_length x spec_verify_ct, spec_verify_ct)``: the per-prompt mean is the mean of
    SGLang's own ``spec_accept_length``, z-lab's figure; pooled is all tokens over all verify steps), plus
    ``tau_without_prefill_token`` (the same with each request's prefill token taken out: what the in-process
    evaluation counts), ``requests``, ``requests_measured`` and ``mean_accept_rate``."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["dataset"] for r in records):
        rows = [r for r in records if r["dataset"] == name]
        measured = [r for r in rows if r.get("spec_verify_ct") and r.get("spec_accept_length") is not None]
        # S_i = spec_accept_length x spec_verify_ct, so the per-prompt mean is the engine's own figure, unrounded
        sums = tau_from_sums(
            [(float(r["spec_accept_length"]) * int(r["spec_verify_ct"]), int(r["spec_verify_ct"])) for r in measured]
        )
        bare = tau_from_sums([(float(r["completion_tokens"]) - 1, int(r["spec_verify_ct"])) for r in measured])
        rates = [float(r["spec_accept_rate"]) for r in measured if r.get("spec_accept_rate") is not None]
        errors = sum("error" in r for r in rows)
        out[name] = {
            **sums,
            "tau_without_prefill_token": bare["tau"],
            "requests": len(rows),
            "requests_measured": len(measured),
            "errors": errors,
            "mean_accept_rate": sum(rates) / len(rates) if rates else None,
        }
    return out


__all__ = [
    "DRAFT_ATTENTION_BACKENDS",
    "MAMBA_STRATEGIES",
    "EngineError",
    "EnginePrompt",
    "dflash_server_flags",
    "engine_generate",
    "engine_tau_by_dataset",
    "input_sha",
    "mamba_strategy_for",
    "ngram_server_flags",
    "server_info",
]
