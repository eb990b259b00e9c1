"""One evaluation's decoding and its outcome: on the serving engine and in this process, as the report's
sections and the materialization's metadata."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import dagster as dg

from dflash_assets.generation.rows.records import holds_tool_call
from dflash_assets.generation.servers.origin import UNKNOWN, text_sha256
from dflash_assets.stages.drafter.run import EXPORT_DIR
from dflash_assets.stages.evaluation.baseline import (
    CHECK_BASELINE,
    baseline_check,
    compare_methods,
    comparison_table,
    context_bucket,
    ngram_lossless,
)
from dflash_assets.stages.evaluation.datasets import HELDOUT
from dflash_assets.stages.evaluation.engine import engine_metadata, run_engine
from dflash_assets.stages.evaluation.in_process import in_process_evaluation
from dflash_assets.stages.evaluation.parity import (
    CHECK_LOSSLESS,
    CHECK_PARITY,
    engine_parity,
    lossless_summary,
    parity_table,
    template_vs_trained,
)
from dflash_assets.stages.evaluation.tool_turns import tool_call_turns, tool_turn_line
from dflash_assets.stages.evaluation.vllm_run import VLLMPlan, run_vllm

WARN_CHECKS = (CHECK_BASELINE,)  # advisory: a drafter that loses to n-gram lookup is still a valid drafter


def run_evaluation(
    log,
    config,
    plan,
    inference,
    storage,
    store,
    target_model,
    export_dir: str,
    train_meta: dict,
    rows_only,
    prompts,
    eos: list[int],
    held: list[int],
    export_sha: str,
    last_roles: dict[str, list[str]] | None = None,
) -> tuple[dict, dict, dict | None]:
    """Decode ``prompts`` on the engine when ``plan`` is set (first: its servers need the GPUs the in-process
    target would hold), then in this process when ``config.in_process``.

    Returns:
        ``(report.json's content, metadata, the engine section or None)``.

    Raises:
        dagster.Failure: see :func:`~dflash_assets.stages.evaluation.engine.run_engine`.
    """
    report: dict = {
        "heldout_prompt_indexes": held[: config.num_prompts],
        "prompt_input_ids": prompts,  # what every decoder was given, per dataset (template applied)
        "eos_token_ids": list(eos),
        "drafter_export": store.uri(*EXPORT_DIR),
        "drafter_sha256": export_sha,
        "max_new_tokens": config.max_new_tokens,
    }
    metadata: dict = {}
    engine_section = None
    log_dir = storage.local_scratch("server_logs", "drafter_evaluation")
    if isinstance(plan, VLLMPlan):
        engine_section = run_vllm(plan, prompts, config.max_new_tokens, eos, log_dir, config, inference.api_key, log)
        report["engine"] = engine_section
    elif plan is not None:
        engine_section = run_engine(plan, inference, prompts, config.max_new_tokens, eos, log_dir, config, log)
        report["engine"] = engine_section
    comparison = compare_methods(None, engine_section)  # the engine's figures, for the plot's per-position panel
    if config.in_process:
        online = train_meta.get("features", "offline") == "online"
        parts = in_process_evaluation(
            log,
            config,
            store,
            target_model,
            export_dir,
            train_meta,
            prompts,
            eos,
            rows_only,
            online=online,
            engine_positions=_engine_positions(comparison.get(HELDOUT)),
            engine_section=engine_section,
        )
        report.update(parts["report"])
        metadata.update(parts["metadata"])
    if engine_section is not None:
        metadata.update(engine_metadata(engine_section, metadata.get("tau_by_dataset")))
        head = engine_section["datasets"][HELDOUT]
        tau = "-" if head.get("tau") is None else f"{head['tau']:.3f}"
        log.info(f"engine ({engine_section['label']}): heldout tau {tau} over {head['requests_measured']} requests")
    decode = target_model.load_tokenizer().decode
    groups = prompt_groups(prompts, last_roles or {}, engine_section, decode)
    comparison = compare_methods(report.get("datasets"), engine_section, groups)
    report["tokens_per_forward"] = comparison
    if report.get("datasets"):
        turns = tool_call_turns(report, target_model.load_tokenizer().decode)
        report["tool_call_turns"] = metadata["tool_call_turns"] = turns
        for name, groups in turns.items():
            log.info(tool_turn_line(name, groups, _engine_name(engine_section)))
    metadata.update(baseline_metadata(comparison))
    for line in (c["verdict"] for c in comparison.values() if c.get("verdict")):
        log.info(f"baseline: {line}")
    rendered = text_sha256(target_model.load_tokenizer().chat_template)
    checks = evaluation_checks(report, engine_section, train_meta, export_dir, config.in_process, decode, rendered)
    checks[CHECK_BASELINE] = baseline_check(comparison, _why_no_baseline(config, engine_section))
    if checks[CHECK_BASELINE].get("why"):
        metadata["ngram_baseline_not_compared"] = checks[CHECK_BASELINE]["why"]
    report["checks"] = checks
    metadata["checks"] = checks
    if checks[CHECK_PARITY].get("by_dataset"):
        metadata["engine_parity"] = dg.MetadataValue.md(
            parity_table(checks[CHECK_PARITY], _engine_name(engine_section))
        )
        rows = checks[CHECK_PARITY]["by_dataset"].values()
        metadata["engine_parity_steps"] = sum(d["steps_compared"] for d in rows)
        metadata["engine_parity_mismatches"] = sum(d["mismatches"] for d in rows)
        metadata["engine_parity_ties"] = sum(d["ties"] for d in rows)
    log_failed_checks(log, checks)
    return report, metadata, engine_section


def prompt_groups(
    prompts: dict[str, list[list[int]]], last_roles: dict[str, list[str]], engine_section: dict | None, decode
) -> dict[tuple[str, int], dict[str, str]]:
    """Each prompt's groups for the splits of the comparison: ``turn kind`` (``tool call`` when the greedy output,
    the engine's, calls a tool; ``answer after tools`` when the context ends with a tool result; else ``plain``)
    and ``context tokens`` (:func:`~dflash_assets.stages.evaluation.baseline.context_bucket`)."""
    outputs = {
        (r["dataset"], r["position"]): r["output_ids"]
        for r in (engine_section or {}).get("requests") or []
        if "error" not in r and r.get("output_ids") is not None
    }
    out = {}
    for name, rows in prompts.items():
        roles = last_roles.get(name) or []
        for i, ids in enumerate(rows):
            output = outputs.get((name, i))
            if output is not None and holds_tool_call(decode(list(output))):
                kind = "tool call"
            elif i < len(roles) and roles[i] == "tool":
                kind = "answer after tools"
            else:
                kind = "plain"
            out[(name, i)] = {"turn kind": kind, "context tokens": context_bucket(len(ids))}
    return out


def log_failed_checks(log, checks: dict[str, dict]) -> None:
    """One run-log line per failed check (``checks``: name -> {"passed", "reasons"}), at the check's own severity:
    warning for :data:`WARN_CHECKS` (the n-gram comparison is advisory), error for the others."""
    for name, outcome in checks.items():
        if not outcome["passed"]:
            (log.warning if name in WARN_CHECKS else log.error)(
                f"check {name} failed: " + " | ".join(outcome["reasons"])
            )


def _engine_positions(row: dict | None) -> dict[str, list[float]]:
    """Acceptance per draft position per decode step of the engine's methods on one dataset, by plot label."""
    out = {}
    for key, label in (("drafter_engine", "DFlash (engine)"), ("ngram", "n-gram lookup (engine)")):
        figures = (row or {}).get(key) or {}
        if figures.get("accepted_per_decode_step"):
            out[label] = figures["accepted_per_decode_step"]
    return out


def _why_no_baseline(config, engine_section: dict | None) -> str | None:
    if not config.ngram_baseline:
        return "ngram_baseline: false"
    if engine_section is None:
        return "no engine run (engine: none): the n-gram baseline is measured on the engine"
    if engine_section.get("kind") != "vllm":
        return f"engine {engine_section.get('kind')}: the NGRAM flags are recorded, not run (untested on a GPU)"
    return None


def baseline_metadata(comparison: dict) -> dict:
    """Metadata of :func:`~dflash_assets.stages.evaluation.baseline.compare_methods`'s result: the held-out
    dataset's figures under flat keys (``ngram_tokens_per_forward``, ``drafter_tokens_per_forward``, ...,
    ``baseline_verdict``), every dataset's in ``tokens_per_forward_by_dataset`` and a Markdown table."""
    if not comparison:
        return {}
    head = comparison.get(HELDOUT) or next(iter(comparison.values()))

    def value(key: str, field: str = "tokens_per_forward"):
        x = (head.get(key) or {}).get(field)
        return None if x is None else round(float(x), 4)

    return {
        "plain_tokens_per_forward": 1.0,
        "ngram_tokens_per_forward": value("ngram"),
        "ngram_tokens_per_forward_stderr": value("ngram", "tokens_per_forward_stderr"),
        "drafter_tokens_per_forward": None if head.get("drafter") is None else round(head["drafter"], 4),
        "drafter_tokens_per_forward_source": head.get("drafter_source"),
        "drafter_engine_tokens_per_forward": value("drafter_engine"),
        "drafter_in_process_tokens_per_forward": value("drafter_in_process"),
        "baseline_winner": head.get("winner"),
        "baseline_verdict": head.get("verdict"),
        "tokens_per_forward_by_dataset": {
            name: {
                "plain": 1.0,
                "ngram": (c.get("ngram") or {}).get("tokens_per_forward"),
                "drafter_engine": (c.get("drafter_engine") or {}).get("tokens_per_forward"),
                "drafter_in_process": (c.get("drafter_in_process") or {}).get("tokens_per_forward"),
                **_paired_keys(c.get("paired")),
                "winner": c.get("winner"),
                "verdict": c.get("verdict"),
            }
            for name, c in comparison.items()
        },
        "baseline_statistic": head.get("statistic"),
        "tokens_per_forward_table": dg.MetadataValue.md(comparison_table(comparison)),
    }


def _paired_keys(paired: dict | None) -> dict:
    """The verdict's statistic of one dataset, rounded: ``ratio`` (DFlash / n-gram, pooled), ``ratio_stderr``
    (paired), ``prompts`` (measured by both)."""
    p = paired or {}
    rounded = {k: None if p.get(k) is None else round(float(p[k]), 4) for k in ("ratio", "ratio_stderr")}
    return {**rounded, "prompts": p.get("prompts")}


def _engine_name(section: dict | None) -> str:
    return {"vllm": "vLLM"}.get((section or {}).get("kind", ""), "SGLang")


def evaluation_checks(
    report: dict,
    engine_section: dict | None,
    train_meta: dict,
    export_dir: str,
    in_process: bool,
    decode=None,
    rendered_template: str = UNKNOWN,
) -> dict[str, dict]:
    """The outcome of the ``lossless`` and ``engine_parity`` checks: ``{name: {"passed", "reasons", ...}}``.

    Parity is compared for a real vLLM engine beside an in-process run; otherwise it says why it was not
    (``compared: False``): a simulated engine's figures are not a measurement, and SGLang's per-request figures
    count the prefill token differently. Whatever the engine, parity fails when ``rendered_template`` (SHA-256 of
    the template the prompts were rendered with) is not among the drafter's rows' templates
    (:func:`~dflash_assets.stages.evaluation.parity.template_vs_trained`)."""
    local = report.get("datasets") or {}
    parity: dict = {"passed": True, "reasons": [], "compared": False}
    if engine_section is None:
        parity["why"] = "no engine run (engine: none)"
    elif not in_process:
        parity["why"] = "no in-process run to compare with (in_process: false)"
    elif engine_section["kind"] != "vllm":
        parity["why"] = f"engine {engine_section['kind']}: parity is compared for engine: vllm"
    else:
        export_config = json.loads((Path(export_dir) / "config.json").read_text())
        parity = {**engine_parity(engine_section, local, train_meta, export_config, decode=decode), "compared": True}
    template = template_vs_trained(train_meta.get("template_sha256"), rendered_template)
    if template:  # a precondition of parity: the rows and the prompts rendered alike
        parity = {**parity, "passed": False, "reasons": [*template, *parity["reasons"]]}
    lossless = lossless_summary(local, parity if parity["compared"] else None)
    others = {m: ((engine_section or {}).get(m) or {}).get("requests") or [] for m in ("ngram", "plain")}
    if any(others.values()):  # every method decodes greedily: the same output as the drafter's
        expected = {n: (d.get("trained") or {}).get("plain_output_ids") or [] for n, d in local.items()}
        if not expected:  # no in-process run: the drafter's engine output
            expected = _engine_outputs(engine_section.get("requests") or [])
        for method, records in others.items():
            extra = ngram_lossless(records, expected, method) if records else []
            lossless = {"passed": lossless["passed"] and not extra, "reasons": lossless["reasons"] + extra}
    return {CHECK_LOSSLESS: lossless, CHECK_PARITY: parity}


def _engine_outputs(records: list[dict]) -> dict[str, list[list[int]]]:
    out: dict[str, dict[int, list[int]]] = {}
    for r in records:
        if "error" not in r:
            out.setdefault(r["dataset"], {})[r["position"]] = r["output_ids"]
    return {n: [rows.get(i) for i in range(max(rows) + 1)] for n, rows in out.items()}


def check_results(checks: dict[str, dict]) -> list[dg.AssetCheckResult]:
    """Dagster check results for :func:`evaluation_checks`'s outcome (also for a reused evaluation's)."""
    out = []
    for name, outcome in checks.items():
        text = " | ".join(outcome["reasons"]) or outcome.get("why") or "passed"
        out.append(
            dg.AssetCheckResult(
                check_name=name,
                passed=bool(outcome["passed"]),
                severity=dg.AssetCheckSeverity.WARN if name in WARN_CHECKS else dg.AssetCheckSeverity.ERROR,
                description=text[:2000],
                metadata={"compared": outcome.get("compared", True), "reasons": text[:2000]},
            )
        )
    return out


def evaluated_metadata(
    config,
    plan,
    engine_section: dict | None,
    prompts: dict,
    export_sha: str,
    metadata: dict,
    block_size: int,
    fingerprint: str,
    wall_s: float,
) -> dict:
    """The materialization metadata of an evaluation that decoded (not reused)."""
    what = ([f"in process on {len(prompts)} dataset(s)"] if config.in_process else []) + (
        [f"on the {'SIMULATED ' if engine_section['simulated'] else ''}engine ({plan.kind})"] if engine_section else []
    )
    return {
        "outcome": "evaluated",
        "outcome_text": f"evaluated the drafter (export sha256 {export_sha[:12]}) " + " and ".join(what),
        **metadata,
        "block_size": block_size,
        "drafter_sha256": export_sha,
        "evaluation_fingerprint": fingerprint,
        "config_fingerprint": hashlib.sha256(
            json.dumps(config.model_dump(), sort_keys=True, default=str).encode()
        ).hexdigest()[:16],
        "wall_s": round(wall_s, 1),
    }
