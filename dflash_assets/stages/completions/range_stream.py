"""The stream of a ``completions`` range run: one client sends every prompt of the run's partitions (each
slot stays busy across partition boundaries), a journal writer makes rows durable in groups, and the
caller's thread commits each partition as its last row is in. Three threads and two queues; see
:class:`PartitionStream`."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dflash_assets.common.progress import StageProgressBar
from dflash_assets.generation.client.results import TooManyFailuresError
from dflash_assets.generation.rows.continuation import NOT_CONTINUED, continuation_body, merge_continuation, prefix_text
from dflash_assets.generation.rows.journal import JournalError
from dflash_assets.generation.rows.range_plan import Partition, PartitionComplete, RangeRunError, StreamedRun
from dflash_assets.generation.rows.records import row_from_result, row_problem, set_aside_row
from dflash_assets.generation.rows.tail_chunks import TailChunker

if TYPE_CHECKING:
    from dflash_assets.stages.resources.inference import InferenceServerResource

PROGRESS_EVERY_S = 5.0


def context_hint(settings, inference: InferenceServerResource) -> str:
    """What a row the server refused as too long for its context adds to its error: the context this run
    judged the prompt against before sending it, and the setting to make it the servers' own."""
    keys = {"sglang": "sglang.context_length", "vllm": "vllm.max_model_len"}
    key = keys.get(inference.mode, "external.context_length")
    judged = f"context {settings.context_length:,}" if settings.context_length else "an unknown context"
    return (
        f" (this run sent it judging it to fit {judged} with cap {settings.max_output_tokens:,}: set "
        f"resources.inference.{key} to the servers' context; the next run judges the row again)"
    )


def stream_partitions(
    run: StreamedRun,
    inference: InferenceServerResource,
    pool,
    parts: list[Partition],
    opened: bool,
    tail: tuple[int, bool] | None = None,
) -> Iterator[PartitionComplete]:
    """Stream every todo prompt of ``parts`` through one client; yield each partition's
    :class:`PartitionComplete` as its last row lands (from this, the caller's thread: the asset records it
    at once). ``run.continuing_rows``, ``opened``: rows to continue rather than regenerate
    (:meth:`ContinuationPlanner.continuations`); each prefix is built as its request goes out, not all at once
    before the run. ``tail``: :meth:`ContinuationPlanner.tail`'s ``(chunk_tokens, opened)``: the stream's last
    ``tail_prompts_per_slot`` x slots fresh prompts are generated in chunks
    (:class:`~dflash_assets.generation.rows.tail_chunks.TailChunker`). More than ``max_consecutive_failures``
    continuations in a row answered afresh (:data:`NOT_CONTINUED`) stop the run (:class:`RangeRunError`): a
    server that ignores ``continue_final_message`` would waste every one."""
    yield from PartitionStream(run, inference, pool, parts, opened, tail).stream()


class PartitionStream:
    """One range run's stream (:func:`stream_partitions`), in three threads and two queues:

    - :meth:`send`, the client's event loop, sends :meth:`requests` and puts each result on ``results``;
    - :meth:`write`, the journal writer, makes rows durable in groups and puts each partition whose last row is
      durable on ``commits``;
    - :meth:`watch`, the caller's thread, reports progress and faults and commits each partition as it comes.

    :meth:`stream` starts the two threads, watches, and on any way out stops the client and joins them.
    """

    def __init__(
        self,
        run: StreamedRun,
        inference: InferenceServerResource,
        pool,
        parts: list[Partition],
        opened: bool,
        tail: tuple[int, bool] | None,
    ) -> None:
        self.run, self.inference, self.pool, self.parts, self.opened = run, inference, pool, parts, opened
        self.settings, self.log, self.continuing = run.settings, run.log, run.continuing_rows
        self.client = run.client = inference.completion_client(pool)
        run.capacity = self.client.concurrency
        self.owner = {i: part for part in parts for i in part.by_index}
        self.commits: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self.end = object()  # the last item on ``results``
        self.afresh_in_a_row = 0
        self.chunker = self._tail_chunker(tail)
        # a conversation's turns share its context: one server's prefix cache holds it for all of them (a
        # conversation with one row to send is routed as any prompt, to the least loaded server)
        self.turns = Counter(p.get("conversation_id") for part in parts for p in part.todo)

    def _tail_chunker(self, tail: tuple[int, bool] | None) -> TailChunker | None:
        """The chunker of the stream's last fresh prompts, or None (no ``tail``, or no prompt to chunk: said)."""
        if tail is None:
            return None
        client, log = self.client, self.log
        fresh_total = sum(1 for part in self.parts for p in part.todo if p["index"] not in self.continuing)
        # the first `concurrency` prompts start at once whatever is done: chunking them gains nothing
        per_slot = self.inference.client.tail_prompts_per_slot
        window = min(fresh_total - client.concurrency, round(per_slot * client.concurrency))
        if window > 0:
            log.info(
                f"the last {window} of {fresh_total} fresh prompts are generated in chunks of {tail[0]} "
                f"tokens ({per_slot:g} per slot), each continued once every fresh "
                "prompt has gone out"
            )
            return TailChunker(
                self.settings, self.pool.model, self.pool.adapt_body, tail[1], tail[0], window, fresh_total
            )
        if fresh_total <= client.concurrency:
            log.info(
                f"inference.client.tail_chunk_tokens: not used, the {fresh_total} fresh prompts fit in the "
                f"{client.concurrency} slots at once"
            )
        else:
            log.info(
                f"inference.client.tail_chunk_tokens: not used, tail_prompts_per_slot "
                f"{per_slot:g} x {client.concurrency} slots rounds to no prompt"
            )
        return None

    def stream(self) -> Iterator[PartitionComplete]:
        """Run the stream: start the client and the journal writer, watch them, yield each committed partition."""
        worker = threading.Thread(target=self.send, name="dflash-completions-client", daemon=True)
        writer = threading.Thread(target=self.write, name="dflash-completions-journal", daemon=True)
        worker.start()
        writer.start()
        bar = StageProgressBar(f"completions {self.run.keys[0]}...{self.run.keys[-1]}", self.run.rows_total)
        try:
            yield from self.watch(bar)
        except BaseException:
            self.client.abort()  # interrupted (Ctrl-C, SIGTERM, run terminated): stop sending, keep the journals
            worker.join(timeout=60)
            writer.join(timeout=60)  # rows already received are made durable
            raise
        finally:
            bar.close()
        worker.join()
        writer.join()
        self.report()

    def requests(self) -> Iterator[tuple[int, dict, str | None]]:
        """``(index, request body, route)`` of every todo prompt, partition by partition: a continued row's
        prefix is built as its request goes out; a conversation with several rows to send names its route."""
        settings, pool, chunker = self.settings, self.pool, self.chunker
        position = 0
        for part in self.parts:
            part.first_sent = time.monotonic()
            for p in part.todo:
                i = p["index"]
                if i in self.continuing:
                    row = self.continuing[i]
                    body = pool.adapt_body(
                        continuation_body(
                            settings, pool.model, p["messages"], row, prefix_text(row, self.opened), i, p.get("tools")
                        )
                    )
                else:
                    position += 1
                    body = pool.adapt_body(settings.request_body(pool.model, p["messages"], i, p.get("tools")))
                    if chunker is not None:
                        body = chunker.first_body(position, p, body)
                route = p.get("conversation_id")
                yield i, body, route if route is not None and self.turns[route] > 1 else None

    def send(self) -> None:
        """Thread 1, the client's event loop: results go to the journal writer, then the end mark."""
        try:
            follow_up = self.chunker.follow_up if self.chunker is not None else None
            self.client.generate_blocking(self.requests(), self.results.put, follow_up)
            self.results.put(self.end)
        except BaseException as exc:
            self.commits.put(("error", exc))
            self.results.put(self.end)  # the writer still makes the delivered rows durable, then says "done"

    def write(self) -> None:
        """Thread 2, the journal writer: group commit. Each fsync costs milliseconds (5.6 ms measured here); done
        on the event loop once per row it stalled every request at ~100 rows/s. Here all rows that arrived
        meanwhile share one write + fsync per partition; a row counts as finished once durable, and a partition
        is handed to the step's thread to commit when its last row is."""
        finished, stopped = False, False
        try:
            while not finished:
                batch, finished = self._next_batch()
                self._make_durable([self._row_of(result) for result in batch])
                if self.afresh_in_a_row >= self.inference.client.max_consecutive_failures and not stopped:
                    stopped = True  # the rows so far are durable (each keeps its cut text); stop sending
                    self._stop_answered_afresh()
            self.commits.put(("done", None))
        except BaseException as exc:
            self.client.abort()
            # the message names the journal, the cause and the fix: it is the run's failure, not a traceback's cause
            self.commits.put(("error", RangeRunError(str(exc)) if isinstance(exc, JournalError) else exc))

    def _next_batch(self) -> tuple[list, bool]:
        """The results that arrived (waiting for one, then up to 1,024 in all), and whether the end came."""
        batch = [self.results.get()]
        while len(batch) < 1024:
            try:
                batch.append(self.results.get_nowait())
            except queue.Empty:
                break
        return [r for r in batch if r is not self.end], any(r is self.end for r in batch)

    def _row_of(self, result) -> tuple[Partition, dict]:
        """The partition and row of ``result``: a chunked row's final one, a continued row merged, or a fresh
        one; set aside when it breaks the row contract. Counts continuations answered afresh in a row."""
        settings = self.settings
        part, prior = self.owner[result.index], self.continuing.get(result.index)
        prompt = part.by_index[result.index]
        row = self.chunker.final_row(result, prompt) if self.chunker is not None else None
        if row is None:
            row = (
                merge_continuation(prior, result, prompt, settings)
                if prior is not None
                else row_from_result(result, prompt, settings)
            )
        if (problem := row_problem(row)) is not None:  # the client checks replies; this is the floor
            row = set_aside_row(prompt, problem)
        elif result.context_refused and row.get("error"):
            row["error"] += context_hint(settings, self.inference)
        if prior is not None or row.get("tail_chunks"):  # servers that answer continuations afresh waste every one
            self.afresh_in_a_row = self.afresh_in_a_row + 1 if row.get("error") == NOT_CONTINUED else 0
        return part, row

    def _make_durable(self, rows_of: list[tuple[Partition, dict]]) -> None:
        """Append the rows to their partitions' journals (one write + fsync per partition); a partition whose
        last row is in goes to the step's thread to commit."""
        by_part: dict[str, list] = {}
        for part, row in rows_of:
            by_part.setdefault(part.pk, []).append(row)
        for rows in by_part.values():
            part = self.owner[rows[0]["index"]]
            part.journal.append_many(rows)
            for row in rows:
                part.existing[row["index"]] = row
            part.remaining -= len(rows)
            if part.remaining == 0:
                self.commits.put(("commit", part))

    def _stop_answered_afresh(self) -> None:
        """Stop sending: ``max_consecutive_failures`` continuations in a row were answered afresh."""
        self.client.abort()
        chunked = self.chunker is not None
        self.commits.put(
            (
                "error",
                RangeRunError(
                    f"{self.afresh_in_a_row} continuations in a row were answered afresh instead of continued: "
                    + NOT_CONTINUED
                    + (" (or inference.client.tail_chunk_tokens: 0)" if chunked else "")
                    + "; rows cut by a lower cap keep their text"
                    + (", rows of the run's end made in chunks are requested again whole" if chunked else "")
                ),
            )
        )

    def watch(self, bar: StageProgressBar) -> Iterator[PartitionComplete]:
        """The caller's thread: every second (or at each message) the progress bar, new server faults and, every
        :data:`PROGRESS_EVERY_S`, a progress line; each partition committed as it comes, until "done". A run
        stopped by too many failed rows commits what completed, then fails; any other error is raised."""
        client, log = self.client, self.log
        faults_logged = 0
        last_log = time.monotonic()
        while True:
            try:
                kind, obj = self.commits.get(timeout=1.0)
            except queue.Empty:
                kind, obj = None, None
            for fault in client.faults[faults_logged:]:
                log.warning(
                    f"server fault: {fault['server']}: {fault['fault']} "
                    f"({fault['in_flight']} requests in flight re-sent to the others)"
                )
            faults_logged = len(client.faults)
            progress = client.progress()
            bar.update_to(
                progress.rows_done,
                failed=progress.rows_failed,
                out_tok_s=f"{progress.output_tokens_per_s:.0f}",
                in_flight=progress.in_flight,
            )
            if time.monotonic() - last_log >= PROGRESS_EVERY_S:
                log.info(self.run.progress_line())
                last_log = time.monotonic()
            if kind == "commit":
                yield from self.run.commit(obj)
            elif kind == "done":
                break
            elif kind == "error":
                if isinstance(obj, TooManyFailuresError):
                    self.run.failure = obj  # rows in flight were delivered: commit what completed, then fail
                    continue
                raise obj

    def report(self) -> None:
        """The run's last lines: its progress, what the tail chunks took, every server fault."""
        log = self.log
        log.info(self.run.progress_line())
        if self.chunker is not None:
            log.info(
                f"{self.chunker.rows_chunked} prompts of the run's end were generated in chunks of "
                f"{self.chunker.chunk_tokens} tokens: {self.chunker.follow_ups} continuation requests"
            )
        for fault in self.client.faults:
            log.warning(f"server fault during the run: {fault}")
