"""``completions`` with ``mode: on_policy``: the target runs the corpus's BFCL tasks as the assistant, turn after
turn, against each task's executable tools (:class:`~dflash_assets.data.on_policy.Trajectory`), instead of
regenerating one reply per corpus row (``ops.completions.config.mode``:
:class:`~dflash_assets.stages.completions.config.CompletionsConfig`). No Dagster here.

A conversation is run by the partition holding its first corpus row (the smallest index of its
``conversation_id``), once, whichever rows ``turns`` made of it; corpus rows of other sources have no environment
and are not run in this mode (counted in the metadata). Each assistant turn is a row (``index``:
:func:`~dflash_assets.data.on_policy.row_key`), appended (fsync) to ``completions/<pk>.on_policy.journal.jsonl``
as soon as its reply is in; a rerun rebuilds each conversation from its rows (the calls executed again, nothing
re-sent) and goes on at the first turn without one. Once every conversation of the partition is done, its table
``completions/<pk>.on_policy.parquet`` is written (atomic), after checking that the project's rendering of every
row's context is the server's ``prompt_token_ids``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import polars as pl

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.bfcl import SOURCE_PREFIX, BfclError, BfclTask, load_tasks
from dflash_assets.data.on_policy import (
    ON_POLICY_COLUMNS,
    ON_POLICY_SCHEMA,
    Trajectory,
)
from dflash_assets.data.prompt_index import prompt_version
from dflash_assets.data.tool_sandbox import ToolSandbox
from dflash_assets.generation.client.results import TooManyFailuresError
from dflash_assets.generation.engines.chat_render import check_prompt_tokens
from dflash_assets.generation.rows.journal import JournalError
from dflash_assets.generation.rows.range_plan import PartitionComplete, RangeRunError
from dflash_assets.generation.rows.records import (
    PROMPT_TOO_LONG,
    THINK_CLOSE,
    invalid_reason,
    row_problem,
    too_long_reason,
    too_long_row,
)
from dflash_assets.stages.completions.config import CompletionsConfig
from dflash_assets.stages.completions.continuing import check_tool_rendering, load_target_builder
from dflash_assets.stages.completions.tables import completion_stats
from dflash_assets.stages.prompts import CORPUS_FILE

if TYPE_CHECKING:
    from dflash_assets.data.tokenization import SequenceBuilder
    from dflash_assets.generation.client.results import CompletionResult
    from dflash_assets.stages.resources.inference import InferenceServerResource
    from dflash_assets.stages.resources.storage import StorageResource

__all__ = ["OnPolicyRun", "conversation_anchors", "journal_name", "table_file"]

#: Corpus sources whose conversations have an environment: ``bfcl:<category>`` files are named ``bfcl_<category>``.
BFCL_SOURCE = SOURCE_PREFIX.rstrip(":") + "_"
#: ``finish_reason`` of a reply whose tool calls a server's tool-call parser took out of its text: the model's own
#: markup is gone from ``content`` (:func:`with_own_text` reads it back from the output ids).
PARSED_CALLS = "tool_calls"
PARSED_CALLS_ERROR = (
    "the server parsed the tool calls out of the reply (finish_reason tool_calls) and returned no output token ids "
    "to read the model's own text back from: serve the target without a tool-call parser (no --tool-call-parser / "
    "--enable-auto-tool-choice), as the servers this project starts run, or with token ids returned"
)


def with_own_text(result: CompletionResult, builder: SequenceBuilder) -> CompletionResult | None:
    """``result`` of a server whose tool-call parser took the calls out of the text, with the model's own text
    back as ``content``: its output ids decoded (a trailing end token dropped; when the server split the thinking
    off, what follows its ``</think>``), ``finish_reason`` ``stop`` (the model ended its turn). The context of the
    next turn then holds the markup exactly as generated, never the parsed calls rendered again. None when the
    reply has no output ids."""
    ids = list(result.output_token_ids or [])
    if not ids:
        return None
    if ids[-1] in (builder.end_token_id, builder.tokenizer.eos_token_id):
        ids = ids[:-1]
    text = builder.tokenizer.decode(ids, skip_special_tokens=False)
    if result.reasoning_content is not None:
        text = text.split(THINK_CLOSE, 1)[1].lstrip("\n") if THINK_CLOSE in text else ""
    return dataclasses.replace(result, content=text, finish_reason="stop")


def on_policy_row_problem(row: dict) -> str | None:
    """Why an on-policy row cannot be stored as it is (:func:`~dflash_assets.generation.rows.records.row_problem`, and
    its own text columns: text, valid Unicode), or None."""
    if (problem := row_problem(row)) is not None:
        return problem
    for name, dtype in ON_POLICY_COLUMNS.items():
        value = row.get(name)
        if value is None or dtype != pl.String:
            continue
        if not isinstance(value, str):
            return f"{name} is a {type(value).__name__}, not text"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"{name} holds a lone surrogate at character {exc.start:,} (not valid Unicode)"
    return None


def table_file(pk: str) -> tuple[str, str]:
    """Where partition ``pk``'s on-policy rows are stored."""
    return ("completions", f"{pk}.on_policy.parquet")


def journal_name(pk: str) -> str:
    return f"{pk}.on_policy.journal.jsonl"


def conversation_anchors(store) -> dict[str, int]:
    """``{conversation_id: first corpus index}`` of every BFCL conversation of the corpus (three columns read)."""
    corpus = store.read_parquet(*CORPUS_FILE, columns=["index", "source", "conversation_id"])
    firsts = (
        corpus.filter(pl.col("source").str.starts_with(BFCL_SOURCE))
        .group_by("conversation_id")
        .agg(pl.col("index").min())
    )
    return dict(zip(firsts["conversation_id"].to_list(), firsts["index"].to_list()))


@dataclass
class OnPolicyPartition:
    """One partition's conversations: ``trajectories`` (each rebuilt from its stored rows), ``rows`` by key (kept
    and new), what was ``resumed`` (rows kept), ``failed`` conversations (id -> the error that stopped them),
    ``set_aside`` conversations (id -> why they cannot run) and corpus rows ``without_environment``."""

    pk: str
    journal: Any
    trajectories: list[Trajectory] = field(default_factory=list)
    rows: dict[int, dict] = field(default_factory=dict)
    resumed: int = 0
    generated: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    set_aside: dict[str, str] = field(default_factory=dict)
    without_environment: int = 0
    ended_at_context: int = 0
    prompts_version: str | None = None


class OnPolicyRun:
    """The on-policy generation of the partitions ``keys`` (one server start for all of them).

    ``log``: ``info``/``warning``; ``store``: the opened storage; ``config``: the stage's
    :class:`CompletionsConfig`; ``chat_template``: ``target_model.chat_template``'s file (servers and tokenizer
    render with it), or None."""

    def __init__(
        self,
        log,
        store,
        settings: GenerationSettings,
        keys: list[str],
        config: CompletionsConfig,
        *,
        chat_template=None,
    ):
        self.log, self.store, self.settings, self.keys = log, store, settings, keys
        self.config, self.chat_template = config, chat_template
        self.parts: list[OnPolicyPartition] = []
        self.failure: Exception | None = None
        self.sandbox: ToolSandbox | None = None
        self._tasks: dict[str, dict[str, BfclTask]] = {}

    def run(
        self, prompts_by_pk: dict[str, pl.DataFrame], storage: StorageResource, inference: InferenceServerResource
    ) -> Iterator[PartitionComplete]:
        """Plan every partition, generate every unfinished conversation, then commit each partition whose
        conversations all ended (the others keep their journal: :meth:`failure_message` says why).

        Raises:
            RangeRunError: the target's template cannot render tools, or a row's context is not the server's
                prompt tokens (nothing of that partition written; its journal kept).
        """
        builder = None
        self.sandbox = ToolSandbox(self.config.tool_timeout_s, self.config.max_tool_result_kb * 1024)
        try:
            for prompts in prompts_by_pk.values():
                builder = builder or check_tool_rendering(inference, self.chat_template, prompts)
            anchors = conversation_anchors(self.store)
            for pk, prompts in prompts_by_pk.items():
                journal = storage.open_journal("completions", journal_name(pk))
                self.parts.append(self.plan(pk, prompts, journal, anchors))
            todo = [(part, t) for part in self.parts for t in part.trajectories if not t.done]
            if builder is None and (todo or any(p.rows for p in self.parts)):
                builder = load_target_builder(inference, self.chat_template)
            if todo:
                logs = storage.local_scratch("server_logs", self.keys[0] if len(self.keys) == 1 else "on_policy")
                with inference.serve(log_dir=logs, settings=self.settings, chat_template=self.chat_template) as pool:
                    self.generate(inference, pool, todo, builder)
            for part in self.parts:
                yield self.commit(part, builder)
        finally:
            self.sandbox.close()
            for part in self.parts:
                part.journal.close()

    def tasks(self, category: str) -> dict[str, BfclTask]:
        if category not in self._tasks:
            self._tasks[category] = {t.id: t for t in load_tasks(category)}
        return self._tasks[category]

    def plan(self, pk: str, prompts: pl.DataFrame, journal, anchors: dict[str, int]) -> OnPolicyPartition:
        """The partition's conversations, each rebuilt from its stored rows (the table's, then the journal's)."""
        part = OnPolicyPartition(pk, journal)
        part.prompts_version = prompt_version(list(zip(prompts["index"].to_list(), prompts["content_hash"].to_list())))
        stored: dict[int, dict] = {}
        if self.store.exists(*table_file(pk)):
            stored = {r["index"]: r for r in self.store.read_parquet(*table_file(pk)).iter_rows(named=True)}
        stored.update(journal.load())
        bfcl = prompts.filter(pl.col("source").str.starts_with(BFCL_SOURCE))
        part.without_environment = prompts.height - bfcl.height
        for anchor in bfcl.iter_rows(named=True):
            cid = anchor["conversation_id"]
            if anchors.get(cid) != anchor["index"]:
                continue  # a later row of a conversation: its trajectory makes every turn
            try:
                task = self.tasks(anchor["source"][len(BFCL_SOURCE) :]).get(cid.split(":", 1)[-1])
            except BfclError as exc:  # a user's own file named bfcl_<something>, say
                part.set_aside[cid] = str(exc)
                continue
            if task is None:
                part.set_aside[cid] = "no BFCL task of this id in the installed bfcl-eval"
                continue
            t = Trajectory(
                task,
                anchor["tools"],
                anchor,
                self.config.max_rounds_per_user_turn,
                self.config.max_turns_per_conversation,
                env=self.sandbox.environment(f"{pk}/{cid}", task) if self.sandbox is not None else None,
                max_result_bytes=self.config.max_tool_result_kb * 1024,
            )
            while not t.done and (row := stored.get(t.key)) is not None:
                key = t.key
                if row.get("error") or invalid_reason(row, self.settings) is not None:
                    break  # this turn and the later ones are generated again
                if row.get("finish_reason") == PROMPT_TOO_LONG:  # judged under this cap and context: still ended
                    if row.get("prompt_hash") != t.context_hash() or row.get("turn") != t.turn:
                        break
                    t.end("context")
                    part.ended_at_context += 1
                elif not t.replay(row):
                    break
                part.rows[key] = row
                part.resumed += 1
            part.trajectories.append(t)
        done = sum(t.done for t in part.trajectories)
        self.log.info(
            f"{pk}: {len(part.trajectories)} on-policy conversations ({done} finished), {part.resumed} turns kept "
            f"from earlier runs; {part.without_environment} corpus rows of other sources are not run in this mode"
        )
        for cid, why in part.set_aside.items():
            self.log.warning(f"{pk}: conversation {cid} not run: {why}")
        if not part.trajectories and not part.set_aside:
            self.log.warning(
                f"{pk}: no BFCL conversation starts in this partition: mode on_policy writes an empty table for it "
                "(only 'bfcl:' sources have an environment; docs/configuration.md, on-policy trajectories)"
            )
        return part

    def generate(
        self, inference: InferenceServerResource, pool, todo: list[tuple[OnPolicyPartition, Trajectory]], builder
    ):
        """Run the conversations of ``todo`` to their ends through one client: each conversation has one request
        in flight at a time (its next turn is a follow-up of its last, to the same server); each turn's row is
        journaled as its reply arrives.

        Each turn is length-checked before it is sent, as regenerate mode checks a prompt: one whose templated
        context leaves no room for the cap under the servers' context ends its conversation with a
        ``prompt_too_long`` row, never sent. A reply's tool calls run on a worker thread (the sandbox bounds
        them), so the event loop, the request timeouts and the stall watch go on meanwhile. A turn that cannot
        be taken (its row fails the row check, a tool raises past the sandbox) fails that conversation only; a
        journal that cannot be written stops the run."""
        settings = self.settings
        client = inference.completion_client(pool)
        by_index = {t.anchor["index"]: (part, t) for part, t in todo}
        room = settings.prompt_room(inference.backend())
        tools_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="on-policy-tools")

        def next_body(part: OnPolicyPartition, t: Trajectory) -> dict | None:
            """The next turn's request, or None when its context leaves no room (its too-long row journaled)."""
            if room is not None and builder is not None:
                n = builder.prompt_lengths([t.messages], settings.enable_thinking, [t.tools])[0]
                if n > room:
                    prompt = {
                        "index": t.key,
                        "prompt_id": f"{t.anchor['conversation_id']}#on_policy{t.turn}",
                        "content_hash": t.context_hash(),
                        "source": t.anchor["source"],
                        "turn_kind": t.kind,
                    }
                    row = too_long_row(prompt, settings, n)
                    row.update(conversation_id=t.anchor["conversation_id"], turn=t.turn, tools=t.tools)
                    row["messages"] = json.dumps(t.messages, ensure_ascii=False)
                    self.log.warning(
                        f"{t.anchor['conversation_id']}: ended at turn {t.turn}, not sent: "
                        f"{too_long_reason(n, settings, room)}"
                    )
                    part.journal.append(row)
                    part.rows[row["index"]] = row
                    t.end("context")
                    part.ended_at_context += 1
                    return None
            return pool.adapt_body(t.request_body(settings, pool.model))

        def items():
            for part, t in todo:
                if (body := next_body(part, t)) is not None:
                    yield t.anchor["index"], body

        async def follow_up(result):
            part, t = by_index[result.index]
            cid = t.anchor["conversation_id"]
            if not result.ok and result.context_refused:  # the conversation outgrew the servers' context
                t.end("context")
                part.ended_at_context += 1
                self.log.warning(f"{cid}: ended at turn {t.turn}, its context no longer fits: {result.error[:300]}")
                return None
            if not result.ok:
                part.failed[cid] = result.error
                return None
            if result.finish_reason == PARSED_CALLS and (result := with_own_text(result, builder)) is None:
                part.failed[cid] = PARSED_CALLS_ERROR
                return None
            turn = t.turn
            try:  # the reply's tool calls execute here, off the event loop
                row = await asyncio.get_running_loop().run_in_executor(tools_thread, t.row, result, settings)
            except Exception as exc:  # one turn costs its conversation, never the run
                part.failed[cid] = f"turn {turn} could not be taken: {type(exc).__name__}: {str(exc)[:300]}"
                return None
            if (problem := on_policy_row_problem(row)) is not None:
                part.failed[cid] = f"turn {row['turn']} could not be stored: {problem}"
                return None
            try:
                part.journal.append(row)  # durable before the conversation goes on
            except JournalError:
                raise
            except (TypeError, ValueError) as exc:  # UnicodeEncodeError included: nothing was written
                part.failed[cid] = f"turn {row['turn']} could not be stored: {str(exc)[:300]}"
                return None
            part.rows[row["index"]] = row
            part.generated += 1
            return None if t.done else next_body(part, t)

        started = time.monotonic()
        try:
            client.generate_blocking(items(), lambda result: None, follow_up)
        except TooManyFailuresError as exc:
            self.failure = exc
        finally:
            tools_thread.shutdown(wait=True)
        progress = client.progress()
        timeouts = self.sandbox.timeouts if self.sandbox is not None else 0
        self.log.info(
            f"on-policy: {sum(p.generated for p in self.parts)} turns generated in {time.monotonic() - started:.1f} s "
            f"({progress.output_tokens} output tokens, {progress.rows_failed} stopped by a failed request, "
            f"{timeouts} tool calls stopped at {self.config.tool_timeout_s:g} s)"
        )

    def commit(self, part: OnPolicyPartition, builder) -> PartitionComplete:
        """Write the partition's table (atomic) and drop its journal, once each of its conversations ended; else a
        :class:`PartitionComplete` with the failure (journal kept, the next run resumes it).

        Raises:
            RangeRunError: a row's context is not the server's prompt tokens (PromptTokensMismatch's message).
        """
        pk = part.pk
        unfinished = [t.anchor["conversation_id"] for t in part.trajectories if not t.done]
        if unfinished:
            first = next(iter(part.failed.items()), (unfinished[0], str(self.failure or "not generated")))
            return PartitionComplete(
                pk,
                failure=f"{pk}: {len(unfinished)} on-policy conversations did not end (first: {first[0]}: "
                f"{str(first[1])[:300]}); their finished turns are journaled: rerun the partition to resume",
            )
        rows = sorted(part.rows.values(), key=lambda r: r["index"])
        checked = 0
        if rows:
            built = builder.build_many(rows, [json.loads(r["messages"]) for r in rows], [r["tools"] for r in rows])
            pairs = [(r, b[0][: b[1]]) for r, b in zip(rows, built) if isinstance(b, tuple)]
            try:
                checked = check_prompt_tokens(*zip(*pairs), decode=builder.tokenizer.decode) if pairs else 0
            except ValueError as exc:  # PromptTokensMismatch: stored rows replay as they are, so say how to drop them
                raise RangeRunError(
                    f"{pk}: {exc} (on-policy rows are replayed from completions/{journal_name(pk)} and "
                    f"{'/'.join(table_file(pk))}: remove both to generate the partition's conversations again)"
                ) from None
        frame = pl.DataFrame(rows, schema=ON_POLICY_SCHEMA) if rows else pl.DataFrame(schema=ON_POLICY_SCHEMA)
        uri = self.store.write_parquet(frame, *table_file(pk))
        part.journal.discard()
        data_version = hashlib.sha256(self.store.read_bytes(*table_file(pk))).hexdigest()[:20]
        calls = [json.loads(r.get("tool_messages") or "[]") for r in rows]  # a prompt_too_long row has none
        metadata = {
            # what freshness reads of any completions partition: the corpus version it answers, the row counts,
            # the settings fingerprints and caps of its rows (a corpus or settings change makes it stale)
            **completion_stats(frame),
            "prompts_version": part.prompts_version,
            "mode": "on_policy",
            "conversations": len(part.trajectories),
            "conversations_set_aside": len(part.set_aside),
            # conversations the server refused to go on with, their context grown past its own (run again by a rerun)
            "conversations_ended_at_context": part.ended_at_context,
            "rows": len(rows),
            "rows_per_turn_kind": dict(sorted(Counter(r["turn_kind"] for r in rows).items())),
            "tool_call_turns": sum(bool(c) for c in calls),
            "tool_calls": sum(len(c) for c in calls),
            "tool_error_results": sum(1 for c in calls for m in c if m["content"].startswith('{"error"')),
            "turns_resumed": part.resumed,
            "turns_generated": part.generated,
            "corpus_rows_without_environment": part.without_environment,
            "prompt_ids_checked": checked,
            "output_tokens": sum(r["completion_tokens"] or 0 for r in rows),
            "max_rounds_per_user_turn": self.config.max_rounds_per_user_turn,
            "max_turns_per_conversation": self.config.max_turns_per_conversation,
            # what freshness reads when those limits or the servers' context change: the conversations they cut
            "conversations_ended_at_max_turns": sum(t.ended_by == "max_turns" for t in part.trajectories),
            "conversation_turns_max": max((t.turn for t in part.trajectories), default=0),
            "user_turns_ended_at_max_rounds": sum(t.rounds_capped for t in part.trajectories),
            "rounds_max": max((t.rounds_max for t in part.trajectories), default=0),
            "context_length": self.settings.context_length,
            "tool_timeout_s": self.config.tool_timeout_s,
            "max_tool_result_kb": self.config.max_tool_result_kb,
            "settings": self.settings.model_dump(),
            "path": uri,
        }
        self.log.info(f"{pk}: committed {len(rows)} on-policy rows (data version {data_version})")
        return PartitionComplete(pk, data_version, metadata)

    def failure_message(self) -> str | None:
        """Why the run failed once :meth:`run` has ended (partitions with conversations that did not end, and the
        first error that stopped one), or None."""
        left = {p.pk: sum(not t.done for t in p.trajectories) for p in self.parts}
        left = {pk: n for pk, n in left.items() if n}
        if not left:
            return None
        first = next(((cid, why) for p in self.parts for cid, why in p.failed.items()), None)
        cause = f"{first[0]}: {str(first[1])[:300]}" if first else str(self.failure or "")
        return (
            f"{sum(left.values())} on-policy conversations did not end in partition(s) {', '.join(left)}"
            + (f" (first: {cause})" if cause else "")
            + "; finished turns are journaled: rerun the partition to resume"
        )
