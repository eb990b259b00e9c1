"""Stage 2: ``completions[pk]``: regenerate every prompt of an index range with the target model.

Row-level checkpoints: each finished row is appended (fsync) to ``completions/<pk>.journal.jsonl``
as it arrives; a rerun reads the journal and the last partition table and requests only rows that
are missing or no longer valid under the current generation settings. The finished table is written
atomically to ``completions/<pk>.parquet`` and the journal removed.
"""

import hashlib
import threading
import time
from collections import Counter

import dagster as dg
import polars as pl

from dflash_assets.assets.prompts import CORPUS_FILE
from dflash_assets.generation.client import TooManyFailuresError
from dflash_assets.generation.records import invalid_reason, no_good_row_message, row_from_result, rows_to_frame
from dflash_assets.partitions import key_range, prompt_ranges
from dflash_assets.resources.generation import GenerationResource
from dflash_assets.resources.inference import InferenceServerResource
from dflash_assets.resources.storage import StorageResource
from dflash_assets.settings import GenerationSettings
from dflash_assets.status import INFERENCE_POOL
from dflash_assets.truncation import row_counts, token_summary

PROGRESS_EVERY_S = 5.0


def partition_file(pk: str) -> tuple[str, str]:
    return ("completions", f"{pk}.parquet")



def load_prompts(storage, pk: str) -> pl.DataFrame:
    """Corpus rows of partition ``pk``. Raises dagster.Failure when the corpus lacks the range."""
    first, last = key_range(pk)
    corpus = storage.read_parquet(*CORPUS_FILE)
    prompts = corpus.filter(pl.col("index").is_between(first, last))
    if prompts.height != last - first + 1:
        raise dg.Failure(
            f"partition {pk}: the corpus holds {prompts.height} of its {last - first + 1} prompts; "
            "re-materialize prompt_corpus with the same partition_size, or drop stale partition keys"
        )
    return prompts


def load_existing_rows(storage, pk: str, journal) -> dict[int, dict]:
    """Rows already made for ``pk``: the last table, overlaid by the journal (later rows win)."""
    rows: dict[int, dict] = {}
    if storage.exists(*partition_file(pk)):
        for row in storage.read_parquet(*partition_file(pk)).iter_rows(named=True):
            rows[row["index"]] = row
    rows.update(journal.load())
    return rows


def plan_requests(prompts: pl.DataFrame, existing: dict[int, dict], settings: GenerationSettings) -> tuple[list[dict], Counter]:
    """Prompts (corpus rows) that need a request, and why, counted by reason."""
    todo, reasons = [], Counter()
    for prompt in prompts.iter_rows(named=True):
        row = existing.get(prompt["index"])
        reason = "missing" if row is None else invalid_reason(row, settings)
        if reason is not None:
            todo.append(prompt)
            reasons[reason] += 1
    return todo, reasons


def completion_stats(frame: pl.DataFrame) -> dict:
    """Metadata numbers: finish_reason counts and completion-token mean/P50/P90/P99/max."""
    ok, counts = row_counts(frame)
    tokens = ok["completion_tokens"].drop_nulls().to_numpy()
    summary = token_summary(tokens)
    stats = {
        **counts,
        "completion_tokens_total": summary["total"],
        "completion_tokens_missing": int(ok["completion_tokens"].is_null().sum()),
        # what the cap-change sensor needs to decide, without reading the table, whether a new cap touches it
        "length_row_caps": sorted({int(c) for c in ok.filter(pl.col("finish_reason") == "length")["max_output_tokens"].to_list()}),
        "settings_fingerprints": sorted(set(ok["settings_fingerprint"].to_list())),
        "completion_tokens_max": summary["max"] if tokens.size else 0,
    }
    if tokens.size:
        stats.update(
            completion_tokens_mean=round(summary["mean"], 1),
            completion_tokens_p50=summary["p50"],
            completion_tokens_p90=summary["p90"],
            completion_tokens_p99=summary["p99"],
        )
    return stats


@dg.asset(
    partitions_def=prompt_ranges,
    deps=["prompt_corpus"],
    group_name="generation",
    kinds={"sglang", "parquet"},
    owners=["team:dflash"],
    op_tags={"dflash/inference": "servers"},
    pool=INFERENCE_POOL,
    description=(
        "Sends each prompt of the index range to the inference servers (thinking on, sampling and cap from the "
        "generation resource) and stores per row: reasoning and answer text, finish_reason, prompt/completion "
        "tokens, generated token ids when returned, the settings used, latency, server, attempts and errors. "
        "Row checkpoints in `completions/<pk>.journal.jsonl`; output `completions/<pk>.parquet`."
    ),
)
def completions(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    inference: InferenceServerResource,
    generation: GenerationResource,
) -> dg.MaterializeResult:
    pk = context.partition_key
    store = storage.open()
    settings = generation.settings()
    prompts = load_prompts(store, pk)
    journal = storage.open_journal("completions", f"{pk}.journal.jsonl")
    existing = load_existing_rows(store, pk, journal)
    todo, reasons = plan_requests(prompts, existing, settings)
    context.log.info(f"{pk}: {prompts.height} prompts, {len(todo)} to request {dict(reasons)}, cap {settings.max_output_tokens}")

    started = time.monotonic()
    failure: Exception | None = None
    progress = None
    try:
        if todo:
            by_index = {p["index"]: p for p in todo}

            with inference.serve(log_dir=storage.local_scratch("server_logs", pk), settings=settings) as pool:
                client = inference.client(pool)

                def on_result(result) -> None:
                    row = row_from_result(result, by_index[result.index], settings)
                    journal.append(row)
                    existing[row["index"]] = row

                items = ((p["index"], pool.adapt_body(settings.request_body(pool.model, p["messages"], p["index"]))) for p in todo)
                ticker = _ProgressTicker(lambda: context.log.info(f"{pk}: {client.progress().format(len(todo))}"), PROGRESS_EVERY_S)
                try:
                    with ticker:
                        progress = client.generate_blocking(items, on_result)
                except TooManyFailuresError as exc:
                    failure = exc
                progress = client.progress()
                context.log.info(f"{pk}: {progress.format(len(todo))}")
    finally:
        journal.close()  # a clean stop syncs the journal (S3) whatever ended generation
    frame = rows_to_frame([existing[i] for i in prompts["index"].to_list() if i in existing])
    missing = prompts.height - frame.height
    if failure is not None or missing:
        # finished rows stay in the journal; the next run requests only the rest
        raise dg.Failure(
            f"{pk}: {missing} of {prompts.height} prompts have no row"
            + (f" ({failure})" if failure else "")
            + "; finished rows are checkpointed, rerun the partition to resume"
        )
    if (message := no_good_row_message(frame.to_dicts(), pk)) is not None:
        raise dg.Failure(message)  # the journal is kept: nothing is recorded as materialized
    uri = store.write_parquet(frame, *partition_file(pk))
    journal.discard()
    data_version = hashlib.sha256(store.read_bytes(*partition_file(pk))).hexdigest()[:20]
    stats = completion_stats(frame)
    wall = time.monotonic() - started
    if stats["errors"]:
        context.log.warning(f"{pk}: {stats['errors']} rows ended in error; the next run retries them")
    return dg.MaterializeResult(
        metadata={
            **stats,
            "requested": len(todo),
            "request_reasons": dict(reasons),
            "carried_over": prompts.height - len(todo),
            "wall_s": round(wall, 2),
            "output_tok_per_s": round(progress.output_tokens_per_s, 1) if progress else 0.0,
            "req_per_s": round(progress.requests_per_s, 2) if progress else 0.0,
            "max_output_tokens": settings.max_output_tokens,
            "settings": settings.model_dump(),
            "path": dg.MetadataValue.path(uri),
        },
        data_version=dg.DataVersion(data_version),
    )


class _ProgressTicker:
    """Calls ``log()`` every ``every_s`` seconds from a daemon thread while the ``with`` block runs
    (rows done, req/s, tok/s and ETA keep coming even while no row finishes)."""

    def __init__(self, log, every_s: float):
        self._log, self._every = log, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self._log()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
