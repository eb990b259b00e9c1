"""Stage 4: ``tokenized_sequences[pk]``: ``input_ids`` + ``loss_mask`` per completion, with blocking checks."""

from collections import Counter

import dagster as dg
import polars as pl

from dflash_assets.common.cost import CpuClock
from dflash_assets.data.sequence_builder import SequenceBuilder
from dflash_assets.orchestration.check_gate import CHECK_DEGENERATE, CHECK_NONEMPTY, CHECK_ROUNDTRIP
from dflash_assets.orchestration.history import latest_metadata
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.completions.tables import load_prompts
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets.stages.tokenized import (
    CHECK_MAX_LENGTH,
    CHECK_RENDERING,
    CHECK_RETOKENIZED,
    CompletionsSourceError,
    TokenizeConfig,
    completions_source,
    tokenize_stage,
)


@dg.asset(
    partitions_def=prompt_ranges,
    deps=["completions"],
    group_name="tokenization",
    kinds={"transformers", "parquet"},
    owners=["team:dflash"],
    check_specs=[
        dg.AssetCheckSpec(
            CHECK_NONEMPTY,
            asset="tokenized_sequences",
            blocking=True,
            description="Every kept row supervises at least one token.",
        ),
        dg.AssetCheckSpec(
            CHECK_DEGENERATE,
            asset="tokenized_sequences",
            blocking=True,
            description="No small num_loss_tokens value held by most rows (the empty-answer signature).",
        ),
        dg.AssetCheckSpec(
            CHECK_ROUNDTRIP,
            asset="tokenized_sequences",
            blocking=True,
            description="The supervised tokens decode back to the recorded reasoning and answer.",
        ),
        dg.AssetCheckSpec(
            CHECK_MAX_LENGTH,
            asset="tokenized_sequences",
            description="Warns with the share of rows that max_length would cut at the current cap.",
        ),
        dg.AssetCheckSpec(
            CHECK_RENDERING,
            asset="tokenized_sequences",
            description="Warns when the project's rendering of a context (the length pre-filter's, the in-process "
            "evaluation's) differs from the server's prompt ids; the rows keep the server's ids.",
        ),
        dg.AssetCheckSpec(
            CHECK_RETOKENIZED,
            asset="tokenized_sequences",
            description="Warns when re-tokenized completions (server returned no ids) differ in length from "
            "usage.completion_tokens: the text does not round-trip to the emitted tokens.",
        ),
    ],
    description=(
        "Reads `completions/<pk>.parquet` and the prompt corpus (or, when the partition's latest completions ran "
        "mode: on_policy, `completions/<pk>.on_policy.parquet`, each turn with its own context); builds input_ids = "
        "chat-template prompt ids + generated ids (server ids when returned, else the completion re-tokenized as "
        "emitted, plus the end-of-turn token for stop rows) and loss_mask = 0 on the prompt, 1 on the completion. "
        "Writes `tokenized_sequences/<pk>.parquet` (index, prompt_id, input_ids int32, loss_mask int8, prompt_len, "
        "num_loss_tokens, finish_reason; corpus_index for on-policy turns)."
    ),
)
def tokenized_sequences(
    context: dg.AssetExecutionContext,
    config: TokenizeConfig,
    storage: StorageResource,
    target_model: TargetModelResource,
    generation: GenerationResource,
):
    pk = context.partition_key
    store = storage.open()
    # the table the partition's latest completions made: regeneration rows, or on-policy turns
    recorded = latest_metadata(context.instance, "completions", pk)
    try:
        source = completions_source(store, pk, None if recorded is None else recorded.get("mode", "regenerate"))
    except CompletionsSourceError as exc:
        raise dg.Failure(str(exc)) from None
    if source.ignored is not None:
        context.log.info(
            f"{pk}: reading {'/'.join(source.parts)} (the latest completions ran mode: {source.mode}); "
            f"{'/'.join(source.ignored)}, left by a run of the other mode, is not read"
        )
    completions = store.read_parquet(*source.parts)
    prompts = load_prompts(store, pk)
    builder = SequenceBuilder(target_model.load_tokenizer(), end_token=config.end_token or None)
    with CpuClock() as clock:
        tokenized, aside, counts, uri, version, checks = tokenize_stage(
            store,
            pk,
            completions,
            prompts,
            builder,
            config,
            generation.settings().max_output_tokens,
            on_policy=source.on_policy,
        )
    for row in aside.head(10).iter_rows(named=True):
        context.log.warning(f"{pk}: row {row['index']} set aside: {row['reason']}")
    if counts.first_prompt_difference:
        context.log.warning(
            f"{pk}: {counts['prompt_ids_differ']} rows' rendering differs from the server's prompt "
            f"ids (the rows keep the server's): {counts.first_prompt_difference}"
        )
    lengths = tokenized["num_loss_tokens"].to_list()
    total_tokens = int(tokenized["input_ids"].list.len().sum() or 0)
    yield dg.MaterializeResult(
        metadata={
            "rows": tokenized.height,
            "counts": dict(counts),
            "loss_tokens": int(sum(lengths)),
            "total_tokens": total_tokens,
            **clock.metadata(total_tokens),
            "num_loss_tokens_min": min(lengths, default=0),
            "num_loss_tokens_median": float(pl.Series(lengths).median() or 0) if lengths else 0.0,
            "end_token": builder.end_token,
            **_rows_by_origin(tokenized),
            "first_prompt_difference": counts.first_prompt_difference or "",
            "completions_mode": source.mode,
            "completions_path": store.uri(*source.parts),
            "path": dg.MetadataValue.path(uri),
        },
        data_version=dg.DataVersion(version),
    )
    yield from checks


def _rows_by_origin(tokenized) -> dict[str, dict[str, int]]:
    """Rows counted by ``ids_source`` and by ``template_sha256``: the chat templates the rows were rendered with,
    which the drafter records and the evaluation compares its own rendering with."""
    return {
        "rows_by_ids_source": dict(sorted(Counter(tokenized["ids_source"].to_list()).items())),
        "rows_by_template": dict(sorted(Counter(tokenized["template_sha256"].to_list()).items())),
    }
