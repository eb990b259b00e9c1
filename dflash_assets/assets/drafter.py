"""Stage 6: ``dflash_drafter``: train the DFlash drafter on every materialized hidden-state partition and export it.

The run's steps (identity, data, launcher, loss plot) are in :mod:`dflash_assets.stages.drafter`."""

import time

import dagster as dg

from dflash_assets.common.cost import device_cost
from dflash_assets.orchestration.check_gate import held_partitions
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.orchestration.pools import GPU_POOL
from dflash_assets.stages.drafter.config import DrafterConfig
from dflash_assets.stages.drafter.features import decide_mode
from dflash_assets.stages.drafter.identity import config_fingerprint, file_sha256
from dflash_assets.stages.drafter.launcher import TrainingRunError, check_process_layout
from dflash_assets.stages.drafter.loss_plot import loss_curve_of_run
from dflash_assets.stages.drafter.report import drafter_metadata, outcome_of
from dflash_assets.stages.drafter.run import (
    EXPORT_DIR,
    gather_training_data,
    plan_run,
    publish_export,
    train_run,
)
from dflash_assets.stages.drafter.settings import resolved_settings, train_config_for
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets.stages.stored_inputs import ShardIntegrityError


def config_changed_since_last(instance: dg.DagsterInstance, key: str, config: dg.Config) -> bool:
    """Whether ``config`` differs from the settings recorded (``config_fingerprint``) by the last
    materialization of asset ``key`` (False when there is none or it recorded none)."""
    event = instance.get_latest_materialization_event(dg.AssetKey(key))
    recorded = (
        event.asset_materialization.metadata.get("config_fingerprint")
        if event and event.asset_materialization
        else None
    )
    return recorded is not None and recorded.value != config_fingerprint(config)


@dg.asset(
    deps=["hidden_states", "tokenized_sequences"],  # offline reads the first, online only the second
    group_name="drafter",
    kinds={"pytorch", "safetensors"},
    owners=["team:dflash"],
    op_tags={"dflash/gpu": "train"},
    pool=GPU_POOL,
    description=(
        "Trains the DFlash drafter (fc + hidden_norm over 5 target layers, draft decoder layers, frozen target "
        "embedding "
        "and LM head) on the hidden-state shards of every complete partition, with a held-out split; checkpoints under "
        "`dflash_drafter/runs/<run id>/` (a rerun resumes); exports dflash_drafter/export/ (config.json with "
        "architectures [DFlashDraftModel], block_size, dflash_config; model.safetensors) for SGLang/vLLM."
    ),
)
def dflash_drafter(
    context: dg.AssetExecutionContext,
    config: DrafterConfig,
    storage: StorageResource,
    target_model: TargetModelResource,
) -> dg.MaterializeResult:
    keys = context.instance.get_dynamic_partitions(prompt_ranges.name)
    try:  # settings checked before any work; a bad process layout is an error even when the run would be reused
        if config.nproc > 1 or config.nnodes > 1:
            check_process_layout(config)
        layer_ids, _ = resolved_settings(config, target_model)
    except (TrainingRunError, ValueError) as exc:
        raise dg.Failure(str(exc)) from exc
    mode, mode_reason = decide_mode(context.instance, storage, target_model, config.features)

    def held_for(mode: str) -> dict[str, str]:  # launched from anywhere, never on rows a blocking check holds
        return held_partitions(context.instance, keys, ["tokenized_sequences"] if mode == "online" else None)

    try:
        data = gather_training_data(
            storage, target_model, keys, mode, mode_reason, config.features, layer_ids, context.log, held_for
        )
    except (TrainingRunError, ShardIntegrityError) as exc:
        raise dg.Failure(str(exc)) from exc
    plan = plan_run(storage, data.indexes, config_fingerprint(config), config.warm_start)
    try:
        cfg = train_config_for(
            config,
            target_model,
            mode=data.mode,
            shards=data.shards,
            tokenized=data.tokenized,
            out_dir=plan.run_dir,
            init_from=plan.init_from,
        )
    except ValueError as exc:
        raise dg.Failure(str(exc)) from exc
    started = time.monotonic()
    try:
        summary = train_run(plan, cfg, config, data, context.log)
    except TrainingRunError as exc:
        raise dg.Failure(str(exc), metadata=exc.metadata) from exc
    outcome = outcome_of(summary, plan.reused)
    context.log.info(f"drafter {outcome[1]} (run {plan.run_id})")
    wall = time.monotonic() - started
    png = loss_curve_of_run(plan.run_dir)
    store = storage.open()
    weights = publish_export(store, plan.export_dir, png)
    upstream = _upstream_metadata(context.instance, data)
    metadata = drafter_metadata(summary, plan, data, config, outcome, weights, png, wall, *upstream)
    trained = 0 if plan.reused else summary["train_tokens"]  # a reused run cost nothing now
    metadata.update(device_cost(target_model.device, 0.0 if plan.reused else wall, trained, 0, summary["world_size"]))
    # same weights, same version: the evaluation reuses its report
    return dg.MaterializeResult(
        metadata={**metadata, "export_path": dg.MetadataValue.path(store.uri(*EXPORT_DIR))},
        data_version=dg.DataVersion(file_sha256(weights)[:20]),  # streamed: GBs of weights
    )


def _upstream_metadata(instance: dg.DagsterInstance, data) -> tuple[dict, list[str]]:
    """What the drafter records of the partitions it trained on: the offline subset (``{}`` online) and the
    chat templates of their rows."""
    subset = _offline_subset(instance, data.used) if data.mode == "offline" else {}
    return subset, _templates_trained_on(instance, data.used)


def _templates_trained_on(instance: dg.DagsterInstance, used: list[str]) -> list[str]:
    """The chat templates (SHA-256 hex) of the tokenized rows of partitions ``used``, from their latest
    materializations' ``rows_by_template``; ``[]`` when none recorded one (tokenized before it was counted)."""
    from dflash_assets.orchestration.history import latest_metadata_by_partition

    seen = latest_metadata_by_partition(instance, "tokenized_sequences", used).values()
    return sorted({sha for meta in seen for sha in (meta.get("rows_by_template") or {})})


def _offline_subset(instance: dg.DagsterInstance, used: list[str]) -> dict:
    """Subset setting and rows stored by the hidden_states partitions trained on (their latest metadata)."""
    from dflash_assets.orchestration.history import latest_metadata

    stored = total = 0
    subset: dict = {}
    for pk in used:
        meta = latest_metadata(instance, "hidden_states", pk) or {}
        stored += int(meta.get("rows") or 0)
        total += int(meta.get("rows_in_partition") or meta.get("rows") or 0)
        subset = meta.get("subset") or subset
    return {**subset, "rows_stored": stored, "rows_tokenized": total}


__all__ = ["config_changed_since_last", "dflash_drafter"]
