"""Stage 3: ``truncation_report``: how often the cap cut completions, and what another cap would cost."""

import time

import dagster as dg
import polars as pl

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.length_fits import fit_from_dict, predict_cap
from dflash_assets.data.truncation import (
    cap_advice,
    cap_advice_markdown,
    length_histogram_png,
    read_report_columns,
    truncation_stats,
    turn_kind_markdown,
)
from dflash_assets.generation.rows.records import PROMPT_TOO_LONG
from dflash_assets.orchestration.history import latest_metadata_by_partition
from dflash_assets.orchestration.metadata import png_markdown
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.forecast import forecast_markdown
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.tokenized import CompletionsSourceError, completions_source

REPORT_DIR = "truncation_report"


def load_all_completions(
    store, keys: list[str], modes: dict[str, str | None] | None = None
) -> tuple[pl.DataFrame, list[str]]:
    """The report's columns (:data:`~dflash_assets.data.truncation.REPORT_COLUMNS`, never the text) of every
    materialized completions partition stacked, with a ``partition`` column, and the missing keys.

    ``modes``: ``{pk: mode}`` of each partition's latest completions materialization (``regenerate`` or
    ``on_policy``). The table read is the one that run made, as ``tokenized_sequences`` reads it
    (:func:`~dflash_assets.stages.tokenized.completions_source`): a table another mode left earlier is never
    counted. A partition whose table cannot be told or is missing counts as missing."""
    frames, missing = [], []
    for pk in keys:
        try:
            source = completions_source(store, pk, (modes or {}).get(pk))
        except CompletionsSourceError:  # also the table missing: completions_source checked it exists
            missing.append(pk)
            continue
        frames.append(read_report_columns(store, *source.parts).with_columns(partition=pl.lit(pk)))
    # diagonal: a table written before a column existed (context_length) lacks it
    return (pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame()), missing


def context_figures(frame: pl.DataFrame, settings: GenerationSettings) -> dict:
    """What the cap advice needs to say how many prompts each candidate cap leaves no room for under the
    servers' context: the templated length of every prompt that has one (rows generated: the server's count;
    rows set aside as too long: this project's), and the room at a cap under the context the rows were judged
    against (the one the set-aside rows name, judged again at every change; else the most common). Counted as
    vLLM refuses (prompt + cap over the context; SGLang refuses prompt + cap equal to it too). Empty when no
    row names a context (tables made before rows recorded it)."""
    if "context_length" not in frame.columns or "prompt_tokens" not in frame.columns:
        return {}
    aside = frame.filter(pl.col("finish_reason") == PROMPT_TOO_LONG)["context_length"].drop_nulls()
    known = aside if aside.len() else frame["context_length"].drop_nulls()
    if not known.len():
        return {}
    judged = settings.with_context(int(known.mode().sort()[-1]))
    return {
        "prompt_lengths": frame["prompt_tokens"].drop_nulls().to_numpy(),
        "room_at": lambda cap: judged.model_copy(update={"max_output_tokens": cap}).prompt_room(),
    }


def prediction_check(previous: dict | None, stats: dict, cap: int) -> dict | None:
    """After a cap change: what the previous report predicted for the current cap beside what happened.

    A report made again at the same cap keeps the comparison it carried, with the actual rate updated
    (partitions regenerated since then count), so the comparison lasts until the cap changes again.
    """
    if previous and previous.get("cap") == cap and previous.get("prediction_vs_actual"):
        return {**previous["prediction_vs_actual"], "actual_truncation_rate": stats["truncation_rate"]}
    if not previous or previous.get("cap") == cap or not (previous.get("advice") or {}).get("fit"):
        return None
    adv = previous["advice"]
    fit = fit_from_dict(adv["fit"])
    pred = predict_cap(fit, previous["cap"], adv["observed_truncation_rate"], adv["truncated_rows"], cap)
    return {
        "previous_cap": previous["cap"],
        "new_cap": cap,
        "predicted_truncation_rate": pred["truncation_rate"],
        "actual_truncation_rate": stats["truncation_rate"],
    }


def stats_metadata(stats: dict, cap: int) -> dict:
    """The truncation report's figures as Dagster metadata: rates per source, partition and turn kind,
    finish reasons, length percentiles (tokens)."""
    return {
        "cap": cap,
        "rows": stats["rows"],
        "finish_reasons": stats["finish_reasons"],
        "truncation_rate": round(stats["truncation_rate"], 4),
        "truncation_rate_per_source": {k: round(v["rate"], 4) for k, v in stats["per_source"].items()},
        "truncation_rate_per_partition": {k: round(v["rate"], 4) for k, v in stats["per_partition"].items()},
        "rows_per_turn_kind": {k: v["rows"] for k, v in stats["per_turn_kind"].items()},
        "truncation_rate_per_turn_kind": {k: round(v["rate"], 4) for k, v in stats["per_turn_kind"].items()},
        "truncation_by_source_and_turn_kind": dg.MetadataValue.md(turn_kind_markdown(stats["per_source_turn_kind"])),
        "completion_tokens": stats["completion_tokens"],
        "truncated_in_reasoning": stats["truncated_in_reasoning"],
        "empty_answer": stats["empty_answer"],
        "prompt_too_long": stats["prompt_too_long"],
    }


@dg.asset(
    deps=["completions"],
    group_name="generation",
    kinds={"matplotlib", "json"},
    owners=["team:dflash"],
    description=(
        "Reads every materialized completions partition (missing ones listed) and writes "
        "truncation_report/report.json and completion_lengths.png: finish_reason counts, truncation rate overall / "
        "per partition / per source, completion-token percentiles, truncated-inside-reasoning and empty-answer "
        "counts, prompts set aside as too long for the context, a length histogram with the cap marked, and advice for "
        "larger caps from a censored fit (with the prompts each cap would leave no room for under the context)."
    ),
)
def truncation_report(
    context: dg.AssetExecutionContext, storage: StorageResource, generation: GenerationResource
) -> dg.MaterializeResult:
    store = storage.open()
    keys = context.instance.get_dynamic_partitions(prompt_ranges.name)
    recorded = latest_metadata_by_partition(context.instance, "completions", keys)
    modes = {pk: meta.get("mode", "regenerate") for pk, meta in recorded.items()}
    frame, missing = load_all_completions(store, keys, modes)
    if frame.is_empty():
        raise dg.Failure(
            f"no completions partition is materialized yet ({len(missing)} missing): materialize completions first"
        )
    settings = generation.settings()
    cap = settings.max_output_tokens
    stats = truncation_stats(frame)
    ok = frame.filter(pl.col("error").is_null() & pl.col("completion_tokens").is_not_null())
    ok = ok.filter(pl.col("finish_reason").ne_missing(PROMPT_TOO_LONG))  # never sent: no length to fit
    advice = cap_advice(ok, cap, **context_figures(frame, settings))
    previous = store.read_json(REPORT_DIR, "report.json") if store.exists(REPORT_DIR, "report.json") else None
    check = prediction_check(previous, stats, cap)
    png = length_histogram_png(
        ok["completion_tokens"].to_numpy(),
        cap,
        f"{ok.height} completions, {stats['truncation_rate']:.1%} hit the cap",
    )
    report = {
        "cap": cap,
        "generated_at": time.time(),
        "partitions_included": sorted(set(frame["partition"].to_list())),
        "partitions_missing": missing,
        **stats,
        "advice": advice,
        "prediction_vs_actual": check,
    }
    store.write_json(report, REPORT_DIR, "report.json")
    png_uri = store.write_bytes(png, REPORT_DIR, "completion_lengths.png")
    if stats["truncation_rate"] > 0.05:
        context.log.warning(
            f"{stats['truncation_rate']:.1%} of completions hit the {cap}-token cap; see the cap advice"
        )
    return dg.MaterializeResult(
        metadata={
            **stats_metadata(stats, cap),
            "partitions_missing": len(missing),
            "prediction_vs_actual": check or {},
            "histogram": png_markdown(png, "completion lengths"),
            "histogram_path": dg.MetadataValue.path(png_uri),
            "cap_advice": dg.MetadataValue.md(cap_advice_markdown(advice)),
            "cost_forecast": dg.MetadataValue.md(forecast_markdown(context.instance, store, report)),
        }
    )
