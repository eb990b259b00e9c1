"""The summary's serving-engine line: vLLM's or SGLang's tau beside the in-process figure, or the simulator's
figure marked as plumbing."""

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
    "engine_parity_max_difference",
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


def _measured(s: dict) -> str:
    """``M of N``: prompts the engine's figure counts (measured) of those sent; ``N`` alone for a report written
    before the count was kept."""
    measured = s.get("engine_requests_measured")
    return f"{s.get('engine_requests')}" if measured is None else f"{measured} of {s.get('engine_requests')}"


__all__ = ["ENGINE_KEYS", "engine_line"]
