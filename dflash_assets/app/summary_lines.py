"""The end-of-run summary as lines (:func:`format_summary`), from the figures :func:`~dflash_assets.app.summary.
collect_summary` gathered: the corpus, completions, features, the drafter and its acceptance, failed checks, where
every output is; the serving engine's lines (vLLM's or SGLang's tau beside the in-process figure, or the
simulator's figure marked as plumbing), tau on tool-call turns apart, who wins against the free baseline,
n-gram lookup, in tokens per target forward; and where the training rows' ids come from (the server's, or the
project's rendering) and whether the servers honoured the seed."""

from __future__ import annotations

import re

from dflash_assets.app.summary import PK, UI_PORT


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


#: what the summary says of a configured seed, by what the servers said of it (generation/servers/origin.py)
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


def failed_check_lines(checks: list[dict], max_keys: int = 5) -> list[str]:
    """``failed checks      <asset.check> (WARN): 3 of 4 partitions failed: pk1, pk2, pk3`` lines
    (``none`` if empty)."""
    if not checks:
        return ["failed checks      none"]
    lines = []
    for i, c in enumerate(checks):
        where = (
            f"{c['failed']} of {c['evaluated']} partitions failed: {', '.join(c['partitions'][:max_keys])}"
            + (f" (+{len(c['partitions']) - max_keys} more)" if len(c["partitions"]) > max_keys else "")
            if c["partitions"]
            else "failed"
        )
        text = f"{c['check']} ({c['severity']}): {where}" + (f"; {c['description']}" if c.get("description") else "")
        lines.append(("failed checks      " if i == 0 else " " * 19) + text)
    return lines


def feature_lines(s: dict) -> list[str]:
    """Summary lines on where the drafter's target features came from and the storage plan."""
    lines = []
    if s.get("features") == "online":
        lines.append(
            f"features           online: the frozen target computed every batch's features during training "
            f"({s.get('target_forwards') or 0} target forwards); no hidden-state shard stored"
        )
    elif s.get("features") == "offline":
        sub = s.get("offline_subset") or {}
        extra = f"; subset {sub}" if sub.get("max_rows") is not None or sub.get("fraction") is not None else ""
        lines.append(f"features           offline: read from stored hidden-state shards{extra}")
    if s.get("storage_plan"):
        lines.append(f"storage plan       {s['storage_plan']}")
    return lines


def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def advice_table(markdown: str) -> list[str]:
    """The cap-advice Markdown table (truncation_report metadata) as aligned text rows; other text kept as is."""
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in markdown.splitlines()
        if line.strip().startswith("|")
    ]
    rows = [r for r in rows if not all(re.fullmatch(r":?-+:?", c) for c in r)]
    if not rows:
        return [line for line in markdown.splitlines() if line.strip()]
    widths = [max(len(r[i]) if i < len(r) else 0 for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def drafter_line(s: dict) -> str:
    """``N parameters; trained N steps on M tokens`` / ``resumed at step K ...`` / ``reused because nothing changed``
    (the drafter asset's ``outcome_text``); a drafter this command did not materialize is reported as reused."""
    params = "-" if s.get("drafter_parameters") is None else s["drafter_parameters"]
    text = s.get("drafter_outcome_text")
    if text is None:
        text = f"trained on {'-' if s.get('drafter_train_tokens') is None else s['drafter_train_tokens']} tokens"
    if s.get("drafter_ran") is False:
        steps, tokens = s.get("drafter_steps"), s.get("drafter_train_tokens")
        text = f"reused because nothing changed ({steps} steps on {tokens} tokens, no training step this run)"
    return f"{params} parameters; {text}"


def acceptance_line(s: dict) -> str:
    """``tau T +- SE (mean of per-prompt means; pooled P +- SE) (untrained drafter: T0 +- SE0) on N held-out prompts,
    speedup X, lossless: yes``; SE is the standard error across prompts; parts not measured are left out (the
    untrained drafter's unless ``drafter_evaluation.untrained_baseline`` ran it) or ``-``;
    ``(reused: drafter unchanged, no decoding)`` when the evaluation did not decode again."""
    if s.get("tau") is None and s.get("engine_kind") is not None:
        return "acceptance length  tau - (in-process decoding not run: drafter_evaluation.in_process is false)"
    if s.get("tau") is None:
        return "acceptance length  tau -"

    def with_se(value, se) -> str:
        return f"{value}" if se is None else f"{value} +- {se}"

    text = f"acceptance length  tau {with_se(s['tau'], s.get('tau_stderr'))}"
    if s.get("tau_pooled") is not None:
        text += f" (mean of per-prompt means; pooled {with_se(s['tau_pooled'], s.get('tau_pooled_stderr'))})"
    if s.get("tau_untrained") is not None:
        text += f" (untrained drafter: {with_se(s['tau_untrained'], s.get('tau_untrained_stderr'))})"
    if s.get("eval_prompts") is not None:
        text += f" on {s['eval_prompts']} held-out prompts"
    if s.get("speedup") is not None:
        text += f", speedup {s['speedup']}x"
    if s.get("lossless") is not None:
        text += f", lossless: {'yes' if s['lossless'] else 'NO'}"
    if s.get("evaluation_ran") is False or s.get("evaluation_outcome") == "reused":
        text += " (reused: drafter unchanged, no decoding)"
    return text


def dataset_lines(s: dict) -> list[str]:
    """One line per extra evaluation dataset (beyond the held-out prompts):
    ``name: tau T +- SE (pooled ...) on N prompts``."""
    rows = []
    for name, d in (s.get("tau_by_dataset") or {}).items():
        if name == "heldout":
            continue
        untrained = "" if d.get("tau_untrained") is None else f"; untrained {d['tau_untrained']}"
        rows.append(
            f"  {name}: tau {d.get('tau')} +- {d.get('tau_stderr')} (pooled {d.get('tau_pooled')} +- "
            f"{d.get('tau_pooled_stderr')}{untrained}) on {d.get('prompts')} prompts"
        )
    return rows


def format_summary(s: dict) -> str:
    """The summary from :func:`collect_summary` as aligned text lines: numbers, then where each output is."""

    def fmt(v):
        return "-" if v is None else v

    n_parts = s["partitions"]
    reasons = ", ".join(f"{k} {v}" for k, v in s["finish_reasons"].items()) or "-"
    rate = s["truncation_rate"]
    lines = [
        "== dflash-assets summary ==",
        (
            f"prompts            {fmt(s['prompts'])} ({fmt(s['duplicates'])} duplicates, "
            f"{fmt(s['rejected'])} rejected) "
            f"in {n_parts} partition{'' if n_parts == 1 else 's'}"
            + (
                f"; last build: {edit.get('new', 0)} new, {edit.get('changed', 0)} changed, "
                f"{edit.get('removed', 0)} removed"
                if (edit := s.get("prompts_edit"))
                else ""
            )
        ),
        f"completions        {s['completions']} rows (errors: {s['completion_errors']}"
        + (
            f"; set aside as too long for the context, never sent: {s['prompt_too_long']}"
            if s.get("prompt_too_long")
            else ""
        )
        + f"), {s.get('completions_without_ids', 0)} without the model's own token ids; finish_reason: {reasons}",
        f"truncation         {'-' if rate is None else f'{rate:.2%}'} of completions hit the cap of "
        f"{fmt(s['cap'])} tokens",
    ]
    if kinds := s.get("rows_per_turn_kind"):  # issue 43: rows by what their turn was, and how often each hit the cap
        rates = s.get("truncation_rate_per_turn_kind") or {}
        lines.append(
            "turn kinds         " + ", ".join(f"{kind} {n} ({rates.get(kind, 0):.0%} cut)" for kind, n in kinds.items())
        )
    if isinstance(s.get("cap_advice"), str) and s["cap_advice"].strip():
        table = advice_table(s["cap_advice"])
        lines += [("cap advice         " if i == 0 else " " * 19) + row for i, row in enumerate(table)]
    lines += [
        f"tokenized          {s['tokenized_rows']} rows, {s['loss_tokens']} loss tokens" + ids_source_text(s),
        f"hidden states      {s['hidden_state_bytes']} bytes ({_size(s['hidden_state_bytes'])}) "
        f"for {s['hidden_state_tokens']} tokens",
        f"drafter            {drafter_line(s)}",
        *feature_lines(s),
        acceptance_line(s),
        *[" " * 19 + row.strip() for row in dataset_lines(s)],
        *[" " * 19 + row for row in tool_turn_lines(s)],
        *([engine_line(s)] if engine_line(s) else []),
        *baseline_lines(s),
        *failed_check_lines(s.get("failed_checks") or []),
        "",
        "== where the outputs are ==",
    ]
    materialized = s.get("materialized", {})
    for label, location, asset in s["outputs"]:
        missing = "" if materialized.get(asset, True) else "  (not written yet)"
        if asset == "hidden_states" and s.get("features") == "online" and missing:
            missing = "  (not written: the drafter trained online)"
        lines.append(f"{label:<19}{location}{missing}")
    keys = s.get("partition_keys") or []
    if len(keys) > 1:
        lines.append(f"{PK:<19}one of {len(keys)} partition keys: {keys[0]} .. {keys[-1]}")
    lines.append(f"{'open the UI':<19}{s['ui_command']}   # then http://127.0.0.1:{UI_PORT}")
    return "\n".join(lines)


__all__ = [
    "acceptance_line",
    "advice_table",
    "baseline_lines",
    "dataset_lines",
    "drafter_line",
    "engine_line",
    "failed_check_lines",
    "feature_lines",
    "format_summary",
    "ids_source_text",
    "tool_turn_lines",
]
