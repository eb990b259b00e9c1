"""Stage 2: ``completions[pk]``: regenerate every prompt of an index range with the target model.

One run covers one partition or a range of them (single-run backfill policy: a range from the shell,
a UI backfill, ``python -m dflash_assets run``): the servers start once for the whole run, the prompts
of all its partitions go to the client as one stream (every slot stays busy across partition
boundaries) and each partition is committed as soon as its last row is in: its table written
atomically to ``completions/<pk>.parquet``, its journal removed, and its own materialization
(metadata, data version = hash of the table) recorded while the run goes on. The asset yields those
materializations itself and no output, so nothing is recorded twice at the end (assets after it in
the same range run are therefore skipped: later stages run per partition). A one-partition run ends
with its result as before.

Row-level checkpoints: each finished row is appended (fsync) to ``completions/<pk>.journal.jsonl``
as it arrives; a rerun reads the journal and the last partition table and requests only rows that
are missing, no longer valid under the current generation settings, or made for another prompt than the
corpus's at their index (each row carries ``prompt_hash``; see :func:`plan_requests`).
"""

import hashlib
import queue
import threading
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import dagster as dg
import polars as pl

# the tags Dagster itself writes for a data version; private module: dagster 1.13 exports no public name for them
from dagster._core.definitions.data_version import (
    CODE_VERSION_TAG,
    DATA_VERSION_IS_USER_PROVIDED_TAG,
    DATA_VERSION_TAG,
    extract_data_version_from_entry,
)

from dflash_assets import freshness
from dflash_assets.assets.completions_continuing import ContinuationPlanner, load_target_builder
from dflash_assets.assets.completions_tables import (
    completion_stats,
    load_plan_rows,
    load_range_prompts,
    partition_file,
    partition_frame,
    table_rows,
)
from dflash_assets.generation.cap_cut import cut_rows
from dflash_assets.generation.client import TooManyFailuresError
from dflash_assets.generation.continuation import (
    NOT_CONTINUED,
    continuable,
    continuation_body,
    merge_continuation,
    prefix_text,
)
from dflash_assets.generation.journal import JournalError
from dflash_assets.generation.records import (
    invalid_reason,
    no_good_row_message,
    prompt_mismatch,
    row_from_result,
    row_problem,
    set_aside_row,
)
from dflash_assets.generation.tail_chunks import TailChunker
from dflash_assets.partitions import prompt_ranges
from dflash_assets.pools import INFERENCE_POOL
from dflash_assets.prompt_index import prompt_version
from dflash_assets.resources.generation import GenerationResource
from dflash_assets.resources.inference import InferenceServerResource
from dflash_assets.resources.storage import StorageResource
from dflash_assets.runs import partition_busy_message, runs_holding_partitions
from dflash_assets.settings import GenerationSettings

PROGRESS_EVERY_S = 5.0


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


def plan_requests(
    prompts: pl.DataFrame, existing: dict[int, dict], settings: GenerationSettings
) -> tuple[list[dict], Counter]:
    """Prompts (corpus rows) that need a request, and why, counted by reason. A row made for another
    prompt than the corpus's at its index (:func:`prompt_mismatch`) is never used: requested again as
    ``prompt changed`` (or ``prompt unknown``, a row from before rows named their prompt)."""
    todo, reasons = [], Counter()
    for prompt in prompts.iter_rows(named=True):
        row = existing.get(prompt["index"])
        # a row that cannot be stored as it is (a journal line with a count past its type, say) is redone
        reason = (
            "missing"
            if row is None
            else prompt_mismatch(row, prompt)
            or ("unstorable row" if row_problem(row) else invalid_reason(row, settings))
        )
        if reason is not None:
            todo.append(prompt)
            reasons[reason] += 1
    return todo, reasons


@dataclass
class _Partition:
    """One partition of the run: its prompts, rows so far, and what is still out. ``existing``: index ->
    whole row for what its last table lacks or will lose (journal rows, cut rows being continued,
    this run's rows); the table's other rows are read again only at commit."""

    pk: str
    prompts: pl.DataFrame
    journal: object
    existing: dict
    todo: list
    reasons: Counter
    remaining: int = 0
    resumed: int = 0  # valid rows taken from the journal an interrupted run left (not requested again)
    cut: int = 0  # rows cut to a lowered cap in memory (not journaled): the table must be rewritten
    first_sent: float | None = None
    by_index: dict = field(default_factory=dict)


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
    storage: StorageResource,
    inference: InferenceServerResource,
    generation: GenerationResource,
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
    settings = generation.settings()
    run = _RangeRun(context, store, settings, keys)
    run.exposure = inference.exposure_warnings()
    parts = []
    try:
        for pk, prompts in load_range_prompts(store, keys).items():
            journal = storage.open_journal("completions", f"{pk}.journal.jsonl")
            parts.append(run.plan(pk, prompts, journal, inference))
        if len(keys) > 1:  # only a range run keeps an unchanged partition (commit_or_keep)
            run.failed_since_materialized = failed_since_materialized(
                context.instance, context.asset_key, [p.pk for p in parts if not p.todo], context.run.run_id
            )
        for part in parts:
            if not part.todo:
                yield from run.commit_or_keep(part)
        todo = [p for p in parts if p.todo]
        if todo:
            label = keys[0] if len(keys) == 1 else f"{keys[0]}...{keys[-1]}"
            # the target's tokenizer (for continuing cut rows) loads while the servers start, not after
            with ThreadPoolExecutor(1, thread_name_prefix="dflash-continuations") as pool_planner:
                planned = pool_planner.submit(ContinuationPlanner(settings).plan, inference, todo)
                with inference.serve(log_dir=storage.local_scratch("server_logs", label), settings=settings) as pool:
                    (continuing, opened, note, problem), (tail, tail_note, tail_problem) = planned.result()
                    run.continuing, run.continuing_rows = len(continuing), continuing
                    for line, warn in ((note, problem), (tail_note, tail_problem)):
                        if line:
                            (context.log.warning if warn else context.log.info)(line)
                    yield from run.generate(inference, pool, todo, opened, tail)
    finally:
        for part in parts:
            part.journal.close()  # a clean stop syncs the journal (S3) whatever ended generation
    missing = {p.pk: p.remaining for p in parts if p.remaining}
    if run.no_good_row:
        # such a partition is not recorded as materialized; its journal (all error rows) is kept
        raise dg.Failure("; ".join(run.no_good_row.values()))
    if run.failure is not None or missing:
        # finished rows stay in the journals; the next run requests only the rest
        hint = (
            "; the run was continuing rows cut by a lower cap: if the servers reject continue_final_message, "
            "set inference.continue_truncated: false"
            if run.failure is not None and run.continuing
            else ""
        )
        raise dg.Failure(
            f"{sum(missing.values())} prompts have no row in partition(s) {', '.join(missing) or '-'}"
            + (f" ({run.failure}{hint})" if run.failure else "")
            + f"; {len(run.committed)} partition(s) were committed; finished rows are checkpointed, "
            "rerun the partition to resume"
        )


completions = _completions_asset(completions)


class _RangeRun:
    """Generation of the partitions of one run; commits each partition as soon as it is complete."""

    def __init__(self, context: dg.AssetExecutionContext, store, settings: GenerationSettings, keys: list[str]):
        self.context, self.store, self.settings, self.keys = context, store, settings, keys
        self.started = time.monotonic()
        self.rows_total = 0
        self.committed: list[str] = []
        self.no_good_row: dict[str, str] = {}  # partitions whose every row ended in error -> failure message
        self.failure: Exception | None = None
        self.client = None
        self.capacity = 0
        self.exposure: list[str] = []  # inference.exposure_warnings(): logged by serve(), kept in metadata
        self.continuing = 0  # rows this run continues rather than regenerates
        self.continuing_rows: dict[int, dict] = {}  # index -> the cut row, until its partition is committed
        self.failed_since_materialized: set[str] = set()  # never "kept": their status must go back to done
        self._builder = None  # the target tokenizer's SequenceBuilder (False: it did not load)
        self.corpus_versions: dict | bool | None = False  # the corpus's partition versions, read once (False: not yet)

    def plan(self, pk: str, prompts: pl.DataFrame, journal, inference: InferenceServerResource) -> _Partition:
        view, existing = load_plan_rows(self.store, pk, journal)
        # rows of other prompts are dropped here, so no cut, continuation or commit ever sees them
        hashes = dict(zip(prompts["index"].to_list(), prompts["content_hash"].to_list()))
        ids = dict(zip(prompts["index"].to_list(), prompts["prompt_id"].to_list()))
        other = {
            i
            for i, row in view.items()
            if prompt_mismatch(row, {"content_hash": hashes.get(i), "prompt_id": ids.get(i)}) is not None
        }
        todo, reasons = plan_requests(prompts, view, self.settings)
        for i in other:
            view.pop(i, None)
            existing.pop(i, None)
        journaled = set(existing)
        cut_here = 0
        if reasons.get("cap lowered"):
            todo, cut_here = self.cut_locally(pk, todo, view, existing, inference)
            if cut_here:
                reasons["cap lowered"] -= cut_here
                reasons = Counter({k: v for k, v in reasons.items() if v})
        # the text of a cut row is read only when it may be continued; every other stored row stays on disk
        to_continue = [
            p["index"]
            for p in todo
            if p["index"] not in existing
            and not row_problem(view.get(p["index"]) or {})
            and continuable(view.get(p["index"]), self.settings, check_text=False)
        ]
        existing.update(table_rows(self.store, pk, to_continue))
        kept = set(prompts["index"].to_list()) - {p["index"] for p in todo}  # a journal may hold stray rows
        part = _Partition(
            pk,
            prompts,
            journal,
            existing,
            todo,
            reasons,
            remaining=len(todo),
            cut=cut_here,
            resumed=len(kept & journaled),
            by_index={p["index"]: p for p in todo},
        )
        self.rows_total += len(todo)
        self.context.log.info(
            f"{pk}: {prompts.height} prompts, {len(todo)} to request {dict(reasons)}, "
            f"cap {self.settings.max_output_tokens}"
            + (f"; {part.resumed} rows kept from the journal of an interrupted run" if part.resumed else "")
        )
        return part

    def cut_locally(
        self,
        pk: str,
        todo: list[dict],
        view: dict[int, dict],
        existing: dict[int, dict],
        inference: InferenceServerResource,
    ) -> tuple[list[dict], int]:
        """Rows longer than a lowered cap, cut to their first cap tokens here instead of requested again
        (:mod:`dflash_assets.generation.cap_cut`). The cut rows join ``existing``, which the commit writes;
        they are not journaled: a run that fails before the commit leaves the table as it was, and the
        next run cuts them again at no cost. Returns the prompts still to request and how many rows were
        cut. Rows that cannot be cut (no tokenizer, tokens that do not match the text) stay to be requested."""
        lowered = [
            p
            for p in todo
            if (row := view.get(p["index"])) is not None
            and not row_problem(row)
            and invalid_reason(row, self.settings) == "cap lowered"
        ]
        builder = self.target_builder(inference) if lowered else None
        if builder is None:
            return todo, 0
        whole = {**table_rows(self.store, pk, [p["index"] for p in lowered if p["index"] not in existing]), **existing}
        results = cut_rows([(whole[p["index"]], p["messages"]) for p in lowered], self.settings, builder)
        cut, why_not = {}, Counter()
        for p, (row, reason) in zip(lowered, results, strict=True):
            if row is None:
                why_not[reason] += 1
            else:
                cut[p["index"]] = row
        existing.update(cut)
        self.context.log.info(
            f"{pk}: {len(cut)} of {len(lowered)} rows longer than the lowered cap {self.settings.max_output_tokens} "
            "cut to it from their own tokens (no request)" + (f"; requested again: {dict(why_not)}" if why_not else "")
        )
        return [p for p in todo if p["index"] not in cut], len(cut)

    def target_builder(self, inference: InferenceServerResource):
        """A SequenceBuilder on the target's tokenizer, loaded once per run; None (a warning, once) when it
        does not load: rows are then requested again instead of cut."""
        if self._builder is None:
            try:
                self._builder = load_target_builder(inference)
            except Exception as exc:
                self._builder = False
                self.context.log.warning(
                    f"rows longer than the lowered cap are requested again, not cut locally: the target's tokenizer "
                    f"did not load from the configured path ({type(exc).__name__}: {str(exc)[:200]})"
                )
        return self._builder or None

    def commit_or_keep(self, part: _Partition):
        """A partition with nothing to request: in a range run, an unchanged table whose latest
        materialization has this data version and is up to date by :mod:`dflash_assets.freshness` (made
        for the corpus's prompts of the range, under these settings) is kept as is (no new materialization,
        so downstream stays fresh); otherwise it is committed."""
        if (
            len(self.keys) > 1
            and not part.cut
            and part.pk not in self.failed_since_materialized
            and self.store.exists(*partition_file(part.pk))
            and not part.journal.load()
        ):
            version = hashlib.sha256(self.store.read_bytes(*partition_file(part.pk))).hexdigest()[:20]
            record = self.context.instance.get_latest_data_version_record(self.context.asset_key, partition_key=part.pk)
            current = extract_data_version_from_entry(record.event_log_entry) if record is not None else None
            if self.corpus_versions is False:
                self.corpus_versions = freshness.corpus_versions(self.context.instance)
            fresh = (
                record is not None
                and freshness.completions_reason(
                    freshness.plain(record), self.settings, (self.corpus_versions or {}).get(part.pk)
                )
                is None
            )
            if fresh and current is not None and current.value == version:
                self.context.log.info(f"{part.pk}: complete and unchanged (data version {version}): kept")
                self.release(part)
                return
        yield from self.commit(part)

    def progress_line(self) -> str:
        progress = self.client.progress()
        line = progress.format(self.rows_total)
        return (
            f"range {self.keys[0]}...{self.keys[-1]}: {line}, slots {progress.in_flight}/{self.capacity}, "
            f"{len(self.committed)}/{len(self.keys)} partitions committed"
        )

    def generate(
        self,
        inference: InferenceServerResource,
        pool,
        parts: list[_Partition],
        opened: bool,
        tail: tuple[int, bool] | None = None,
    ):
        """Stream every todo prompt of ``parts`` through one client; yield each partition's
        materialization as its last row lands (from this, the step's thread: Dagster records it at once).
        ``self.continuing_rows``, ``opened``: rows to continue rather than regenerate
        (:meth:`ContinuationPlanner.continuations`); each prefix is built as its request goes out, not all
        at once before the run. ``tail``: :meth:`ContinuationPlanner.tail`'s
        ``(chunk_tokens, opened)``: the stream's last ``tail_prompts_per_slot`` x slots fresh prompts are
        generated in chunks (:class:`~dflash_assets.generation.tail_chunks.TailChunker`). More than
        ``max_consecutive_failures`` continuations in a row answered afresh (:data:`NOT_CONTINUED`) stop
        the run: a server that ignores ``continue_final_message`` would waste every one."""
        settings, context, continuing = self.settings, self.context, self.continuing_rows
        client = self.client = inference.client(pool)
        self.capacity = client.concurrency
        owner = {i: part for part in parts for i in part.by_index}
        commits: queue.Queue = queue.Queue()
        fresh_total = sum(1 for part in parts for p in part.todo if p["index"] not in continuing)
        chunker = None
        if tail is not None:
            # the first `concurrency` prompts start at once whatever is done: chunking them gains nothing
            window = min(fresh_total - client.concurrency, round(inference.tail_prompts_per_slot * client.concurrency))
            if window > 0:
                chunker = TailChunker(settings, pool.model, pool.adapt_body, tail[1], tail[0], window, fresh_total)
                context.log.info(
                    f"the last {window} of {fresh_total} fresh prompts are generated in chunks of {tail[0]} "
                    f"tokens ({inference.tail_prompts_per_slot:g} per slot), each continued once every fresh "
                    "prompt has gone out"
                )
            elif fresh_total <= client.concurrency:
                context.log.info(
                    f"inference.tail_chunk_tokens: not used, the {fresh_total} fresh prompts fit in the "
                    f"{client.concurrency} slots at once"
                )
            else:
                context.log.info(
                    f"inference.tail_chunk_tokens: not used, tail_prompts_per_slot "
                    f"{inference.tail_prompts_per_slot:g} x {client.concurrency} slots rounds to no prompt"
                )

        def items():
            position = 0
            for part in parts:
                part.first_sent = time.monotonic()
                for p in part.todo:
                    i = p["index"]
                    if i in continuing:
                        row = continuing[i]
                        body = pool.adapt_body(
                            continuation_body(settings, pool.model, p["messages"], row, prefix_text(row, opened), i)
                        )
                    else:
                        position += 1
                        body = pool.adapt_body(settings.request_body(pool.model, p["messages"], i))
                        if chunker is not None:
                            body = chunker.first_body(position, p, body)
                    yield i, body

        results: queue.Queue = queue.Queue()
        end = object()

        def work() -> None:  # the client's event loop; results go to the journal writer
            try:
                client.generate_blocking(items(), results.put, chunker.follow_up if chunker is not None else None)
                results.put(end)
            except BaseException as exc:
                commits.put(("error", exc))
                results.put(end)  # the writer still makes the delivered rows durable, then says "done"

        def write() -> None:
            """Journal writer: group commit. Each fsync costs milliseconds (5.6 ms measured here); done on
            the event loop once per row it stalled every request at ~100 rows/s. Here all rows that
            arrived meanwhile share one write + fsync per partition; a row counts as finished once
            durable, and a partition is handed to the step's thread to commit when its last row is."""
            finished, afresh_in_a_row, stopped = False, 0, False
            try:
                while not finished:
                    batch = [results.get()]
                    while len(batch) < 1024:
                        try:
                            batch.append(results.get_nowait())
                        except queue.Empty:
                            break
                    by_part: dict[str, list] = {}
                    for result in batch:
                        if result is end:
                            finished = True
                            continue
                        part, prior = owner[result.index], continuing.get(result.index)
                        prompt = part.by_index[result.index]
                        row = chunker.final_row(result, prompt) if chunker is not None else None
                        if row is None:
                            row = (
                                merge_continuation(prior, result, prompt, settings)
                                if prior is not None
                                else row_from_result(result, prompt, settings)
                            )
                        if (problem := row_problem(row)) is not None:  # the client checks replies; this is the floor
                            row = set_aside_row(prompt, problem)
                        if prior is not None or row.get(
                            "tail_chunks"
                        ):  # servers that answer continuations afresh waste every one
                            afresh_in_a_row = afresh_in_a_row + 1 if row.get("error") == NOT_CONTINUED else 0
                        by_part.setdefault(part.pk, []).append(row)
                    for rows in by_part.values():
                        part = owner[rows[0]["index"]]
                        part.journal.append_many(rows)
                        for row in rows:
                            part.existing[row["index"]] = row
                        part.remaining -= len(rows)
                        if part.remaining == 0:
                            commits.put(("commit", part))
                    if afresh_in_a_row >= inference.max_consecutive_failures and not stopped:
                        stopped = True  # the rows so far are durable (each keeps its cut text); stop sending
                        client.abort()
                        commits.put(
                            (
                                "error",
                                dg.Failure(
                                    f"{afresh_in_a_row} continuations in a row were answered afresh "
                                    "instead of continued: "
                                    + NOT_CONTINUED
                                    + (" (or inference.tail_chunk_tokens: 0)" if chunker is not None else "")
                                    + "; rows cut by a lower cap keep their text"
                                    + (
                                        ", rows of the run's end made in chunks are requested again whole"
                                        if chunker is not None
                                        else ""
                                    )
                                ),
                            )
                        )
                commits.put(("done", None))
            except BaseException as exc:
                client.abort()
                # the message names the journal, the cause and the fix: it is the run's failure, not a traceback's cause
                commits.put(("error", dg.Failure(str(exc)) if isinstance(exc, JournalError) else exc))

        worker = threading.Thread(target=work, name="dflash-completions-client", daemon=True)
        writer = threading.Thread(target=write, name="dflash-completions-journal", daemon=True)
        worker.start()
        writer.start()
        faults_logged = 0
        last_log = time.monotonic()
        try:
            while True:
                try:
                    kind, obj = commits.get(timeout=1.0)
                except queue.Empty:
                    kind, obj = None, None
                for fault in client.faults[faults_logged:]:
                    context.log.warning(
                        f"server fault: {fault['server']}: {fault['fault']} "
                        f"({fault['in_flight']} requests in flight re-sent to the others)"
                    )
                faults_logged = len(client.faults)
                if time.monotonic() - last_log >= PROGRESS_EVERY_S:
                    context.log.info(self.progress_line())
                    last_log = time.monotonic()
                if kind == "commit":
                    yield from self.commit(obj)
                elif kind == "done":
                    break
                elif kind == "error":
                    if isinstance(obj, TooManyFailuresError):
                        self.failure = obj  # rows in flight were delivered: commit what completed, then fail
                        continue
                    raise obj
        except BaseException:
            client.abort()  # interrupted (Ctrl-C, SIGTERM, run terminated): stop sending, keep the journals
            worker.join(timeout=60)
            writer.join(timeout=60)  # rows already received are made durable
            raise
        worker.join()
        writer.join()
        context.log.info(self.progress_line())
        if chunker is not None:
            context.log.info(
                f"{chunker.rows_chunked} prompts of the run's end were generated in chunks of "
                f"{chunker.chunk_tokens} tokens: {chunker.follow_ups} continuation requests"
            )
        for fault in client.faults:
            context.log.warning(f"server fault during the run: {fault}")

    def commit(self, part: _Partition):
        """Write ``part``'s table (atomic), drop its journal, and yield its materialization: an
        AssetMaterialization of that partition in a range run (recorded at once), the step's result in
        a one-partition run. A partition none of whose rows succeeded yields nothing: it is noted in
        ``no_good_row`` and the run fails at its end, the journal kept."""
        prompts, pk = part.prompts, part.pk
        frame, set_aside = partition_frame(self.store, pk, prompts, part.existing)
        for index, reason in list(set_aside.items())[:20]:
            self.context.log.warning(
                f"{pk}: row {index} set aside at commit (stored as an error row, requested again "
                f"by the next run): {reason}"
            )
        if (message := no_good_row_message(frame.select("index", "error").to_dicts(), pk)) is not None:
            self.context.log.error(message)
            self.no_good_row[pk] = message
            return
        uri = self.store.write_parquet(frame, *partition_file(pk))
        part.journal.discard()
        data_version = hashlib.sha256(self.store.read_bytes(*partition_file(pk))).hexdigest()[:20]
        stats = completion_stats(frame)
        now = time.monotonic()
        if stats["errors"]:
            self.context.log.warning(f"{pk}: {stats['errors']} rows ended in error; the next run retries them")
        rows = [part.existing[i] for i in part.by_index]  # this run's rows of the partition
        # tokens generated by this run: a continued row's earlier tokens were made by an earlier one
        tokens = sum(
            (r.get("completion_tokens") or 0) - (r.get("continued_from_tokens") or 0)
            for r in rows
            if not r.get("error")
        )
        continued = [r for r in rows if r.get("continued_from_tokens")]
        wall = now - (part.first_sent or now)
        metadata = {
            **stats,
            # the corpus's version of this partition's prompts (prompt_index.partition_versions) the table answers
            "prompts_version": prompt_version(list(zip(prompts["index"].to_list(), prompts["content_hash"].to_list()))),
            "requested": len(part.todo),
            "request_reasons": dict(part.reasons),
            "carried_over": prompts.height - len(part.todo),
            "resumed_from_journal": part.resumed,
            "wall_s": round(wall, 2),
            "output_tok_per_s": round(tokens / wall, 1) if wall > 0 else 0.0,
            "req_per_s": round(len(rows) / wall, 2) if wall > 0 else 0.0,
            "servers": dict(Counter(r.get("server") for r in rows)),
            "continued": len(continued),
            "continued_tokens_reused": sum(r["continued_from_tokens"] for r in continued),
            # this run's and earlier runs' (one killed mid-raise, say): the table's own count
            "continued_in_table": int((frame["continued_from_tokens"] > 0).sum()),
            "cut_to_lowered_cap": part.cut,
            # rows the table could not take as they were (a count past its type, a lone surrogate): error rows now
            "rows_set_aside": len(set_aside),
            # rows of the run's end generated in chunks (inference.tail_chunk_tokens), and their requests
            "tail_chunked": sum(1 for r in rows if r.get("tail_chunks")),
            "tail_chunk_requests": sum(r.get("tail_chunks") or 0 for r in rows),
            "tail_chunked_in_table": int((frame["tail_chunks"] > 0).sum()),  # whichever run made them
            "output_tokens_generated": tokens,
            "max_output_tokens": self.settings.max_output_tokens,
            "settings": self.settings.model_dump(),
            "path": dg.MetadataValue.path(uri),
            "run_partitions": len(self.keys),
            "run_partition_range": f"{self.keys[0]}...{self.keys[-1]}",
        }
        if self.client is not None:
            progress = self.client.progress()
            eta = progress.eta_s(self.rows_total)
            metadata.update(
                run_rows_done=progress.rows_done,
                run_rows_total=self.rows_total,
                run_req_per_s=round(progress.requests_per_s, 2),
                run_output_tok_per_s=round(progress.output_tokens_per_s, 1),
                run_slots_in_flight=progress.in_flight,
                run_slots_capacity=self.capacity,
                run_eta_s=round(eta, 1) if eta is not None else -1.0,
                run_elapsed_s=round(now - self.started, 2),
            )
            faults = [
                f
                for f in self.client.faults
                if part.first_sent is None or f["at_s"] >= part.first_sent - self.client_started()
            ]
            if faults:
                metadata["server_faults"] = [f"{f['server']}: {f['fault']} -> {f['action']}" for f in faults]
        if self.exposure:
            metadata["security_warnings"] = self.exposure
        self.committed.append(pk)
        self.context.log.info(f"{pk}: committed {frame.height} rows (data version {data_version})")
        self.release(part)
        if len(self.keys) == 1:
            # a one-partition run ends with its output, as any asset: later assets in the same run
            # (the partition_stages job) run on it; without an output Dagster would skip them
            yield dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(data_version))
            return
        yield dg.AssetMaterialization(
            asset_key=self.context.asset_key,
            partition=pk,
            metadata=metadata,
            tags={
                DATA_VERSION_TAG: data_version,
                DATA_VERSION_IS_USER_PROVIDED_TAG: "true",
                CODE_VERSION_TAG: self.context.run.run_id,
            },
        )

    def release(self, part: _Partition) -> None:
        """Drop a committed (or kept) partition's rows from memory: a range over the whole corpus would
        otherwise hold every row's text to the run's end (~24 KB per 4,096-token row, ~20 GB for 900K)."""
        for i in part.by_index:
            self.continuing_rows.pop(i, None)
        part.existing = {}

    def client_started(self) -> float:
        """Monotonic time the client's counters started (its faults' ``at_s`` are relative to it)."""
        return time.monotonic() - self.client.progress().elapsed_s
