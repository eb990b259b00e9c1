"""The end-of-run summary, read back from the assets' latest materialization metadata.

:func:`collect_summary` gathers the numbers (never recomputed from the data: each is an asset's metadata,
summed over partitions where the asset is partitioned, one latest materialization per partition) and
where every output lives; :func:`~dflash_assets.app.summary_lines.format_summary` makes them lines.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import dagster as dg

from dflash_assets.assets import truncation as truncation_asset
from dflash_assets.common.config import completions_mode
from dflash_assets.dflash.shards.format import INDEX_NAME, SHARD_PATTERN
from dflash_assets.orchestration.check_gate import BLOCKING_CHECKS, why_unevaluated
from dflash_assets.orchestration.history import latest_metadata, plain_metadata
from dflash_assets.stages.completions.on_policy import table_file as on_policy_file
from dflash_assets.stages.completions.tables import partition_file
from dflash_assets.stages.drafter.run import DRAFTER_DIR, EXPORT_DIR
from dflash_assets.stages.evaluation.in_process import REPORT_DIR as EVALUATION_DIR
from dflash_assets.stages.prompts import CORPUS_FILE, REJECTED_FILE
from dflash_assets.stages.tokenized import tokenized_file

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
    sums, seen = _partition_sums(instance, keys)
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
        "completions": sums["rows"],
        "completion_errors": sums["errors"],
        "completions_without_ids": sums["output_ids_missing"],
        "prompt_too_long": sums["prompt_too_long"],  # set aside as too long for the servers' context, never sent
        "finish_reasons": dict(sorted(sums["finish"].items())),
        "truncation_rate": report.get("truncation_rate"),
        "rows_per_turn_kind": report.get("rows_per_turn_kind") or {},
        "truncation_rate_per_turn_kind": report.get("truncation_rate_per_turn_kind") or {},
        "cap": report.get("cap"),
        "cap_advice": report.get("cap_advice"),
        "tokenized_rows": sums["tokenized_rows"],
        **_token_origin(instance, keys),
        "loss_tokens": sums["loss_tokens"],
        "hidden_state_bytes": sums["hidden_state_bytes"],
        "hidden_state_tokens": sums["hidden_state_tokens"],
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


def _partition_sums(instance: dg.DagsterInstance, keys: list[str]) -> tuple[dict, dict[str, bool]]:
    """The partitioned stages' figures summed over ``keys`` (latest materialization of each partition), and
    which of those stages has any materialization."""
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
    sums = {
        "finish": finish,
        "rows": comp_rows,
        "errors": comp_errors,
        "output_ids_missing": ids_missing,
        "prompt_too_long": too_long,
        "tokenized_rows": tok_rows,
        "loss_tokens": loss_tokens,
        "hidden_state_bytes": hs_bytes,
        "hidden_state_tokens": hs_tokens,
    }
    return sums, seen


def _token_origin(instance: dg.DagsterInstance, keys: list[str]) -> dict:
    """From each partition's latest completions and tokenized_sequences metadata: tokenized rows by ids source
    (``tokenized_by_ids_source``; a partition tokenized before they were counted: ``unknown``), how many renderings
    differ from the server's prompt ids (``prompt_ids_differ``), and what the servers said of the seed
    (``seed_honoured``: the distinct values of the completions' ``seed_honoured``, absent when no seed was set)."""
    sources: Counter = Counter()
    differ, seeds = 0, set()
    for pk in keys:
        completions, tokenized = _meta(instance, "completions", pk), _meta(instance, "tokenized_sequences", pk)
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
