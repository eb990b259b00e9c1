"""One evaluation's decoding and its outcome: on the serving engine and in this process, as the report's
sections and the materialization's metadata."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import dagster as dg

from dflash_assets.stages.drafter.run import EXPORT_DIR
from dflash_assets.stages.evaluation.datasets import HELDOUT
from dflash_assets.stages.evaluation.engine import engine_metadata, run_engine
from dflash_assets.stages.evaluation.in_process import in_process_evaluation
from dflash_assets.stages.evaluation.parity import (
    CHECK_LOSSLESS,
    CHECK_PARITY,
    engine_parity,
    lossless_summary,
    parity_table,
)
from dflash_assets.stages.evaluation.vllm_run import VLLMPlan, run_vllm


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
    if config.in_process:
        online = train_meta.get("features", "offline") == "online"
        parts = in_process_evaluation(
            log, config, store, target_model, export_dir, train_meta, prompts, eos, rows_only, online=online
        )
        report.update(parts["report"])
        metadata.update(parts["metadata"])
    if engine_section is not None:
        metadata.update(engine_metadata(engine_section, metadata.get("tau_by_dataset")))
        head = engine_section["datasets"][HELDOUT]
        tau = "-" if head.get("tau") is None else f"{head['tau']:.3f}"
        log.info(f"engine ({engine_section['label']}): heldout tau {tau} over {head['requests_measured']} requests")
    checks = evaluation_checks(report, engine_section, train_meta, export_dir, config.in_process)
    report["checks"] = checks
    metadata["checks"] = checks
    if checks[CHECK_PARITY].get("by_dataset"):
        metadata["engine_parity"] = dg.MetadataValue.md(
            parity_table(checks[CHECK_PARITY], _engine_name(engine_section))
        )
        metadata["engine_parity_max_difference"] = max(
            (abs(d["difference"]) for d in checks[CHECK_PARITY]["by_dataset"].values() if d["difference"] is not None),
            default=None,
        )
    for name, outcome in checks.items():
        if not outcome["passed"]:
            log.error(f"check {name} failed: " + " | ".join(outcome["reasons"]))
    return report, metadata, engine_section


def _engine_name(section: dict | None) -> str:
    return {"vllm": "vLLM"}.get((section or {}).get("kind", ""), "SGLang")


def evaluation_checks(
    report: dict, engine_section: dict | None, train_meta: dict, export_dir: str, in_process: bool
) -> dict[str, dict]:
    """The outcome of the ``lossless`` and ``engine_parity`` checks: ``{name: {"passed", "reasons", ...}}``.

    Parity is compared for a real vLLM engine beside an in-process run; otherwise it says why it was not
    (``compared: False``): a simulated engine's figures are not a measurement, and SGLang's per-request figures
    count the prefill token differently."""
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
        parity = {**engine_parity(engine_section, local, train_meta, export_config), "compared": True}
    lossless = lossless_summary(local, parity if parity["compared"] else None)
    return {CHECK_LOSSLESS: lossless, CHECK_PARITY: parity}


def check_results(checks: dict[str, dict]) -> list[dg.AssetCheckResult]:
    """Dagster check results for :func:`evaluation_checks`'s outcome (also for a reused evaluation's)."""
    out = []
    for name, outcome in checks.items():
        text = " | ".join(outcome["reasons"]) or outcome.get("why") or "passed"
        out.append(
            dg.AssetCheckResult(
                check_name=name,
                passed=bool(outcome["passed"]),
                severity=dg.AssetCheckSeverity.ERROR,
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
