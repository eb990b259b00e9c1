"""A run of ``completions`` over one partition or a range of them (single-run backfill policy): the servers
start once for the whole run, the prompts of all its partitions go to the client as one stream
(:mod:`~dflash_assets.stages.completions.range_stream`), and each partition is committed as soon as its last
row is in: its table written atomically to ``completions/<pk>.parquet``, its journal removed, and a
:class:`~dflash_assets.generation.rows.range_plan.PartitionComplete` yielded, which the asset records as the
partition's materialization while the run goes on.

Row-level checkpoints: each finished row is appended (fsync) to ``completions/<pk>.journal.jsonl`` as it
arrives; a rerun reads the journal and the last partition table and requests only rows that are missing, no
longer valid under the current generation settings, or made for another prompt than the corpus's at their
index (each row carries ``prompt_hash``; see :func:`~dflash_assets.generation.rows.range_plan.plan_requests`).

No Dagster here: what the run needs from the Dagster instance comes in as callables.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import polars as pl

from dflash_assets.common.cost import GenerationMeter, generation_devices
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.cap_cut import cut_rows
from dflash_assets.data.prompt_index import prompt_version
from dflash_assets.generation.rows.continuation import continuable
from dflash_assets.generation.rows.range_plan import (
    Partition,
    PartitionComplete,
    plan_requests,
    prompt_length,
    prompt_lengths,
)
from dflash_assets.generation.rows.records import (
    PROMPT_TOO_LONG,
    invalid_reason,
    no_good_row_message,
    prompt_mismatch,
    row_problem,
    too_long_reason,
    too_long_row,
)
from dflash_assets.stages.completions.continuing import ContinuationPlanner, check_tool_rendering, load_target_builder
from dflash_assets.stages.completions.range_stream import stream_partitions
from dflash_assets.stages.completions.tables import (
    completion_stats,
    load_plan_rows,
    partition_file,
    partition_frame,
    table_rows,
)

if TYPE_CHECKING:
    from dflash_assets.stages.resources.inference import InferenceServerResource
    from dflash_assets.stages.resources.storage import StorageResource


def close_journals(journals: list, failing: BaseException | None, log) -> None:
    """Close every journal (a clean stop syncs it to S3), even when one fails.

    Args:
        failing: the error that ended the run, if any: it stays the raised error, and a failed sync is
            logged and added to it as a note (the rows stay in the local journals for the next run).
        log: has ``error``.

    Raises:
        Exception: the first close error when nothing else failed (e.g. ``StorageError``; the others are
            logged).
    """
    errors = []
    for journal in journals:
        try:
            journal.close()
        except Exception as exc:
            errors.append(exc)
    if not errors:
        return
    text = "; ".join(f"{type(e).__name__}: {e}" for e in errors)
    if failing is None:
        if len(errors) > 1:
            log.error(f"final journal syncs failed (rows kept in the local journals): {text}")
        raise errors[0]
    note = f"also, the final journal sync failed (rows kept in the local journals, synced by the next run): {text}"
    log.error(note)
    failing.add_note(note)


class RangeRun:
    """Generation of the partitions of one run; commits each partition as soon as it is complete."""

    def __init__(
        self,
        log,
        store,
        settings: GenerationSettings,
        keys: list[str],
        *,
        kept_version: Callable[[str], str | None] | None = None,
        failed_since: Callable[[list[str]], set[str]] | None = None,
        exposure: list[str] | None = None,
        chat_template=None,
    ):
        """``log``: ``info``/``warning`` (the asset's log). ``store``: the opened storage. ``kept_version(pk)``:
        the data version of the partition's latest materialization when it is up to date by
        :mod:`dflash_assets.orchestration.freshness`, else None (a table with that version is kept, not
        committed again).
        ``failed_since(pks)``: those another run planned after their latest materialization (committed
        again, never kept). ``exposure``: the inference servers' security warnings, kept in metadata.
        ``chat_template``: ``target_model.chat_template``'s file (servers and tokenizer render with it), or None."""
        self.chat_template = chat_template
        self.log, self.store, self.settings, self.keys = log, store, settings, keys
        self.kept_version, self.failed_since = kept_version, failed_since
        self.started = time.monotonic()
        self.rows_total = 0
        self.parts: list[Partition] = []
        self.committed: list[str] = []
        self.no_good_row: dict[str, str] = {}  # partitions whose every row ended in error -> failure message
        self.failure: Exception | None = None
        self.client = None
        self.capacity = 0
        self.exposure: list[str] = list(exposure or [])  # logged by serve(), kept in metadata
        self.continuing = 0  # rows this run continues rather than regenerates
        self.continuing_rows: dict[int, dict] = {}  # index -> the cut row, until its partition is committed
        self.failed_since_materialized: set[str] = set()  # never "kept": their status must go back to done
        self._builder = None  # the target tokenizer's SequenceBuilder (False: it did not load)
        self._length_note = False  # the run log said once that prompt lengths are not checked
        self.meter: GenerationMeter | None = None  # device-seconds per partition (dflash_assets.common.cost)
        self.serve_started: float | None = None  # monotonic time the servers were asked to start

    def run(
        self, prompts_by_pk: dict[str, pl.DataFrame], storage: StorageResource, inference: InferenceServerResource
    ) -> Iterator[PartitionComplete]:
        """Plan every partition, keep or commit those with nothing to request, then start the servers and
        stream the rest, yielding each partition's event as it is done. Journals are closed however it
        ends; :meth:`failure_message` then says whether the run failed."""
        keys, settings = self.keys, self.settings
        parts = self.parts
        failing: BaseException | None = None
        self.meter = GenerationMeter(*generation_devices(inference))
        try:  # a corpus with tool rows needs a target template that renders tools: checked before anything else
            for prompts in prompts_by_pk.values():  # the first partition with tool rows decides (one load)
                if (tooled := check_tool_rendering(inference, self.chat_template, prompts)) is not None:
                    self._builder = tooled
                    break
            for pk, prompts in prompts_by_pk.items():
                journal = storage.open_journal("completions", f"{pk}.journal.jsonl")
                parts.append(self.plan(pk, prompts, journal, inference))
            if len(keys) > 1 and self.failed_since is not None:  # only a range run keeps an unchanged partition
                self.failed_since_materialized = self.failed_since([p.pk for p in parts if not p.todo])
            for part in parts:
                if not part.todo:
                    yield from self.commit_or_keep(part)
            todo = [p for p in parts if p.todo]
            if todo:
                label = keys[0] if len(keys) == 1 else f"{keys[0]}...{keys[-1]}"
                # the target's tokenizer (for continuing cut rows) loads while the servers start, not after
                with ThreadPoolExecutor(1, thread_name_prefix="dflash-continuations") as pool_planner:
                    planner = ContinuationPlanner(settings, self.chat_template)
                    planned = pool_planner.submit(planner.plan, inference, todo)
                    self.serve_started = time.monotonic()
                    logs = storage.local_scratch("server_logs", label)
                    with inference.serve(log_dir=logs, settings=settings, chat_template=self.chat_template) as pool:
                        (continuing, opened, note, problem), (tail, tail_note, tail_problem) = planned.result()
                        self.continuing, self.continuing_rows = len(continuing), continuing
                        for line, warn in ((note, problem), (tail_note, tail_problem)):
                            if line:
                                (self.log.warning if warn else self.log.info)(line)
                        yield from self.generate(inference, pool, todo, opened, tail)
        except GeneratorExit:
            raise  # the consumer stopped early: a clean stop, a failed sync is the error then
        except BaseException as exc:
            failing = exc
            raise
        finally:
            close_journals([p.journal for p in parts], failing, self.log)

    def failure_message(self) -> str | None:
        """Why the run failed, once :meth:`run` has ended: partitions none of whose rows succeeded (not
        recorded, journals of error rows kept), or prompts left without a row (finished rows stay in the
        journals; the next run requests only the rest). None when every partition was committed or kept."""
        if self.no_good_row:
            return "; ".join(self.no_good_row.values())
        missing = {p.pk: p.remaining for p in self.parts if p.remaining}
        if self.failure is None and not missing:
            return None
        hint = (
            "; the run was continuing rows cut by a lower cap: if the servers reject continue_final_message, "
            "set inference.client.continue_truncated: false"
            if self.failure is not None and self.continuing
            else ""
        )
        return (
            f"{sum(missing.values())} prompts have no row in partition(s) {', '.join(missing) or '-'}"
            + (f" ({self.failure}{hint})" if self.failure else "")
            + f"; {len(self.committed)} partition(s) were committed; finished rows are checkpointed, "
            "rerun the partition to resume"
        )

    def generate(
        self,
        inference: InferenceServerResource,
        pool,
        parts: list[Partition],
        opened: bool,
        tail: tuple[int, bool] | None = None,
    ) -> Iterator[PartitionComplete]:
        """Stream every todo prompt of ``parts`` through one client (:func:`~dflash_assets.stages.completions.
        range_stream.stream_partitions`), yielding each partition's event as its last row lands."""
        yield from stream_partitions(self, inference, pool, parts, opened, tail)

    def plan(self, pk: str, prompts: pl.DataFrame, journal, inference: InferenceServerResource) -> Partition:
        view, existing = load_plan_rows(self.store, pk, journal)
        # rows of other prompts are dropped here, so no cut, continuation or commit ever sees them
        hashes = dict(zip(prompts["index"].to_list(), prompts["content_hash"].to_list()))
        ids = dict(zip(prompts["index"].to_list(), prompts["prompt_id"].to_list()))
        other = {
            i
            for i, row in view.items()
            if prompt_mismatch(row, {"content_hash": hashes.get(i), "prompt_id": ids.get(i)}) is not None
        }
        todo, reasons, why = plan_requests(prompts, view, self.settings)
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
        todo, too_long = self.set_aside_too_long(pk, todo, view, existing, inference)
        for i in too_long:
            reasons[why[i]] -= 1
        reasons = Counter({k: v for k, v in reasons.items() if v > 0})
        kept = set(prompts["index"].to_list()) - {p["index"] for p in todo} - set(too_long)
        part = Partition(
            pk,
            prompts,
            journal,
            existing,
            todo,
            reasons,
            remaining=len(todo),
            cut=cut_here,
            too_long=len(too_long),
            resumed=len(kept & journaled),
            by_index={p["index"]: p for p in todo},
        )
        self.rows_total += len(todo)
        self.log.info(
            f"{pk}: {prompts.height} prompts, {len(todo)} to request {dict(reasons)}, "
            f"cap {self.settings.max_output_tokens}"
            + (f"; {part.resumed} rows kept from the journal of an interrupted run" if part.resumed else "")
        )
        return part

    def set_aside_too_long(
        self, pk: str, todo: list[dict], view: dict[int, dict], existing: dict[int, dict], inference
    ) -> tuple[list[dict], dict[int, str]]:
        """Prompts of ``todo`` whose templated length leaves no room for the cap under the servers' context
        (:meth:`~dflash_assets.common.settings.GenerationSettings.prompt_room`), set aside before anything is
        sent: each becomes a :func:`~dflash_assets.generation.rows.records.too_long_row` in ``existing`` (written
        by the commit; not journaled: the next run judges it again at no cost). Lengths: a stored row's
        ``prompt_tokens`` for this prompt under this sampling (the server's count, or an earlier set-aside's),
        else the target's tokenizer once per prompt (:meth:`~dflash_assets.data.tokenization.SequenceBuilder.
        prompt_lengths`). Returns the prompts still to send and ``{index: reason}`` of those set aside. Nothing
        is set aside when the context is unknown or the tokenizer does not load (a warning, once per run)."""
        room = self.settings.prompt_room(inference.backend())
        if room is None or not todo:
            if room is None and todo and not self._length_note:
                self._length_note = True
                self.log.info(
                    "prompt lengths are not checked before sending: the servers' context is not known (set "
                    "the mode's context_length / max_model_len; docs/configuration.md)"
                )
            return todo, {}
        builder = None
        if any(prompt_length(p, view, self.settings) is None for p in todo):
            builder = self.target_builder(inference, "prompts are sent without a length check")
            if builder is None:
                return todo, {}
        lengths = prompt_lengths(todo, view, self.settings, builder)
        too_long: dict[int, str] = {}
        for p in todo:
            if (n := lengths[p["index"]]) > room:
                existing[p["index"]] = too_long_row(p, self.settings, n)
                too_long[p["index"]] = too_long_reason(n, self.settings, room)
        if too_long:
            self.log.warning(
                f"{pk}: {len(too_long)} of {len(todo)} prompts set aside as too long, never sent (rows with "
                f"finish_reason {PROMPT_TOO_LONG}), e.g. row {next(iter(too_long))}: {next(iter(too_long.values()))}"
            )
        return [p for p in todo if p["index"] not in too_long], too_long

    def cut_locally(
        self,
        pk: str,
        todo: list[dict],
        view: dict[int, dict],
        existing: dict[int, dict],
        inference: InferenceServerResource,
    ) -> tuple[list[dict], int]:
        """Rows longer than a lowered cap, cut to their first cap tokens here instead of requested again
        (:mod:`dflash_assets.data.cap_cut`). The cut rows join ``existing``, which the commit writes;
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
        self.log.info(
            f"{pk}: {len(cut)} of {len(lowered)} rows longer than the lowered cap {self.settings.max_output_tokens} "
            "cut to it from their own tokens (no request)" + (f"; requested again: {dict(why_not)}" if why_not else "")
        )
        return [p for p in todo if p["index"] not in cut], len(cut)

    def target_builder(
        self,
        inference: InferenceServerResource,
        without: str = "rows longer than the lowered cap are requested again, not cut locally",
    ):
        """A SequenceBuilder on the target's tokenizer, loaded once per run; None (a warning, once, saying
        what is done ``without`` it) when it does not load."""
        if self._builder is None:
            try:
                self._builder = load_target_builder(inference, self.chat_template)
            except Exception as exc:
                self._builder = False
                self.log.warning(
                    f"{without}: the target's tokenizer did not load from the configured path "
                    f"({type(exc).__name__}: {str(exc)[:200]})"
                )
        return self._builder or None

    def commit_or_keep(self, part: Partition):
        """A partition with nothing to request: in a range run, an unchanged table whose latest
        materialization has this data version and is up to date by :mod:`dflash_assets.orchestration.freshness` (made
        for the corpus's prompts of the range, under these settings; ``kept_version``) is kept as is (no new
        materialization, so downstream stays fresh); otherwise it is committed."""
        if (
            len(self.keys) > 1
            and not part.cut
            and not part.too_long
            and part.pk not in self.failed_since_materialized
            and self.store.exists(*partition_file(part.pk))
            and not part.journal.load()
        ):
            version = hashlib.sha256(self.store.read_bytes(*partition_file(part.pk))).hexdigest()[:20]
            if self.kept_version is not None and self.kept_version(part.pk) == version:
                self.log.info(f"{part.pk}: complete and unchanged (data version {version}): kept")
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

    def commit(self, part: Partition):
        """Write ``part``'s table (atomic), drop its journal, and yield its :class:`PartitionComplete` (the
        asset records it at once). A partition none of whose rows succeeded yields the event with its
        ``failure``: it is noted in ``no_good_row`` and the run fails at its end, the journal kept."""
        prompts, pk = part.prompts, part.pk
        frame, set_aside = partition_frame(self.store, pk, prompts, part.existing)
        for index, reason in list(set_aside.items())[:20]:
            self.log.warning(
                f"{pk}: row {index} set aside at commit (stored as an error row, requested again "
                f"by the next run): {reason}"
            )
        if (message := no_good_row_message(frame.select("index", "error").to_dicts(), pk)) is not None:
            self.no_good_row[pk] = message
            yield PartitionComplete(pk, failure=message)
            return
        uri = self.store.write_parquet(frame, *partition_file(pk))
        part.journal.discard()
        data_version = hashlib.sha256(self.store.read_bytes(*partition_file(pk))).hexdigest()[:20]
        stats = completion_stats(frame)
        now = time.monotonic()
        if stats["errors"]:
            self.log.warning(f"{pk}: {stats['errors']} rows ended in error; the next run retries them")
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
            # prompts this run set aside as too long for the context, never sent (the table's count: prompt_too_long)
            "set_aside_too_long": part.too_long,
            "context_length": self.settings.context_length,
            # rows the table could not take as they were (a count past its type, a lone surrogate): error rows now
            "rows_set_aside": len(set_aside),
            # rows of the run's end generated in chunks (inference.client.tail_chunk_tokens), and their requests
            "tail_chunked": sum(1 for r in rows if r.get("tail_chunks")),
            "tail_chunk_requests": sum(r.get("tail_chunks") or 0 for r in rows),
            "tail_chunked_in_table": int((frame["tail_chunks"] > 0).sum()),  # whichever run made them
            "output_tokens_generated": tokens,
            "max_output_tokens": self.settings.max_output_tokens,
            "settings": self.settings.model_dump(),
            "path": uri,
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
                seed_honoured=self.client.origin.get("seed_honoured", "unknown"),  # servers/origin.py
            )
            faults = [
                f
                for f in self.client.faults
                if part.first_sent is None or f["at_s"] >= part.first_sent - self.client_started()
            ]
            if faults:
                metadata["server_faults"] = [f"{f['server']}: {f['fault']} -> {f['action']}" for f in faults]
        if self.meter is not None:
            generating = self.client_started() if self.client is not None else None
            if generating is not None and self.serve_started is not None and not self.meter.startup_s:
                self.meter.startup_s = max(0.0, generating - self.serve_started)
            metadata.update(self.meter.metadata(now, generating, rows))
        if self.exposure:
            metadata["security_warnings"] = self.exposure
        self.committed.append(pk)
        self.log.info(f"{pk}: committed {frame.height} rows (data version {data_version})")
        self.release(part)
        yield PartitionComplete(pk, data_version, metadata)

    def release(self, part: Partition) -> None:
        """Drop a committed (or kept) partition's rows from memory: a range over the whole corpus would
        otherwise hold every row's text to the run's end (~24 KB per 4,096-token row, ~20 GB for 900K)."""
        for i in part.by_index:
            self.continuing_rows.pop(i, None)
        part.existing = {}

    def client_started(self) -> float:
        """Monotonic time the client's counters started (its faults' ``at_s`` are relative to it)."""
        return time.monotonic() - self.client.progress().elapsed_s
