"""Read prompt files of the common shapes, plain prompts and agentic tool conversations alike, into one clean,
indexed corpus (no Dagster imports).

Shapes (one record per JSONL line, JSON-array element or Parquet row):
- OpenAI ``messages``: ``[{"role": ..., "content": ...}, ...]``; an assistant message may carry ``tool_calls``
  (``[{"id", "type": "function", "function": {"name", "arguments"}}]``, arguments a JSON string or an object)
  and ``reasoning_content`` (kept as given); a ``tool`` message answers a call (``tool_call_id``, ``name``);
  legacy ``function_call`` / role ``function`` become ``tool_calls`` / ``tool``. The record's ``tools`` (or
  legacy ``functions``) list of function schemas is kept beside the messages.
- ShareGPT ``conversations``: ``[{"from": "human"|"gpt"|"system", "value": ...}, ...]``, with LLaMA-Factory's
  ``function_call`` turns (value: JSON text of ``{"name", "arguments"}`` or a list of them) and ``observation``
  turns (tool results), and a record-level ``tools`` (JSON text or a list; bare ``{"name", "parameters"}``
  schemas are wrapped as ``{"type": "function", "function": ...}``).
- Alpaca ``instruction`` (+ optional ``input``)
- plain ``prompt`` string

A corpus row is the context of ONE assistant turn (:mod:`dflash_assets.common.conversation` stores it;
:mod:`dflash_assets.data.conversation_shapes` reads a record as a conversation and cuts it into turns):
``turns="every"`` gives a row per assistant turn of a conversation, its own messages before that turn as
context (the source's earlier assistant turns kept), plus a row for a trailing user or tool message with no
reply; ``turns="last"`` one row per record, the conversation with its trailing assistant turns dropped (a plain
conversation: up to its last user message; ``user, assistant(tool_calls), tool, assistant`` regenerates the
answer after the tool result). A final assistant reply is never context: it is dropped unchecked. Calls without
an id get ``call_<k>`` (k counting the conversation's calls), so hashes are stable; a result without a
``tool_call_id`` answers the first call of the assistant turn before it that has none yet.

Bad records never raise, whatever they hold (bad UTF-8, a lone surrogate, nesting too deep, a value Arrow
cannot convert, any exception a record raises): they are returned as rejected rows with file, line and reason
(its kind before the first ':'), and the good rows of the same file are kept. Kinds of tool use set aside:
``tool message`` (a result answering no call of the assistant turn before it, or with no call before it),
``unanswered tool call`` (a call with no result before the next non-tool message), ``bad tool call`` (no
function name, arguments not a JSON object, a repeated id), ``bad tools`` (a ``tools`` list that is not a
list of named function schemas), ``empty content`` (an assistant turn in context with neither text nor calls).

Content: a string, or a list of parts (OpenAI style ``[{"type": "text", "text": ...}]``, or plain
strings) whose text parts are joined with newlines; a part of any other type (image, audio, file) rejects
the row naming the type.

Identity: a row's ``content_hash`` is over its API-shaped context and, only when present, the tools, so a
plain row hashes as before tool conversations were read and keeps its stored rows.

Files are read as streams in bounded memory by :mod:`dflash_assets.data.reader` (which also splits JSONL
on ``\n`` only and drops a UTF-8 byte-order mark); a file that cannot be read, or is over a
:class:`~dflash_assets.data.reader.ReadLimits` bound, fails naming the file, the bound and the fix.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import fsspec
import polars as pl

from dflash_assets.common.conversation import MESSAGE_FIELDS, MESSAGES_SCHEMA, stored_message
from dflash_assets.common.settings import default_sources
from dflash_assets.data.conversation_shapes import (
    DEFAULT_TURNS,
    SHAPES_ACCEPTED,
    TURNS,
    Conversation,
    RowError,
    conversation_turns,
    normalize_conversation,
)
from dflash_assets.data.reader import FileError, PromptFile, ReadLimits, preview

__all__ = [
    "CorpusError",
    "CorpusResult",
    "build_corpus",
    "content_hash",
    "expand_source",
    "source_name",
    "with_conversation_columns",
]

ID_FIELDS = ("id", "prompt_id", "task_id", "uuid")
CORPUS_SCHEMA = {
    "index": pl.Int64,
    "prompt_id": pl.String,
    "source": pl.String,
    "messages": MESSAGES_SCHEMA,
    "content_hash": pl.String,
    "file": pl.String,
    "line": pl.Int64,
    "tools": pl.String,  # JSON text of the OpenAI tools list; null when the conversation offers none
    "conversation_id": pl.String,  # <source>:<id>, or the hash of the whole normalized conversation
    "turn": pl.Int64,  # 0-based number of the assistant turn the row regenerates
    "turn_kind": pl.String,  # TURN_KINDS
}
REJECTED_SCHEMA = {"source": pl.String, "file": pl.String, "line": pl.Int64, "reason": pl.String, "raw": pl.String}


class CorpusError(ValueError):
    """A source cannot be used at all (unreadable or empty file, no file matched, every row rejected).

    ``rejected``: the rows set aside so far (REJECTED_SCHEMA), for the caller to write before failing;
    None when the error came before any row was read.
    """

    def __init__(self, message: str, rejected: pl.DataFrame | None = None) -> None:
        super().__init__(message)
        self.rejected = rejected


@dataclass
class CorpusResult:
    """Output of :func:`build_corpus`. ``corpus`` and ``rejected`` follow CORPUS_SCHEMA / REJECTED_SCHEMA."""

    corpus: pl.DataFrame
    rejected: pl.DataFrame
    rows_per_source: dict[str, int] = field(default_factory=dict)
    duplicates_per_source: dict[str, int] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    @property
    def rejected_by_reason(self) -> dict[str, int]:
        """Rejected-row counts keyed by the reason's kind (text before the first ':')."""
        return dict(sorted(Counter(r.split(":")[0] for r in self.rejected["reason"].to_list()).items()))


def source_name(path: str) -> str:
    """Default source name: the file name without directory and extensions (``.json.gz`` -> stem)."""
    name = posixpath.basename(path.rstrip("/"))
    for ext in (".gz", ".jsonl", ".json", ".parquet"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    return name or path


#: The source spec naming the embedded HumanEval prompts (:func:`default_sources`), e.g. beside another source.
HUMANEVAL_ALIAS = "humaneval"


def expand_source(spec: str, storage_options: dict | None = None) -> list[str]:
    """Paths (or URIs) matched by one source spec: a file, a glob, or a directory of data files; ``humaneval`` (the
    embedded HumanEval prompts, :func:`default_sources`); or an embedded source,
    ``bfcl:<category>[?limit=N][&split=...]``: the JSONL file of its records, written once into the cache
    (:func:`dflash_assets.data.bfcl.source_file`; ``$DFLASH_CACHE_DIR``, else ``~/.cache/dflash_assets``).

    Raises:
        CorpusError: nothing matches, or a ``bfcl:`` source cannot be made (malformed, bfcl-eval not installed).
    """
    if spec.lower() == HUMANEVAL_ALIAS:
        return default_sources()
    if spec.startswith("bfcl:"):
        from dflash_assets.common.settings import cache_dir
        from dflash_assets.data.bfcl import BfclError, source_file

        try:
            return [str(source_file(spec, cache_dir()))]
        except BfclError as exc:
            raise CorpusError(f"{spec if len(spec) <= 120 else spec[:120] + '...'}: {exc}") from None
    fs, path = fsspec.core.url_to_fs(spec, **(storage_options or {}))
    protocol = fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol
    prefix = "" if protocol in ("file", "local") else f"{protocol}://"
    if any(c in path for c in "*?["):
        matches = sorted(fs.glob(path))
    elif fs.isdir(path):
        matches = sorted(p for p in fs.find(path) if p.endswith((".jsonl", ".json", ".parquet", ".gz")))
    elif fs.exists(path):
        matches = [path]
    else:
        raise CorpusError(f"{spec}: no such file")
    if not matches:
        raise CorpusError(f"{spec}: the pattern matched no file")
    if prefix:
        return [prefix + m for m in matches]
    # keep the caller's spelling for a plain local file so stored paths stay portable
    return [spec] if matches == [path] else matches


def content_hash(messages: list[dict[str, Any]], tools: str | None = None) -> str:
    """SHA-256 (hex, first 16 chars) of a row's context, its identity (duplicates, stable indices): the
    API-shaped ``messages`` (:func:`~dflash_assets.common.conversation.api_messages` form) as sorted-key JSON, and
    with ``tools`` (their stored JSON text) only when there are some, so a row without tools hashes as rows did
    before tool conversations were read."""
    payload: Any = messages if tools is None else {"messages": messages, "tools": tools}
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False, sort_keys=True).encode()).hexdigest()[:16]


StorageOptions = dict | Callable[[str], dict] | None


def _options(storage_options: StorageOptions, spec: str) -> dict:
    """fsspec options for one source: a callable is asked per source (e.g. s3:// gets the storage resource's)."""
    return (storage_options(spec) if callable(storage_options) else storage_options) or {}


def _found_fields(records: list[Any], limit: int = 12) -> str:
    """ "keys found: [...]" (JSON objects) or "columns found: [...]" (Parquet) from the first records seen."""
    keys: dict[str, None] = {}
    kinds: Counter[str] = Counter()
    for record in records:
        if isinstance(record, dict):
            keys.update(dict.fromkeys(map(str, record)))
        else:
            kinds[type(record).__name__] += 1
    text = f"keys found: {sorted(keys)[:limit]}" if keys else "keys found: none"
    return text + (f"; non-object records: {dict(kinds)}" if kinds else "")


def record_problem(exc: BaseException) -> str:
    """The rejection reason for an exception one record raised while being made a prompt (never raised on)."""
    if isinstance(exc, RowError):
        reason = str(exc)
    elif isinstance(exc, UnicodeEncodeError):
        bad = exc.object[exc.start : exc.start + 1] if isinstance(exc.object, str) else ""
        reason = (
            f"invalid Unicode: the text holds a lone surrogate ({bad.encode('unicode_escape').decode()}), "
            "which no UTF-8 file can store"
        )
    elif isinstance(exc, RecursionError):
        reason = "too deeply nested: the record nests more levels than can be read"
    else:
        reason = f"unreadable record: {type(exc).__name__}: {exc}"
    return reason.encode("utf-8", "backslashreplace").decode("utf-8")[:500]


def _rows(record: Any, src: str, turns: str) -> tuple[Conversation, list[dict[str, Any]]]:
    """The conversation of one decoded record and its corpus rows (CORPUS_SCHEMA less index, file and line), in
    turn order; raises for a bad record (any exception).

    ``conversation_id``: ``<source>:<id>`` when the record has an id field, else the content hash of the whole
    conversation (its final reply left out). ``prompt_id``: a record giving one row keeps the id a prompt had
    before conversations gave several rows (``<source>:<id>``, else the row's content hash); a record giving
    several rows gives each ``<conversation_id>#<turn>``."""
    conversation = normalize_conversation(record)
    contexts = conversation_turns(conversation, turns)
    raw_id = next((record[f] for f in ID_FIELDS if record.get(f) not in (None, "")), None)
    if raw_id is not None and not isinstance(raw_id, (str, int)):
        raise RowError(f"bad id: {type(raw_id).__name__} is not a string or integer")
    tools = conversation.tools
    conversation_id = (
        f"{src}:{raw_id}" if raw_id is not None else content_hash(conversation.messages, tools)
    )  # UnicodeEncodeError on a lone surrogate (JSON "\ud800")
    conversation_id.encode("utf-8")  # an id is stored too
    rows = []
    for context in contexts:
        chash = content_hash(context.messages, tools)
        if len(contexts) > 1:
            prompt_id = f"{conversation_id}#{context.turn}"
        else:
            prompt_id = f"{src}:{raw_id}" if raw_id is not None else chash
        rows.append(
            {
                "prompt_id": prompt_id,
                "source": src,
                "messages": [stored_message(m) for m in context.messages],
                "content_hash": chash,
                "tools": tools,
                "conversation_id": conversation_id,
                "turn": context.turn,
                "turn_kind": context.turn_kind,
            }
        )
    return conversation, rows


def build_corpus(
    sources: list[str],
    storage_options: StorageOptions = None,
    limits: ReadLimits | None = None,
    turns: str = DEFAULT_TURNS,
) -> CorpusResult:
    """Read every source into one deduplicated corpus with a positional ``index`` in a stable order
    (``prompt_corpus`` then gives each prompt its stable index: :func:`dflash_assets.data.prompt_index.stable_corpus`).

    Order: sources in the given order, files sorted within a source, records in file order, a record's rows in
    turn order. A record gives one row (``turns="last"``) or one per assistant turn (``"every"``):
    :func:`~dflash_assets.data.conversation_shapes.conversation_turns`;
    ``prompt_id`` and ``conversation_id`` as :func:`_rows` says. Exact duplicates
    (same context: messages and tools) are kept once (the first) and counted, also when two conversations share
    a context; a record whose row would reuse an id already used by a different context is rejected as a
    conflicting duplicate id. Files are streamed (:class:`~dflash_assets.data.reader.PromptFile`): memory
    holds the corpus built so far and one record, never a whole file.

    Args:
        storage_options: fsspec options for the sources, or a callable ``spec -> options`` (the prompt
            asset passes the storage resource's S3 endpoint and credentials for ``s3://`` sources).
        limits: bounds on each file (default :class:`~dflash_assets.data.reader.ReadLimits`).
        turns: ``"last"`` or ``"every"`` (:data:`TURNS`).

    Raises:
        ValueError: ``turns`` is not one of :data:`TURNS`.
        CorpusError: a source matches no file, a file cannot be read, is empty or over a bound, or a file
            has no usable row. For the last, every file is read first and ``.rejected`` holds all rejected
            rows (so the caller can write them); the message names each such file, the keys or columns
            found and the shapes accepted.
    """
    if turns not in TURNS:
        raise ValueError(f"turns: {turns!r} is not one of {list(TURNS)}")
    limits = limits or ReadLimits()
    corpus = _CorpusSoFar()
    all_files: list[str] = []
    unusable: list[str] = []
    for spec in sources:
        options = _options(storage_options, spec)
        files = expand_source(spec, options)
        all_files.extend(files)
        for path in files:
            if (note := corpus.read_file(path, options, limits, turns)) is not None:
                unusable.append(note)
    rejected = corpus.rejected
    rejected_df = pl.DataFrame(rejected, schema=REJECTED_SCHEMA) if rejected else pl.DataFrame(schema=REJECTED_SCHEMA)
    if unusable:
        raise CorpusError(
            "; ".join(unusable) + f". Shapes accepted (one record per JSONL line, JSON-array element or "
            f"Parquet row): {SHAPES_ACCEPTED}",
            rejected_df,
        )
    kept = corpus.kept
    for i, row in enumerate(kept):
        row["index"] = i
    frame = pl.DataFrame(kept, schema=CORPUS_SCHEMA) if kept else pl.DataFrame(schema=CORPUS_SCHEMA)
    return CorpusResult(frame, rejected_df, dict(corpus.rows_per_source), dict(corpus.dups_per_source), all_files)


@dataclass
class _CorpusSoFar:
    """The corpus :func:`build_corpus` has read so far: rows kept and rejected, the contexts and ids seen, rows
    and exact duplicates per source."""

    kept: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    seen_hash: dict[str, str] = field(default_factory=dict)
    seen_id: dict[str, tuple[str, str]] = field(default_factory=dict)  # prompt_id -> (hash, "file:line")
    rows_per_source: Counter[str] = field(default_factory=Counter)
    dups_per_source: Counter[str] = field(default_factory=Counter)

    def read_file(self, path: str, options, limits: ReadLimits, turns: str) -> str | None:
        """Add every record of one file; what to say about it when it gave no usable row (else None).

        Raises:
            CorpusError: the file cannot be read, is empty or over a bound.
        """
        src = source_name(path)
        good_before, bad_before, dup_before = self.rows_per_source[src], len(self.rejected), self.dups_per_source[src]
        sample: list[Any] = []
        try:
            reader = PromptFile(path, options, limits)
            for record in reader:
                if len(sample) < 50 and not record.error:
                    sample.append(record.value)
                self.add_record(record, path, src, turns)
        except FileError as exc:
            raise CorpusError(str(exc)) from None
        if self.rows_per_source[src] != good_before or self.dups_per_source[src] != dup_before:
            return None
        rejected = self.rejected
        n_bad = len(rejected) - bad_before
        reasons = Counter(r["reason"].split(":")[0] for r in rejected[bad_before:])
        first = rejected[bad_before]["reason"] if n_bad else "-"
        found = f"columns found: {reader.columns}" if reader.columns is not None else _found_fields(sample)
        return (
            f"{path}: no usable prompt ({n_bad} rows rejected: {dict(reasons)}; first: line "
            f"{rejected[bad_before]['line'] if n_bad else '-'}: {first}); {found}"
        )

    def add_record(self, record, path: str, src: str, turns: str) -> None:
        """A record's rows kept (an exact duplicate counted, not kept), or the record rejected with why: unreadable,
        no conversation, or an id already used for another context."""
        try:
            if record.error:
                raise RowError(record.error)
            _conversation, rows = _rows(record.value, src, turns)
            for row in rows:
                used = self.seen_id.get(row["prompt_id"])
                if used is not None and used[0] != row["content_hash"]:
                    raise RowError(
                        f"conflicting duplicate id: {row['prompt_id']!r} was first used at {used[1]} for other messages"
                    )
        except Exception as exc:
            raw = record.preview if record.preview is not None else _value_preview(record.value)
            self.rejected.append(
                {"source": src, "file": path, "line": record.line, "reason": record_problem(exc), "raw": raw}
            )
            return
        for row in rows:
            chash, prompt_id = row["content_hash"], row["prompt_id"]
            if chash in self.seen_hash:
                self.dups_per_source[src] += 1
                continue
            self.seen_hash[chash] = prompt_id
            self.seen_id.setdefault(prompt_id, (chash, f"{path}:{record.line}"))
            self.rows_per_source[src] += 1
            self.kept.append({**row, "file": path, "line": record.line})


def with_conversation_columns(corpus: pl.DataFrame) -> pl.DataFrame:
    """A stored corpus as this version writes it, whatever version wrote it: a corpus stored before tool
    conversations were read (``messages`` of ``{role, content}`` only; no ``tools``, ``conversation_id``,
    ``turn``, ``turn_kind``) gets the missing message fields as nulls, ``tools`` null, ``conversation_id`` =
    ``prompt_id``, ``turn`` = the assistant messages in the context and ``turn_kind`` from its roles (no row of
    such a corpus holds a tool message). Columns not read (``columns=`` of a partial read) stay absent; a
    current corpus comes back unchanged."""
    out = corpus
    if "messages" in out.columns and out.schema["messages"] != MESSAGES_SCHEMA:
        have = set(out.schema["messages"].inner.to_schema())  # type: ignore[union-attr]
        fields = [
            pl.element().struct.field(f) if f in have else pl.lit(None, dtype=pl.String).alias(f)
            for f in MESSAGE_FIELDS
        ]
        out = out.with_columns(pl.col("messages").list.eval(pl.struct(fields)).cast(MESSAGES_SCHEMA))
    if "messages" not in out.columns or "tools" in out.columns:
        return out
    roles = pl.col("messages").list.eval(pl.element().struct.field("role"))
    assistants = roles.list.eval((pl.element() == "assistant").cast(pl.Int64)).list.sum()
    users = roles.list.eval((pl.element() == "user").cast(pl.Int64)).list.sum()
    only_prompt = roles.list.eval(pl.element().is_in(["system", "user"])).list.all()
    return out.with_columns(
        tools=pl.lit(None, dtype=pl.String),
        conversation_id=pl.col("prompt_id") if "prompt_id" in out.columns else pl.lit(None, dtype=pl.String),
        turn=assistants.cast(pl.Int64),
        turn_kind=pl.when(only_prompt & (users == 1)).then(pl.lit("prompt")).otherwise(pl.lit("follow_up")),
    )


def _value_preview(value: Any) -> str:
    """A rejected Parquet row's preview: its JSON text (escaped), or its type when even that fails."""
    try:
        return preview(json.dumps(value, ensure_ascii=True, default=str))
    except Exception:
        return f"<{type(value).__name__} that cannot be shown>"
