"""Stage 2: ``completions[pk]``: regenerate every prompt of an index range with the target model.

One run covers one partition or a range of them (single-run backfill policy: a range from the shell, a UI
backfill, ``python -m dflash_assets run``); :class:`~dflash_assets.stages.completions.range_run.RangeRun` does the
work and yields an event per partition as it is committed. The asset records each as that partition's
materialization while the run goes on, and no output, so nothing is recorded twice at the end (assets after
it in the same range run are therefore skipped: later stages run per partition). A one-partition run ends
with its result as any asset.
"""

import warnings

import dagster as dg

# the tags Dagster itself writes for a data version; private module: dagster 1.13 exports no public name for them
from dagster._core.definitions.data_version import (
    CODE_VERSION_TAG,
    DATA_VERSION_IS_USER_PROVIDED_TAG,
    DATA_VERSION_TAG,
    extract_data_version_from_entry,
)

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.rows.range_plan import PartitionComplete, RangeRunError
from dflash_assets.orchestration import freshness
from dflash_assets.orchestration.history import plain_metadata
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.orchestration.pools import INFERENCE_POOL
from dflash_assets.orchestration.runs import partition_busy_message, runs_holding_partitions
from dflash_assets.stages.completions.config import CompletionsConfig
from dflash_assets.stages.completions.on_policy import OnPolicyRun
from dflash_assets.stages.completions.range_run import RangeRun
from dflash_assets.stages.completions.tables import load_range_prompts
from dflash_assets.stages.resources.generation import GenerationResource, served_settings
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource


def chat_template_or_failure(target_model: TargetModelResource):
    """``target_model.chat_template``'s file (read once to check it), None when unset; a dagster.Failure naming the
    key and the path when it cannot be read."""
    from dflash_assets.generation.engines.chat_render import ChatTemplateError

    try:
        target_model.chat_template_text()
        return target_model.chat_template_path()
    except ChatTemplateError as exc:
        raise dg.Failure(str(exc)) from None


def failed_since_materialized(
    instance: dg.DagsterInstance, asset_key: dg.AssetKey, keys: list[str], this_run: str
) -> set[str]:
    """Partitions of ``keys`` that another run planned after their latest materialization (a few instance
    queries for all of them).

    Such a run failed or did not record the partition (a run that fails at start-up changes no table),
    and the UI and ``status`` show the partition failed until a new materialization is recorded; so it
    is committed again rather than kept."""
    if not keys:
        return set()
    latest = instance.event_log_storage.get_latest_storage_id_by_partition(
        asset_key, dg.DagsterEventType.ASSET_MATERIALIZATION, set(keys)
    )
    if not latest:
        return set()
    planned = instance.fetch_planned_materializations(
        dg.AssetRecordsFilter(
            asset_key=asset_key, asset_partitions=list(latest), after_storage_id=min(latest.values())
        ),
        limit=100_000,
    ).records
    return {
        r.partition_key
        for r in planned
        if r.run_id != this_run and r.partition_key in latest and r.storage_id > latest[r.partition_key]
    }


def kept_versions(context: dg.AssetExecutionContext, settings: GenerationSettings):
    """``kept_version(pk)`` for :class:`RangeRun`: the data version of the partition's latest materialization
    when it is up to date by :mod:`dflash_assets.orchestration.freshness` (made for the corpus's prompts of the range,
    under ``settings``), else None. The corpus's partition versions are read once, when first needed."""
    corpus: list = []

    def kept_version(pk: str) -> str | None:
        record = context.instance.get_latest_data_version_record(context.asset_key, partition_key=pk)
        if record is None:
            return None
        current = extract_data_version_from_entry(record.event_log_entry)
        if not corpus:
            corpus.append(freshness.corpus_versions(context.instance) or {})
        # a partition last made on-policy is regenerated, not kept (this is the regenerate mode's run)
        reason = freshness.completions_reason(plain_metadata(record), settings, corpus[0].get(pk), "regenerate")
        if current is None or reason:
            return None
        return current.value

    return kept_version


def materialization(context: dg.AssetExecutionContext, event: PartitionComplete, keys: list[str]):
    """The event as Dagster records it: an AssetMaterialization of that partition in a range run (recorded at
    once), the step's result in a one-partition run. A partition not committed logs its failure instead."""
    if event.failure is not None:
        context.log.error(event.failure)
        return
    metadata = {**event.metadata, "path": dg.MetadataValue.path(event.metadata["path"])}
    if len(keys) == 1:
        # a one-partition run ends with its output, as any asset: later assets in the same run
        # (the partition_stages job) run on it; without an output Dagster would skip them
        yield dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(event.data_version))
        return
    yield dg.AssetMaterialization(
        asset_key=context.asset_key,
        partition=event.pk,
        metadata=metadata,
        tags={
            DATA_VERSION_TAG: event.data_version,
            DATA_VERSION_IS_USER_PROVIDED_TAG: "true",
            CODE_VERSION_TAG: context.run.run_id,
        },
    )


# backfill_policy is marked beta in Dagster 1.13: its warning would greet every command that loads the code
with warnings.catch_warnings():
    warnings.simplefilter("ignore", category=dg.BetaWarning)
    _completions_asset = dg.asset(
        partitions_def=prompt_ranges,
        deps=["prompt_corpus"],
        group_name="generation",
        kinds={"sglang", "parquet"},
        owners=["team:dflash"],
        op_tags={"dflash/inference": "servers"},
        pool=INFERENCE_POOL,
        backfill_policy=dg.BackfillPolicy.single_run(),
        output_required=False,  # each partition's materialization is yielded when it is committed
        description=(
            "Sends each prompt of the index range to the inference servers (thinking on, sampling and cap from the "
            "generation resource) and stores per row: reasoning and answer text, finish_reason, prompt/completion "
            "tokens, generated token ids when returned, the settings used, latency, server, attempts and errors. "
            "A range of partitions is one run: servers started once, requests streamed across partitions, each "
            "partition committed (table + materialization) as soon as its last row is in. "
            "Row checkpoints in `completions/<pk>.journal.jsonl`; output `completions/<pk>.parquet`."
        ),
    )


def completions(
    context: dg.AssetExecutionContext,
    config: CompletionsConfig,
    storage: StorageResource,
    inference: InferenceServerResource,
    generation: GenerationResource,
    target_model: TargetModelResource,
):
    keys = list(context.partition_keys)
    if not keys:  # `--partition-range LAST...FIRST` resolves to no key and would succeed doing nothing
        raise dg.Failure(
            "the run selects no completions partition: is the partition range reversed? "
            "give it as FIRST...LAST in key order (`python -m dflash_assets status` lists the keys)"
        )
    # one run per partition: another run writing the same journal would overwrite its segments
    if holding := runs_holding_partitions(
        context.instance,
        "completions",
        keys,
        context.run.run_id,
        lambda: context.instance.get_dynamic_partitions(prompt_ranges.name),
    ):
        raise dg.Failure(partition_busy_message(context.instance, "completions", holding))
    store = storage.open()
    settings = served_settings(generation, inference, target_model)  # context: prompts are judged against it
    template = chat_template_or_failure(target_model)
    if config.mode == "on_policy":  # the target runs the corpus's BFCL tasks as the assistant (issue 43 item 5)
        run = OnPolicyRun(context.log, store, settings, keys, config, chat_template=template)
    else:
        run = RangeRun(
            context.log,
            store,
            settings,
            keys,
            kept_version=kept_versions(context, settings),
            failed_since=lambda pks: failed_since_materialized(
                context.instance, context.asset_key, pks, context.run.run_id
            ),
            exposure=inference.exposure_warnings(),
            chat_template=template,
        )
    try:
        for event in run.run(load_range_prompts(store, keys), storage, inference):
            yield from materialization(context, event, keys)
    except RangeRunError as exc:
        raise dg.Failure(str(exc)) from None
    if (message := run.failure_message()) is not None:
        raise dg.Failure(message)


completions = _completions_asset(completions)
