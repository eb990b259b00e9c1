"""``python -m dflash_assets status`` as lines (:func:`format_status`), from the figures
:func:`~dflash_assets.app.status.collect_status` gathered: a stage table, then completions progress, throughput and
ETA, what the corpus's last build changed and what the settings make again."""

from __future__ import annotations

import time

from dflash_assets.orchestration.check_gate import held_message
from dflash_assets.orchestration.partitions import prompt_ranges


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


def format_status(status: dict) -> str:
    """Human-readable text of :func:`collect_status`'s dict: a stage table, then throughput and ETA."""
    lines = [f"partitions: {status['partitions']} ({prompt_ranges.name}, {status['prompts']} prompts)"]
    header = f"{'stage':<22}{'done':>7}{'failed':>8}{'in progress':>13}{'missing':>9}"
    lines += [header, "-" * len(header)]
    for name, c in status["stages"].items():
        lines.append(f"{name:<22}{c['done']:>7}{c['failed']:>8}{c['in_progress']:>13}{c['missing']:>9}")
        if c["failed_keys"]:
            shown = ", ".join(c["failed_keys"][:5]) + (" ..." if len(c["failed_keys"]) > 5 else "")
            lines.append(f"  failed: {shown}")
    if held := status.get("held"):
        lines.append(held_message(held))
    for pool, p in status.get("pools", {}).items():
        limit = "no limit" if p["limit"] is None else f"limit {p['limit']}"
        lines.append(f"pool {pool}: {limit}, {p['in_use']} in use, {p['waiting']} waiting")
    comp = status["completions"]
    rate = f"{comp['tokens_per_s']:.1f} output tok/s" if comp["tokens_per_s"] is not None else "rate unknown"
    if comp.get("requests_per_s") is not None:
        rate += f", {comp['requests_per_s']:.2f} req/s"
    lines.append(
        f"completions done: {comp['rows_done']} / {comp.get('rows_total', status['prompts'])} rows valid"
        + (f" under cap {comp['cap']}" if comp.get("cap") is not None else "")
        + f"; {comp['tokens_done']} completion tokens; generation {comp['generation_s']:.1f} s ({rate})"
    )
    regen = comp.get("regenerate") or {}
    if edit := status.get("corpus_edit"):
        lines.append(
            f"corpus, last build: {edit['new']} new, {edit['changed']} changed, {edit['removed']} removed prompts "
            f"(stable indices: unchanged prompts keep their rows); completions still to request for new or "
            f"changed prompts and partitions not done: {edit['to_request']}"
            + (
                f"; {regen['removed']} stored rows of removed prompts are dropped, no request"
                if regen.get("removed")
                else ""
            )
        )
    if preview := status.get("corpus_preview"):
        lines.append(preview)
    if regen.get("rows"):
        reasons = ", ".join(f"{k}: {v}" for k, v in regen["by_reason"].items())
        lines.append(
            f"to regenerate under the current settings: {regen['rows']} rows in {len(regen['partitions'])} "
            f"partitions ({reasons})"
            + (f"; {regen['continued']} of them continued from the tokens they have" if regen.get("continued") else "")
            + (
                f"; up to {regen['cut_locally']} of them cut to the lower cap from their own tokens, no request "
                "(those whose tokens match their text; the estimate counts them at 0 tokens)"
                if regen.get("cut_locally")
                else ""
            )
        )
    for run in status.get("runs_in_progress", []):
        eta = run["eta_s"] if run["eta_s"] is not None and run["eta_s"] >= 0 else None
        lines.append(
            f"run {run['run_id'][:8]} in progress ({run['range']}): {run['rows_done']} / {run['rows_total']} rows, "
            f"{run['req_per_s']} req/s, {run['output_tok_per_s']} output tok/s, slots {run['slots_in_flight']} / "
            f"{run['slots_capacity']}, ETA {_duration(eta)} "
            f"(at its last partition commit, {time.time() - run['as_of']:.0f} s ago)"
        )
    remaining = comp["tokens_remaining_est"]
    lines.append(
        f"completions remaining: {comp['rows_remaining']} prompts, ~{remaining:.0f} tokens"
        if remaining is not None
        else f"completions remaining: {comp['rows_remaining']} prompts, tokens unknown (no partition done yet)"
    )
    lines[-1] += f", ETA {_duration(comp['eta_s'])}"
    return "\n".join(lines)
