"""The summary's serving-engine lines: vLLM's or SGLang's tau beside the in-process figure, or the simulator's
figure marked as plumbing; tau on tool-call turns apart; who wins against the free baseline, n-gram lookup, in
tokens per target forward; and where the training rows' ids come from (the server's, or the project's rendering)
and whether the servers honoured the seed."""

from __future__ import annotations

from collections import Counter

ENGINE_KEYS = (
    "engine_kind",
    "engine_simulated",
    "engine_requests",
    "engine_requests_measured",
    "engine_tau",
    "engine_tau_stderr",
    "engine_tau_pooled",
    "simulated_engine_tau",
    "simulated_engine_tau_pooled",
    "engine_parity_max_difference",
    "ngram_tokens_per_forward",
    "ngram_tokens_per_forward_stderr",
    "drafter_tokens_per_forward",
    "drafter_tokens_per_forward_source",
    "drafter_in_process_tokens_per_forward",
    "baseline_verdict",
    "ngram_baseline_not_compared",
)


def engine_line(s: dict) -> str | None:
    """The serving engine's figure, on a line of its own: SGLang's per-request ``spec_accept_length`` (mean over
    requests; pooled) for a real engine; for the simulator, a line that says the figure is simulated plumbing,
    not a measurement. None when no engine ran."""
    if s.get("engine_kind") is None:
        return None
    if s.get("engine_simulated"):
        return (
            f"engine (SIMULATED)  plumbing check only, not a measurement: {s.get('engine_requests')} requests "
            "answered by the "
            f"GPU-node simulator with SGLang's per-request fields (simulated tau {s.get('simulated_engine_tau')}, "
            f"pooled {s.get('simulated_engine_tau_pooled')})"
        )
    if s.get("engine_kind") == "vllm":
        diff = s.get("engine_parity_max_difference")
        return (
            f"engine tau (vLLM) {s.get('engine_tau')} +- {s.get('engine_tau_stderr')} beside in-process "
            f"{s.get('tau')} (mean of per-prompt 1 + accepted / drafts from vLLM's counters; pooled "
            f"{s.get('engine_tau_pooled')}) on {_measured(s)} prompts"
            + ("" if diff is None else f"; largest difference {diff:.3f} (check engine_parity: at most 0.05)")
        )
    return (
        f"engine tau (SGLang) {s.get('engine_tau')} +- {s.get('engine_tau_stderr')} "
        "(mean of per-request spec_accept_length; "
        f"pooled {s.get('engine_tau_pooled')}) on {_measured(s)} requests, {s.get('engine_kind')} servers"
    )


def baseline_line(s: dict) -> str | None:
    """``vs n-gram lookup   DFlash D vs n-gram lookup N tokens per forward (no training): the drafter wins|loses on
    these prompts (plain decoding 1.00; ...)``: the held-out prompts' figures from the evaluation's metadata, the
    drafter's from the same engine run as the n-gram one (else in process). Says why when n-gram was not measured;
    None when the evaluation measured neither."""
    if s.get("baseline_verdict"):
        source = s.get("drafter_tokens_per_forward_source")
        local = s.get("drafter_in_process_tokens_per_forward")
        where = "both from the same vLLM run" if source == "engine" else f"DFlash {source}"
        return (
            f"vs n-gram lookup   {s['baseline_verdict']} (plain decoding 1.00; {where}"
            + (f"; DFlash in process {local:.2f}" if source == "engine" and local is not None else "")
            + f"; n-gram +- {s.get('ngram_tokens_per_forward_stderr')})"
        )
    if s.get("drafter_tokens_per_forward") is None:
        return None
    return (
        f"vs n-gram lookup   DFlash {s['drafter_tokens_per_forward']:.2f} tokens per forward (plain decoding 1.00); "
        f"n-gram lookup not measured: {s.get('ngram_baseline_not_compared') or '-'}"
    )


def _measured(s: dict) -> str:
    """``M of N``: prompts the engine's figure counts (measured) of those sent; ``N`` alone for a report written
    before the count was kept."""
    measured = s.get("engine_requests_measured")
    return f"{s.get('engine_requests')}" if measured is None else f"{measured} of {s.get('engine_requests')}"


__all__ = ["ENGINE_KEYS", "baseline_line", "engine_line"]


def tool_turn_lines(s: dict) -> list[str]:
    """Tau on tool-call turns apart, one line per dataset with tool calls or tools (the held-out prompts only
    when some of them call a tool): ``name: tool-call turns n of N prompts, tau x in process, y in vLLM``."""
    from dflash_assets.stages.evaluation.tool_turns import tool_turn_line

    engine = {"vllm": "vLLM", None: "the engine"}.get(s.get("engine_kind"), "SGLang")
    return [
        tool_turn_line(name, groups, engine)
        for name, groups in (s.get("tool_call_turns") or {}).items()
        if name != "heldout" or groups["tool_call"]["prompts"]
    ]


def token_origin(keys: list[str], meta) -> dict:
    """From each partition's latest completions and tokenized_sequences metadata (``meta(asset, pk)``, a dict):
    tokenized rows by ids source
    (``tokenized_by_ids_source``; a partition tokenized before they were counted: ``unknown``), how many renderings
    differ from the server's prompt ids (``prompt_ids_differ``), and what the servers said of the seed
    (``seed_honoured``: the distinct values of the completions' ``seed_honoured``, absent when no seed was set)."""
    sources: Counter = Counter()
    differ, seeds = 0, set()
    for pk in keys:
        completions, tokenized = meta("completions", pk), meta("tokenized_sequences", pk)
        counts = tokenized.get("counts") or {}
        sources.update({k[len("ids_") :]: v for k, v in counts.items() if k.startswith("ids_")})
        if tokenized and not any(k.startswith("ids_") for k in counts):
            sources["unknown"] += tokenized.get("rows", 0)
        differ += counts.get("prompt_ids_differ", 0)
        seed = (completions.get("settings") or {}).get("seed")
        if seed is not None:  # what the servers said of it (a partition made before they were asked: unknown)
            seeds.add(completions.get("seed_honoured") or "unknown")
    return {
        "tokenized_by_ids_source": dict(sorted(sources.items())),
        "prompt_ids_differ": differ,
        "seed_honoured": sorted(seeds),
    }


#: what the summary says of a configured seed, by what the servers said of it (servers/origin.py)
SEED_WORDS = {
    "yes": "the servers sample with it",
    "no": "the servers drop it",
    "unknown": "unknowable: the servers do not say whether they sample with it (SGLang says so in /server_info, "
    "vLLM always does; an external openai or transformers server does not)",
}


def ids_source_text(s: dict) -> str:
    """``; ids: server N, rendered M`` (and how many renderings differ from the server's prompt ids), then what the
    servers said of a configured seed (:data:`SEED_WORDS`), or nothing when no partition counted either."""
    sources, text = s.get("tokenized_by_ids_source") or {}, ""
    if sources:
        text = "; ids: " + ", ".join(f"{k} {v}" for k, v in sources.items())
    if s.get("prompt_ids_differ"):
        text += f" ({s['prompt_ids_differ']} renderings differ from the server's prompt ids: see tokenized_sequences)"
    if seeds := s.get("seed_honoured"):
        text += "; seed: " + "; ".join(SEED_WORDS.get(v, v) for v in seeds)
    return text
