"""Stage 5: ``hidden_states[pk]``: target-layer features for every tokenized sequence, sharded, resumable."""

import dagster as dg

from dflash_assets.common.cost import device_cost
from dflash_assets.orchestration.check_gate import CHECK_FINITE, CHECK_IDS
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.orchestration.pools import GPU_POOL
from dflash_assets.orchestration.runs import partition_busy_message, runs_holding_partitions
from dflash_assets.stages.hidden_states import (
    HiddenStatesConfig,
    HiddenStatesError,
    check_shards,
    extract_stage,
    layer_ids_or_error,
)
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets.stages.storage_plan import StoragePlan, storage_plan
from dflash_assets.stages.tokenized import tokenized_file


def resolve_layer_ids(config_ids: list[int], target) -> list[int]:
    """:func:`~dflash_assets.stages.hidden_states.layer_ids_or_error` for the asset.

    Raises:
        dagster.Failure: an id outside ``0 .. L-1``, naming ``ops.hidden_states.config.target_layer_ids``.
    """
    try:
        return layer_ids_or_error(config_ids, target)
    except HiddenStatesError as exc:
        raise dg.Failure(str(exc)) from exc


@dg.asset(
    partitions_def=prompt_ranges,
    deps=["tokenized_sequences"],
    group_name="hidden_states",
    kinds={"pytorch", "safetensors"},
    owners=["team:dflash"],
    op_tags={"dflash/gpu": "target"},
    pool=GPU_POOL,
    check_specs=[
        dg.AssetCheckSpec(
            CHECK_IDS,
            asset="hidden_states",
            blocking=True,
            description="Stored input_ids equal the tokenized partition's.",
        ),
        dg.AssetCheckSpec(
            CHECK_FINITE, asset="hidden_states", blocking=True, description="No NaN or Inf in the stored features."
        ),
    ],
    description=(
        "Runs the target model over `tokenized_sequences/<pk>.parquet` (batched by a token budget, sorted by length, "
        "stopping after the last needed layer) and writes `hidden_states/<pk>/shard-NNNNN.safetensors` holding "
        "`hidden_states [tokens, n_layers*hidden]` bf16, input_ids, loss_mask, cu_seqlens, row_index, plus index.json. "
        "Shards are atomic; complete ones are kept on rerun. Before anything else, a storage plan (bytes for every "
        "selected row of the corpus vs free space or storage_budget_gb) fails the run at once when it does not fit; "
        "max_rows / fraction store a stable-hash subset. Not materialized when dflash_drafter trains online."
    ),
)
def hidden_states(
    context: dg.AssetExecutionContext,
    config: HiddenStatesConfig,
    storage: StorageResource,
    target_model: TargetModelResource,
):
    pk = context.partition_key
    # one run per partition: another one's shard writes and clean-up of temporary files would collide
    if holding := runs_holding_partitions(
        context.instance,
        "hidden_states",
        [pk],
        context.run.run_id,
        lambda: context.instance.get_dynamic_partitions(prompt_ranges.name),
    ):
        raise dg.Failure(partition_busy_message(context.instance, "hidden_states", holding))

    def plan_for(indexes: list[int], exact: dict[str, tuple[int, int]]) -> StoragePlan:
        return storage_plan(context.instance, storage, target_model, config, indexes=indexes, exact=exact)

    try:
        done = extract_stage(pk, storage, target_model, config, tokenized_file(pk), plan_for, context.log)
    except HiddenStatesError as exc:
        raise dg.Failure(str(exc), metadata=exc.metadata or None) from None
    path = dg.MetadataValue.path(done.uri)
    cost = device_cost(target_model.device, done.metadata.get("wall_s", 0.0), done.metadata.get("tokens", 0))
    yield dg.MaterializeResult(
        metadata={**done.metadata, **cost, "path": path}, data_version=dg.DataVersion(done.data_version)
    )
    yield from run_checks(done.out_dir, done.index, done.rows)


def run_checks(out_dir: str, index: dict, rows: list[dict]):
    """Re-read every shard: token ids equal the tokenized rows; features are finite."""
    mismatched, nonfinite = check_shards(out_dir, index, rows)
    yield dg.AssetCheckResult(
        check_name=CHECK_IDS,
        passed=not mismatched,
        metadata={"mismatched_rows": len(mismatched), "first": str(mismatched[:10])},
    )
    yield dg.AssetCheckResult(
        check_name=CHECK_FINITE, passed=not nonfinite, metadata={"shards_with_nan_or_inf": str(nonfinite)}
    )
