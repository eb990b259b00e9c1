"""The end-of-run summary, read back from the assets' latest materialization metadata.

:func:`collect_summary` gathers the numbers (never recomputed from the data: each is an asset's metadata,
summed over partitions where the asset is partitioned, one latest materialization per partition) and
where every output lives; :func:`format_summary` prints them.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from pathlib import Path

import dagster as dg

from dflash_assets.app.summary_engine import ENGINE_KEYS, baseline_lines, engine_line, tool_turn_lines
from dflash_assets.assets import truncation as truncation_asset
from dflash_assets.dflash.shards.format import INDEX_NAME, SHARD_PATTERN
from dflash_assets.orchestration.check_gate import BLOCKING_CHECKS, why_unevaluated
from dflash_assets.orchestration.config import completions_mode
from dflash_assets.orchestration.history import latest_metadata, plain_metadata
from dflash_assets.stages.completions.on_policy import table_file as on_policy_file
from dflash_assets.stages.completions.tables import partition_file
from dflash_assets.stages.drafter.run import DRAFTER_DIR, EXPORT_DIR
from dflash_assets.stages.evaluation.in_process import REPORT_DIR as EVALUATION_DIR
from dflash_assets.stages.prompts import CORPUS_FILE, REJECTED_FILE
from dflash_assets.stages.tokenized import tokenized_file

PK = "<pk>"
# File and folder names the asset modules write without exporting a constant (kept here, once).
TRUNCATION_REPORT = (truncation_asset.REPORT_DIR, "report.json")
TRUNCATION_PNG = (truncation_asset.REPORT_DIR, "completion_lengths.png")
EVALUATION_REPORT = (EVALUATION_DIR, "report.json")
EVALUATION_PNG = (EVALUATION_DIR, "acceptance.png")
LOSS_CURVE = (DRAFTER_DIR, "loss_curve.png")
TRAINING_RUNS = (DRAFTER_DIR, "runs")
SERVER_LOGS_DIR = "server_logs"
HIDDEN_STATES_DIR = "hidden_states"
UI_PORT = 3000


def _meta(instance: dg.DagsterInstance, key: str, pk: str) -> dict:
    return latest_metadata(instance, key, pk) or {}


def _unpartitioned(instance: dg.DagsterInstance, key: str) -> dict:
    return plain_metadata(instance.get_latest_materialization_event(dg.AssetKey(key))) or {}


def collect_summary(instance: dg.DagsterInstance, keys: list[str], storage=None, ran: list[str] | None = None) -> dict:
    """Numbers a user checks after a run, each taken from an asset's metadata (never recomputed), and
    where every output is.

    Partitioned stages (completions, tokenized_sequences, hidden_states) are summed over ``keys`` using
    only the latest materialization of each partition, so a partition materialized again counts once.

    Args:
        instance: the Dagster instance holding the materializations.
        keys: partition keys to sum over (the ``prompt_ranges`` dynamic partitions).
        storage: a :class:`~dflash_assets.stages.resources.storage.StorageResource`; None = the project's
            configured one (``definitions.defs``).
        ran: the steps this command materialized (``run_all``'s list); when given, a drafter or evaluation
            not among them is reported as reused (nothing changed), not as work of this run.

    Returns:
        A dict of plain values: counts (rows, tokens), ``hidden_state_bytes`` (bytes), ``truncation_rate``
        (share 0..1), ``cap`` (tokens), ``cap_advice`` (Markdown), ``tau`` (tokens per target forward),
        ``materialized`` (asset name -> bool), ``failed_checks`` (see :func:`failed_checks`), ``outputs``
        (see :func:`output_locations`), ``ui_command``.
    """
    corpus = _unpartitioned(instance, "prompt_corpus")
    finish: Counter = Counter()
    comp_rows = comp_errors = ids_missing = too_long = tok_rows = loss_tokens = hs_bytes = hs_tokens = 0
    seen = {"completions": False, "tokenized_sequences": False, "hidden_states": False}
    for pk in keys:
        c = _meta(instance, "completions", pk)
        finish.update(c.get("finish_reasons", {}))
        comp_rows += c.get("rows", 0)
        comp_errors += c.get("errors", 0)
        ids_missing += c.get("output_ids_missing", 0)  # 0 for a partition committed before it was counted
        too_long += c.get("prompt_too_long", 0)
        t = _meta(instance, "tokenized_sequences", pk)
        tok_rows += t.get("rows", 0)
        loss_tokens += t.get("loss_tokens", 0)
        h = _meta(instance, "hidden_states", pk)
        hs_bytes += h.get("bytes", 0) or 0
        hs_tokens += h.get("tokens", 0) or 0
        for name, meta in (("completions", c), ("tokenized_sequences", t), ("hidden_states", h)):
            seen[name] = seen[name] or bool(meta)
    report = _unpartitioned(instance, "truncation_report")
    drafter = _unpartitioned(instance, "dflash_drafter")
    evaluation = _unpartitioned(instance, "drafter_evaluation")
    materialized = {
        "prompt_corpus": bool(corpus),
        **seen,
        "truncation_report": bool(report),
        "dflash_drafter": bool(drafter),
        "drafter_evaluation": bool(evaluation),
    }
    if storage is None:
        from dflash_assets.definitions import defs

        storage = defs.resources["storage"]
    return {
        "prompts": corpus.get("num_prompts"),
        "duplicates": corpus.get("duplicates"),
        "rejected": corpus.get("rejected"),
        # what the corpus's last build changed (stable indices: unchanged prompts kept their rows)
        "prompts_edit": {k: corpus[f"prompts_{k}"] for k in ("new", "changed", "removed") if f"prompts_{k}" in corpus},
        "partitions": len(keys),
        "partition_keys": list(keys),
        "completions": comp_rows,
        "completion_errors": comp_errors,
        "completions_without_ids": ids_missing,
        "prompt_too_long": too_long,  # set aside as too long for the servers' context, never sent
        "finish_reasons": dict(sorted(finish.items())),
        "truncation_rate": report.get("truncation_rate"),
        "rows_per_turn_kind": report.get("rows_per_turn_kind") or {},
        "truncation_rate_per_turn_kind": report.get("truncation_rate_per_turn_kind") or {},
        "cap": report.get("cap"),
        "cap_advice": report.get("cap_advice"),
        "tokenized_rows": tok_rows,
        "loss_tokens": loss_tokens,
        "hidden_state_bytes": hs_bytes,
        "hidden_state_tokens": hs_tokens,
        "drafter_parameters": drafter.get("parameters"),
        "drafter_train_tokens": drafter.get("train_tokens"),
        "drafter_steps": drafter.get("steps"),
        "drafter_outcome": drafter.get("outcome"),
        "drafter_outcome_text": drafter.get("outcome_text"),
        "drafter_ran": None if ran is None or not drafter else "dflash_drafter" in ran,
        **_feature_figures(instance, keys, drafter),
        "tau": evaluation.get("tau"),
        "tau_untrained": evaluation.get("tau_untrained"),
        "tau_stderr": evaluation.get("tau_stderr"),
        "tau_untrained_stderr": evaluation.get("tau_untrained_stderr"),
        "tau_pooled": evaluation.get("tau_pooled"),
        "tau_pooled_stderr": evaluation.get("tau_pooled_stderr"),
        "tau_by_dataset": evaluation.get("tau_by_dataset"),
        "tool_call_turns": evaluation.get("tool_call_turns"),
        "speedup": evaluation.get("speedup_wall"),
        "evaluation_outcome": evaluation.get("outcome"),
        "evaluation_ran": None if ran is None or not evaluation else "drafter_evaluation" in ran,
        "eval_prompts": evaluation.get("num_prompts"),
        "lossless": evaluation.get("lossless"),
        **{k: evaluation.get(k) for k in ENGINE_KEYS},
        "materialized": materialized,
        "failed_checks": failed_checks(instance, keys),
        "outputs": output_locations(storage, keys),
        "ui_command": ui_command(instance),
    }


def failed_checks(instance: dg.DagsterInstance, keys: list[str], check_keys=None) -> list[dict]:
    """Asset checks whose evaluation on the current materialization failed, any severity, one entry per check.

    Read from the instance's check executions, never from a log. A partitioned asset's check counts
    once per partition of ``keys``: the evaluation that targeted that partition's latest materialization
    (the project's check specs carry no partitions of their own, so the partition comes from the
    targeted materialization); an unpartitioned asset's check counts its latest evaluation. A blocking check
    (:mod:`~dflash_assets.orchestration.check_gate`) with no evaluation of a partition's latest materialization (it
    raised) counts as failed there, its description naming the error.

    Args:
        check_keys: the :class:`dagster.AssetCheckKey` s to look at; None = every check of the project.

    Returns:
        ``[{"check": "asset.check_name", "severity": "WARN"|"ERROR", "failed": n, "evaluated": m,
        "partitions": [pk, ...] (failed ones, in key order; empty for an unpartitioned asset),
        "description": the first failure's description, then ``not evaluated on <pk>: <why>`` when one was not,
        or None}]``, sorted by check name.
    """
    # private module: dagster 1.13 exports no public AssetCheckExecutionRecordStatus
    from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus

    if check_keys is None:
        from dflash_assets.definitions import defs

        check_keys = defs.resolve_asset_graph().asset_check_keys
    done = (AssetCheckExecutionRecordStatus.SUCCEEDED, AssetCheckExecutionRecordStatus.FAILED)
    targets: dict[dg.AssetKey, dict[int, str]] = {}  # asset -> latest materialization storage id -> partition
    out = []
    for ck in sorted(check_keys, key=lambda k: k.to_user_string()):
        if ck.asset_key not in targets:
            targets[ck.asset_key] = {}
            for pk in keys:
                rec = instance.fetch_materializations(
                    dg.AssetRecordsFilter(asset_key=ck.asset_key, asset_partitions=[pk]), limit=1
                ).records
                if rec:
                    targets[ck.asset_key][rec[0].storage_id] = pk
        wanted = targets[ck.asset_key]
        found: dict[str | None, object] = {}  # partition (None: unpartitioned) -> latest evaluation
        cursor = None
        while True:
            page = instance.event_log_storage.get_asset_check_execution_history(ck, limit=1000, cursor=cursor)
            for record in page:
                evaluation = (
                    record.event.dagster_event.event_specific_data
                    if record.event and record.event.dagster_event
                    else None
                )
                if record.status not in done or evaluation is None:
                    continue
                target = getattr(evaluation, "target_materialization_data", None)
                pk = record.partition or (wanted.get(target.storage_id) if target is not None else None)
                if pk is None and wanted:
                    continue  # an evaluation of an older materialization of a partitioned asset
                found.setdefault(pk, (record, evaluation))
            if len(page) < 1000 or (wanted and set(wanted.values()) <= set(found)) or (not wanted and None in found):
                break
            cursor = page[-1].id
        evaluated = [(pk, r, e) for pk, (r, e) in found.items() if pk is None or pk in set(keys)]
        failed = [(pk, r, e) for pk, r, e in evaluated if r.status == AssetCheckExecutionRecordStatus.FAILED]
        # a blocking check with no evaluation of the latest materialization (it raised) counts as failed
        blocking = ck.name in BLOCKING_CHECKS.get(ck.asset_key.to_user_string(), ())
        unevaluated = {i: pk for i, pk in wanted.items() if pk not in found} if blocking else {}
        whys = why_unevaluated(instance, ck.asset_key.to_user_string(), unevaluated)
        evaluated += [(pk, None, None) for pk in whys]
        failed += [(pk, None, None) for pk in whys]
        if not failed:
            continue
        order = {pk: i for i, pk in enumerate(keys)}
        failed.sort(key=lambda t: order.get(t[0], -1))
        severities = {getattr(getattr(e, "severity", None), "value", "ERROR") for _, _, e in failed}
        described = [e.description for _, _, e in failed if getattr(e, "description", None)][:1]
        described += [f"not evaluated on {pk}: {why}" for pk, why in list(whys.items())[:1]]
        out.append(
            {
                "check": f"{ck.asset_key.to_user_string()}.{ck.name}",
                "severity": "ERROR" if "ERROR" in severities else severities.pop(),
                "failed": len(failed),
                "evaluated": len(evaluated),
                "partitions": [pk for pk, _, _ in failed if pk is not None],
                "description": "; ".join(described) or None,
            }
        )
    return out


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


def _feature_figures(instance: dg.DagsterInstance, keys: list[str], drafter: dict) -> dict:
    """The drafter's feature source (offline / online), its target forwards, and the latest storage plan."""
    plan = None
    for pk in reversed(keys):
        plan = _meta(instance, "hidden_states", pk).get("storage_plan_text")
        if plan:  # its figures are those of that moment ("already stored" excludes what came after)
            plan = f"{plan} (planned before extracting {pk})"
            break
    return {
        "features": drafter.get("features"),
        "target_forwards": drafter.get("target_forwards"),
        "offline_subset": drafter.get("offline_subset") or {},
        "storage_plan": plan,
    }


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


def output_locations(storage, keys: list[str]) -> list[tuple[str, str, str]]:
    """``(label, location, asset)`` for every file or folder the pipeline writes, in pipeline order.

    Locations are absolute paths or ``s3://`` URIs from the storage root and the asset modules' layout;
    in-flight files (server logs, training runs) live in local scratch, which is the storage root itself
    for local storage. ``<pk>`` stands for a partition key unless ``keys`` holds exactly one.
    Labels starting with spaces belong to the entry above them.
    """
    store = storage.open()
    completions_file = on_policy_file if completions_mode() == "on_policy" else partition_file
    scratch = storage.local_scratch()  # the scratch root (no file is created in it)
    pk = keys[0] if len(keys) == 1 else PK

    def at(*parts: str) -> str:
        return store.uri(*parts)

    def folder(location: str) -> str:
        return location.rstrip("/") + "/"

    return [
        ("prompt corpus", at(*CORPUS_FILE), "prompt_corpus"),
        ("  rows set aside", at(*REJECTED_FILE), "prompt_corpus"),
        ("completions", at(*completions_file(pk)), "completions"),
        ("  server logs", folder(os.path.join(scratch, SERVER_LOGS_DIR, pk)), "completions"),
        ("truncation report", at(*TRUNCATION_REPORT), "truncation_report"),
        ("  length plot", at(*TRUNCATION_PNG), "truncation_report"),
        ("tokenized", at(*tokenized_file(pk)), "tokenized_sequences"),
        ("  rows set aside", at(tokenized_file(pk)[0], f"{pk}.set_aside.parquet"), "tokenized_sequences"),
        (
            "hidden states",
            folder(at(HIDDEN_STATES_DIR, pk))
            + f"  ({SHARD_PATTERN.format(0).replace('00000', 'NNNNN')}, {INDEX_NAME})",
            "hidden_states",
        ),
        (
            "drafter export",
            folder(at(*EXPORT_DIR)) + "  (config.json + model.safetensors for SGLang)",
            "dflash_drafter",
        ),
        ("  loss curve", at(*LOSS_CURVE), "dflash_drafter"),
        ("  training runs", folder(os.path.join(scratch, *TRAINING_RUNS)), "dflash_drafter"),
        ("evaluation", at(*EVALUATION_REPORT), "drafter_evaluation"),
        ("  acceptance plot", at(*EVALUATION_PNG), "drafter_evaluation"),
    ]


def ui_command(instance: dg.DagsterInstance) -> str:
    """The shell line that opens the Dagster UI on this instance (the README's ``dagster dev`` command)."""
    home = getattr(instance, "root_directory", None) or os.environ.get("DAGSTER_HOME") or "."
    exe = Path(sys.executable).parent / "dagster"
    if exe.exists():
        try:
            dagster = os.path.relpath(exe) if exe.absolute().is_relative_to(Path.cwd()) else str(exe)
        except ValueError:
            dagster = str(exe)
    else:
        dagster = "dagster"
    return f"DAGSTER_HOME={home} {dagster} dev -h 127.0.0.1 -p {UI_PORT}"


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
        text = (
            f"reused because nothing changed ({s.get('drafter_steps')} steps on "
            f"{s.get('drafter_train_tokens')} tokens, "
            "no training step this run)"
        )
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
        f"tokenized          {s['tokenized_rows']} rows, {s['loss_tokens']} loss tokens",
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
