"""One evaluation's decoding and its outcome: on the serving engine and in this process, as the report's
sections and the materialization's metadata."""

from __future__ import annotations

import hashlib
import json

from dflash_assets.evaluation.datasets import HELDOUT
from dflash_assets.evaluation.engine import engine_metadata, run_engine
from dflash_assets.evaluation.in_process import in_process_evaluation
from dflash_assets.training.run import EXPORT_DIR


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
        dagster.Failure: see :func:`~dflash_assets.evaluation.engine.run_engine`.
    """
    report: dict = {
        "heldout_prompt_indexes": held[: config.num_prompts],
        "drafter_export": store.uri(*EXPORT_DIR),
        "drafter_sha256": export_sha,
        "max_new_tokens": config.max_new_tokens,
    }
    metadata: dict = {}
    engine_section = None
    if plan is not None:
        engine_section = run_engine(
            plan,
            inference,
            prompts,
            config.max_new_tokens,
            eos,
            storage.local_scratch("server_logs", "drafter_evaluation"),
            config,
            log,
        )
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
        log.info(
            f"engine ({engine_section['label']}): heldout tau {head['tau']:.3f} over "
            f"{head['requests_measured']} requests"
        )
    return report, metadata, engine_section


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
