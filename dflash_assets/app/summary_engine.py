"""The summary's serving-engine lines: vLLM's or SGLang's tau beside the in-process figure, or the simulator's
figure marked as plumbing; tau on tool-call turns apart; and who wins against the free baseline, n-gram lookup, in
tokens per target forward."""

from __future__ import annotations

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
    "engine_parity_steps",
    "engine_parity_mismatches",
    "engine_parity_ties",
    "tokens_per_forward_by_dataset",
    "baseline_statistic",
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
        steps = s.get("engine_parity_steps")
        return (
            f"engine tau (vLLM) {s.get('engine_tau')} +- {s.get('engine_tau_stderr')} beside in-process "
            f"{s.get('tau')} (mean of per-prompt 1 + accepted / verification steps, from vLLM's per-request figures; "
            f"pooled {s.get('engine_tau_pooled')}) on {_measured(s)} prompts"
            + (
                ""
                if steps is None
                else f"; step parity: {s.get('engine_parity_mismatches')} of {steps} steps differ "
                f"({s.get('engine_parity_ties')} numeric ties)"
            )
        )
    return (
        f"engine tau (SGLang) {s.get('engine_tau')} +- {s.get('engine_tau_stderr')} "
        "(mean of per-request spec_accept_length; "
        f"pooled {s.get('engine_tau_pooled')}) on {_measured(s)} requests, {s.get('engine_kind')} servers"
    )


def baseline_lines(s: dict) -> list[str]:
    """``vs n-gram lookup`` lines: per dataset, DFlash against vLLM's n-gram lookup in tokens per target forward,
    the ratio with its paired standard error and the verdict, from the evaluation's metadata; a last line names the
    statistic. Says why when n-gram was not measured; empty when the evaluation measured neither."""
    rows = {n: r for n, r in (s.get("tokens_per_forward_by_dataset") or {}).items() if r.get("verdict")}
    if rows:
        return [
            f"vs n-gram lookup   {name}: {row['verdict']}" if i == 0 else f"{' ' * 19}{name}: {row['verdict']}"
            for i, (name, row) in enumerate(rows.items())
        ] + [f"{' ' * 19}(statistic: {s.get('baseline_statistic') or '-'}; plain decoding 1.00)"]
    if s.get("baseline_verdict"):  # a report written before the per-dataset figures
        return [f"vs n-gram lookup   {s['baseline_verdict']}"]
    if s.get("drafter_tokens_per_forward") is None:
        return []
    return [
        f"vs n-gram lookup   DFlash {s['drafter_tokens_per_forward']:.2f} tokens per forward (plain decoding 1.00); "
        f"n-gram lookup not measured: {s.get('ngram_baseline_not_compared') or '-'}"
    ]


def _measured(s: dict) -> str:
    """``M of N``: prompts the engine's figure counts (measured) of those sent; ``N`` alone for a report written
    before the count was kept."""
    measured = s.get("engine_requests_measured")
    return f"{s.get('engine_requests')}" if measured is None else f"{measured} of {s.get('engine_requests')}"


__all__ = ["ENGINE_KEYS", "baseline_lines", "engine_line"]


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
