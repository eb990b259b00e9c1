"""Stage 5: ``hidden_states[pk]``: target-layer features for every tokenized sequence, sharded, resumable."""

import dagster as dg
from pydantic import Field

from dflash_assets.assets.tokenized import tokenized_file
from dflash_assets.check_gate import CHECK_FINITE, CHECK_IDS
from dflash_assets.cost import device_cost
from dflash_assets.hidden_states_stage import (
    ExtractionSettings,
    HiddenStatesError,
    check_shards,
    corpus_indexes,
    extract_stage,
    layer_ids_or_error,
)
from dflash_assets.history import latest_metadata_by_partition
from dflash_assets.partitions import prompt_ranges
from dflash_assets.pools import GPU_POOL
from dflash_assets.resources.storage import StorageResource
from dflash_assets.resources.target_model import TargetModelResource
from dflash_assets.runs import partition_busy_message, runs_holding_partitions
from dflash_assets.storage_plan import StoragePlan, compute_plan, target_shape


class HiddenStatesConfig(dg.Config):
    """Which target layers to keep and how to shard them."""

    target_layer_ids: list[int] = Field(
        default_factory=list, description="Decoder layer ids; empty = DFlash rule for 5 layers."
    )
    rows_per_shard: int = Field(default=64, ge=1, description="Sequences per safetensors shard.")
    max_rows: int | None = Field(
        default=None,
        ge=0,
        description="Store features for at most this many rows of the corpus (stable-hash subset); None = all.",
    )
    fraction: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Store features for this share of the rows (stable-hash subset); None = all.",
    )
    storage_budget_gb: float | None = Field(
        default=None,
        gt=0.0,
        description=(
            "Bytes (GB, 1e9) all hidden states may take; needed to enforce the plan on S3, optional locally "
            "(free disk space is always checked)."
        ),
    )


def storage_plan(
    instance: dg.DagsterInstance,
    storage: StorageResource,
    target_model: TargetModelResource,
    config: HiddenStatesConfig,
    *,
    exact: dict[str, tuple[int, int]] | None = None,
    fallback_tokens_per_row: float = 0.0,
    indexes: list[int] | None = None,
) -> StoragePlan:
    """The storage plan of ``config`` over every partition (see :mod:`dflash_assets.storage_plan`):
    tokens from tokenized_sequences metadata, bytes stored from hidden_states metadata (partitions in
    ``exact`` excluded: they are being rewritten), free space at the local root or scratch."""
    keys = instance.get_dynamic_partitions(prompt_ranges.name)
    exact = exact or {}
    # two instance queries per asset whatever the partition count (a run per partition would make ~1,800 at 903)
    tokenized = latest_metadata_by_partition(instance, "tokenized_sequences", keys)
    partitions = {pk: tokenized.get(pk, {}) for pk in keys}
    hidden = latest_metadata_by_partition(instance, "hidden_states", [pk for pk in keys if pk not in exact])
    stored = {pk: int(hidden.get(pk, {}).get("bytes") or 0) for pk in keys if pk not in exact}
    model_dir = target_model.resolved_path()
    layer_ids, hidden = target_shape(model_dir, config.target_layer_ids or None)
    budget = int(config.storage_budget_gb * 1e9) if config.storage_budget_gb else None
    root = None if storage.is_remote else storage.root.removeprefix("file://")
    return compute_plan(
        corpus_indexes=indexes if indexes is not None else corpus_indexes(storage.open()),
        partitions=partitions,
        hidden_state_bytes=stored,
        layer_ids=layer_ids,
        hidden_size=hidden,
        max_rows=config.max_rows,
        fraction=config.fraction,
        budget_bytes=budget,
        local_root=root,
        fallback_tokens_per_row=fallback_tokens_per_row,
        exact=exact,
    )


def resolve_layer_ids(config_ids: list[int], target) -> list[int]:
    """:func:`~dflash_assets.hidden_states_stage.layer_ids_or_error` for the asset.

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
    settings = ExtractionSettings(config.target_layer_ids, config.rows_per_shard, config.max_rows, config.fraction)

    def plan_for(indexes: list[int], exact: dict[str, tuple[int, int]]) -> StoragePlan:
        return storage_plan(context.instance, storage, target_model, config, indexes=indexes, exact=exact)

    try:
        done = extract_stage(pk, storage, target_model, settings, tokenized_file(pk), plan_for, context.log)
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
