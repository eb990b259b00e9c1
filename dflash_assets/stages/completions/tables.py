"""The stored side of ``completions[pk]``: where a partition's table lives, reading prompts and stored rows
without reading what planning does not need, and building the table a commit writes.

A range over the user's 903 partitions reads the corpus once and only the row groups of its range;
each stored table is read for its validity columns, and whole only for the rows a cap raise continues
and at its partition's commit. No Dagster state here beyond the ``Failure`` a missing range raises.
"""

from collections import Counter

import dagster as dg
import polars as pl

from dflash_assets.data.ranges import key_range
from dflash_assets.data.shapes import with_conversation_columns
from dflash_assets.data.truncation import row_counts, token_summary
from dflash_assets.generation.rows.records import (
    IDS_UNKNOWN,
    PROMPT_TOO_LONG,
    VALIDITY_COLUMNS,
    align_to_schema,
    row_problem,
    rows_to_frame,
    set_aside_row,
)
from dflash_assets.stages.prompts import CORPUS_FILE


def partition_file(pk: str) -> tuple[str, str]:
    return ("completions", f"{pk}.parquet")


def load_prompts(storage, pk: str) -> pl.DataFrame:
    """Corpus rows of partition ``pk`` (only the corpus row groups that hold them are read).
    Raises dagster.Failure when the corpus lacks the range."""
    return load_range_prompts(storage, [pk])[pk]


def load_range_prompts(storage, keys: list[str]) -> dict[str, pl.DataFrame]:
    """Corpus rows of each partition in ``keys``, from one read of the row groups that hold them.

    A run over the whole corpus reads it once; a corpus written with a row group per partition
    (``prompt_corpus`` does) lets a one-partition run read ~1/900 of it. A range may have gaps (indices
    of removed prompts, :mod:`dflash_assets.data.prompt_index`). Raises dagster.Failure naming the partition
    when the corpus holds no prompt of its range."""
    ranges = {pk: key_range(pk) for pk in keys}
    # a corpus stored before tool conversations were read gets their columns (tools null, ...)
    corpus = with_conversation_columns(storage.read_parquet(*CORPUS_FILE, index_ranges=list(ranges.values())))
    out = {}
    for pk, (first, last) in ranges.items():
        prompts = corpus.filter(pl.col("index").is_between(first, last))
        # stable indices leave gaps (removed prompts); a range with no prompt at all is not a partition any more
        if prompts.is_empty():
            raise dg.Failure(
                f"partition {pk}: the corpus holds no prompt in this index range (its prompts were removed, or "
                "partition_size changed); re-materialize prompt_corpus and run the partitions it registers"
            )
        out[pk] = prompts
    return out


#: What planning reads of a stored partition table (whether each row is still valid, and whether it
#: can be continued): never its text or token ids, nearly all of its bytes.
PLAN_COLUMNS = ("index", *VALIDITY_COLUMNS)


def load_plan_rows(storage, pk: str, journal) -> tuple[dict[int, dict], dict[int, dict]]:
    """What planning ``pk`` reads: ``(view, journal_rows)``.

    ``view``: index -> the row's :data:`PLAN_COLUMNS` from the last table, overlaid by the journal's
    whole rows (later rows win); ``journal_rows``: the journal's rows alone, which the table lacks and
    the commit must write."""
    view: dict[int, dict] = {}
    if storage.exists(*partition_file(pk)):
        for row in storage.read_parquet(*partition_file(pk), columns=PLAN_COLUMNS).iter_rows(named=True):
            view[row["index"]] = row
    journal_rows = journal.load()
    view.update(journal_rows)
    return view, journal_rows


def table_rows(storage, pk: str, indexes: list[int]) -> dict[int, dict]:
    """Whole rows ``indexes`` of ``pk``'s last table (those it has)."""
    if not indexes or not storage.exists(*partition_file(pk)):
        return {}
    frame = storage.read_parquet(*partition_file(pk)).filter(pl.col("index").is_in(indexes))
    return {row["index"]: row for row in frame.iter_rows(named=True)}


def partition_frame(
    storage, pk: str, prompts: pl.DataFrame, rows: dict[int, dict]
) -> tuple[pl.DataFrame, dict[int, str]]:
    """The table to commit for ``pk`` and the rows set aside: ``rows`` (journal and this run's, whole) over
    the last table's rows, one per prompt of the partition, sorted by index. Equal, value for value and so
    byte for byte once written, to :func:`rows_to_frame` of every row as dicts; only one partition's text
    is in memory at a time.

    A row the table cannot take as it is (:func:`~dflash_assets.generation.rows.records.row_problem`: a count
    past its type, a lone surrogate, a value of the wrong type) never blocks the commit: it is stored as
    :func:`~dflash_assets.generation.rows.records.set_aside_row` (the reason as its error; the next run requests
    it again) and returned in the second value, ``{index: reason}``."""
    indexes = prompts["index"].to_list()
    chosen, set_aside = [], {}
    for position, i in enumerate(indexes):
        if i not in rows:
            continue
        row = rows[i]
        if (problem := row_problem(row)) is not None:
            set_aside[i] = problem
            row = set_aside_row(prompts.row(position, named=True), problem)
        chosen.append(row)
    new = rows_to_frame(chosen)
    if not storage.exists(*partition_file(pk)):
        return new, set_aside
    old = storage.read_parquet(*partition_file(pk)).filter(
        pl.col("index").is_in(indexes) & ~pl.col("index").is_in(list(rows))
    )
    if old.is_empty():
        return new, set_aside
    # an old row kept by the one proof prompt_mismatch accepts (prompt_id == content hash) now names its prompt
    hashes = prompts.select("index", pl.col("content_hash").alias("_hash"))
    old = (
        align_to_schema(old)
        .join(hashes, on="index", how="left")
        .with_columns(
            pl.when(pl.col("prompt_hash").is_null() & (pl.col("prompt_id") == pl.col("_hash")))
            .then(pl.col("_hash"))
            .otherwise(pl.col("prompt_hash"))
            .alias("prompt_hash")
        )
        .drop("_hash")
    )
    return pl.concat([old, new]).sort("index").rechunk(), set_aside


def _column(frame: pl.DataFrame, name: str, missing: str) -> list[str]:
    """``frame[name]`` as a list, nulls (and a table without the column) read as ``missing``."""
    if name not in frame.columns:
        return [missing] * frame.height
    return frame[name].fill_null(missing).to_list()


def completion_stats(frame: pl.DataFrame) -> dict:
    """Metadata numbers: finish_reason counts and completion-token mean/P50/P90/P99/max (of generated rows:
    those set aside as too long for the context are counted as ``prompt_too_long``), and the generated rows
    without exact output ids (``output_ids_missing``) with the count per ``output_token_ids_source``."""
    ok, counts = row_counts(frame)
    set_aside = frame.filter(pl.col("error").is_null() & (pl.col("finish_reason") == PROMPT_TOO_LONG))
    tokens = ok["completion_tokens"].drop_nulls().to_numpy()
    summary = token_summary(tokens)
    stats = {
        **counts,
        "completion_tokens_total": summary["total"],
        "completion_tokens_missing": int(ok["completion_tokens"].is_null().sum()),
        # what the cap-change sensor needs to decide, without reading the table, whether a new cap touches it
        "length_row_caps": sorted(
            {int(c) for c in ok.filter(pl.col("finish_reason") == "length")["max_output_tokens"].to_list()}
        ),
        "settings_fingerprints": sorted(
            set(ok["settings_fingerprint"].to_list()) | set(set_aside["settings_fingerprint"].to_list())
        ),
        "completion_tokens_max": summary["max"] if tokens.size else 0,
        # rows without the model's own token ids (tokenization re-encodes their text; a lowered cap cuts them by
        # re-encoded text), and where the others' ids came from (records.COMPLETIONS_SCHEMA)
        "output_ids_missing": int(ok["output_token_ids"].is_null().sum()),
        "output_token_ids_sources": dict(
            sorted(Counter(ok["output_token_ids_source"].fill_null("unrecorded").to_list()).items())
        ),
        # where the rows' training ids come from (records.IDS_*; a row made before the column: unknown) and which
        # engines, at which versions, made them (servers/origin.py)
        "rows_by_ids_source": dict(sorted(Counter(_column(ok, "ids_source", IDS_UNKNOWN)).items())),
        "engines": sorted(
            {f"{e} ({v})" for e, v in zip(_column(ok, "engine", "unknown"), _column(ok, "engine_version", "unknown"))}
        ),
        # the caps and contexts (0: unknown) rows set aside as too long were judged under: either changing
        # makes them judged again (freshness.settings_reason)
        "prompt_too_long_judged": sorted(
            {
                (int(r["max_output_tokens"]), int(r["context_length"] or 0))
                for r in set_aside.select("max_output_tokens", "context_length").iter_rows(named=True)
            }
        ),
    }
    if tokens.size:
        stats.update(
            completion_tokens_mean=round(summary["mean"], 1),
            completion_tokens_p50=summary["p50"],
            completion_tokens_p90=summary["p90"],
            completion_tokens_p99=summary["p99"],
        )
    return stats
