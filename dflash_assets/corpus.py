"""Read prompt files of the common shapes into one clean, indexed corpus (no Dagster imports).

Shapes (one record per JSONL line, JSON-array element or Parquet row):
- OpenAI ``messages``: ``[{"role": ..., "content": ...}, ...]``
- ShareGPT ``conversations``: ``[{"from": "human"|"gpt"|"system", "value": ...}, ...]``
- Alpaca ``instruction`` (+ optional ``input``)
- plain ``prompt`` string

A conversation becomes one prompt: its messages up to and including the last user message; a reply
after it is dropped (it gets regenerated). Bad records never raise: they are returned as rejected rows
with file, line and reason.

Content: a string, or a list of parts (OpenAI style ``[{"type": "text", "text": ...}]``, or plain
strings) whose text parts are joined with newlines; a part of any other type (image, audio, file) rejects
the row naming the type. Tool use: turns after the last user message are dropped like any reply, so a
trailing ``tool_calls`` / ``tool`` exchange is fine; a ``tool`` (or ``function``) message, or an assistant
turn carrying ``tool_calls`` / ``function_call``, BEFORE the last user message rejects the row
("tool message: ..."): the corpus keeps plain role/content turns and has no rendering for tool calls.

Files: JSONL is split on ``\n`` only (U+2028, U+2029 and U+0085 are legal inside JSON strings), a
``\r`` before it dropped; a UTF-8 byte-order mark is stripped from JSONL and JSON files.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import posixpath
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import fsspec
import polars as pl
import pyarrow.parquet as pq

ROLE_ALIASES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}
ID_FIELDS = ("id", "prompt_id", "task_id", "uuid")
MESSAGES_SCHEMA = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))
CORPUS_SCHEMA = {
    "index": pl.Int64, "prompt_id": pl.String, "source": pl.String, "messages": MESSAGES_SCHEMA,
    "content_hash": pl.String, "file": pl.String, "line": pl.Int64,
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

    def __init__(self, message: str, rejected: "pl.DataFrame | None" = None) -> None:
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
        return [{"role": "user", "content": instruction.strip() + (f"\n\n{extra.strip()}" if extra and extra.strip() else "")}]
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
        raise RowError(f"bad content: {where} content is a {type(content).__name__}, expected a string or a list of parts")
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
            raise RowError(f"tool message: {field_name}[{k}] is a tool result (role {role!r}) before the last user message; "
                           "tool calls and tool results are not supported in prompts")
        if turn.get("tool_calls") or turn.get("function_call"):
            raise RowError(f"tool message: {field_name}[{k}] ({role}) carries tool_calls before the last user message; "
                           "tool calls and tool results are not supported in prompts")
        content = content_text(turn.get(content_key, turn.get("content")), f"{field_name}[{k}] ({role})")
        if not isinstance(content, str) or not content.strip():
            raise RowError(f"empty content: {field_name}[{k}] ({role}) has no text")
        turns.append({"role": role, "content": content})
    return turns


def _has_surrogates(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return False
        except UnicodeEncodeError:
            return True
    if isinstance(value, dict):
        return any(_has_surrogates(k) or _has_surrogates(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogates(v) for v in value)
    return False


def _raw_preview(raw: Any, limit: int = 300) -> str:
    text = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=True, default=str)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")[:limit]


def iter_records(path: str, data: bytes) -> Iterator[tuple[int, Any, str | None]]:
    """Yield ``(line, record, error)`` for each record of one file's bytes (gzip already undone).

    ``line`` is 1-based: the JSONL line, the JSON-array element number or the Parquet row number.
    ``error`` is a rejection reason when the record could not be decoded (then ``record`` is the raw text).

    Raises:
        CorpusError: the file as a whole cannot be parsed (not JSON/JSONL/Parquet).
    """
    name = path[:-3] if path.endswith(".gz") else path
    if name.endswith(".parquet"):
        try:
            table = pq.read_table(io.BytesIO(data))
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise CorpusError(f"{path}: not a readable Parquet file ({exc})") from exc
        if table.num_rows == 0:
            raise CorpusError(f"{path}: the file is empty (a Parquet table with 0 rows; columns {table.column_names}); no prompt to read")
        for i, rec in enumerate(table.to_pylist(), start=1):
            yield i, rec, None
        return
    text = data.decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")  # a UTF-8 BOM is no content
    if not text.strip():
        raise CorpusError(f"{path}: the file is empty ({len(data)} bytes{', only whitespace' if data else ''}); no prompt to read")
    stripped = text.lstrip()
    if name.endswith(".json") and stripped.startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{path}: not a valid JSON array ({exc}); use JSONL to keep good lines of a damaged file") from exc
        if not records:
            raise CorpusError(f"{path}: the file is empty (an empty JSON array); no prompt to read")
        for i, rec in enumerate(records, start=1):
            if _has_surrogates(rec):
                yield i, _raw_preview(rec), "invalid UTF-8: the record holds bytes that are not UTF-8"
            else:
                yield i, rec, None
        return
    if not name.endswith((".jsonl", ".json")):
        raise CorpusError(f"{path}: unknown file type; expected .jsonl, .json or .parquet (optionally .gz)")
    # split on \n only: str.splitlines() also splits on U+2028/U+2029/U+0085, legal inside JSON strings
    for i, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        if _has_surrogates(line):
            yield i, _raw_preview(line), "invalid UTF-8: the line holds bytes that are not UTF-8"
            continue
        try:
            yield i, json.loads(line), None
        except json.JSONDecodeError as exc:
            yield i, line[:300], f"invalid JSON: {json_error_text(exc)}"


def json_error_text(exc: json.JSONDecodeError) -> str:
    """``"<message> at column N"``: json's messages such as "Unterminated string starting at" already end
    with "at", which is not repeated ("Unterminated string starting at column 7", "Expecting value at column 1")."""
    msg = exc.msg.removesuffix(" at")
    return f"{msg} at column {exc.colno}"


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


def read_file_bytes(path: str, storage_options: dict | None = None) -> bytes:
    """Whole file content, gunzipped when the name ends with ``.gz``.

    Raises:
        CorpusError: the file cannot be opened or decompressed.
    """
    try:
        with fsspec.open(path, "rb", **(storage_options or {})) as f:
            data = f.read()
        return gzip.decompress(data) if path.endswith(".gz") else data
    except (OSError, EOFError) as exc:
        raise CorpusError(f"{path}: cannot read the file ({exc})") from exc


def content_hash(messages: list[dict[str, str]]) -> str:
    """SHA-256 (hex, first 16 chars) of the normalized messages: the identity used for duplicates."""
    return hashlib.sha256(json.dumps(messages, ensure_ascii=False, sort_keys=True).encode()).hexdigest()[:16]


StorageOptions = dict | Callable[[str], dict] | None


def _options(storage_options: StorageOptions, spec: str) -> dict:
    """fsspec options for one source: a callable is asked per source (e.g. s3:// gets the storage resource's)."""
    return (storage_options(spec) if callable(storage_options) else storage_options) or {}


def _found_fields(records: list[Any], limit: int = 12) -> str:
    """"keys found: [...]" (JSON objects) or "columns found: [...]" (Parquet) from the first records seen."""
    keys: dict[str, None] = {}
    kinds: Counter[str] = Counter()
    for record in records:
        if isinstance(record, dict):
            keys.update(dict.fromkeys(map(str, record)))
        else:
            kinds[type(record).__name__] += 1
    text = f"keys found: {sorted(keys)[:limit]}" if keys else "keys found: none"
    return text + (f"; non-object records: {dict(kinds)}" if kinds else "")


def build_corpus(sources: list[str], storage_options: StorageOptions = None) -> CorpusResult:
    """Read every source into one deduplicated corpus with a global ``index`` in a stable order.

    Order: sources in the given order, files sorted within a source, records in file order. Each
    prompt's ``prompt_id`` is ``<source>:<id>`` when the record has an id field, else its content hash.
    Exact duplicates (same normalized messages) are kept once (the first) and counted; a second record
    with an id already used by different messages is rejected as a conflicting duplicate id.

    Args:
        storage_options: fsspec options for the sources, or a callable ``spec -> options`` (the prompt
            asset passes the storage resource's S3 endpoint and credentials for ``s3://`` sources).

    Raises:
        CorpusError: a source matches no file, a file cannot be read or is empty, or a file has no usable
            row. For the last, every file is read first and ``.rejected`` holds all rejected rows (so the
            caller can write them); the message names each such file, the keys or columns found and the
            shapes accepted.
    """
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
            columns: list[str] | None = None
            data = read_file_bytes(path, options)
            if (path[:-3] if path.endswith(".gz") else path).endswith(".parquet"):
                with contextlib.suppress(Exception):
                    columns = pq.read_schema(io.BytesIO(data)).names
            for line, record, error in iter_records(path, data):
                if len(sample) < 50 and not error:
                    sample.append(record)
                try:
                    if error:
                        raise RowError(error)
                    messages = normalize_record(record)
                    chash = content_hash(messages)
                    raw_id = next((record[f] for f in ID_FIELDS if record.get(f) not in (None, "")), None)
                    if raw_id is not None and not isinstance(raw_id, (str, int)):
                        raise RowError(f"bad id: {type(raw_id).__name__} is not a string or integer")
                    prompt_id = f"{src}:{raw_id}" if raw_id is not None else chash
                    if prompt_id in seen_id and seen_id[prompt_id][0] != chash:
                        raise RowError(f"conflicting duplicate id: {prompt_id!r} was first used at {seen_id[prompt_id][1]} for other messages")
                except RowError as exc:
                    rejected.append({"source": src, "file": path, "line": line, "reason": str(exc), "raw": _raw_preview(record)})
                    continue
                if chash in seen_hash:
                    dups_per_source[src] += 1
                    continue
                seen_hash[chash] = prompt_id
                seen_id.setdefault(prompt_id, (chash, f"{path}:{line}"))
                rows_per_source[src] += 1
                kept.append({"prompt_id": prompt_id, "source": src, "messages": messages, "content_hash": chash, "file": path, "line": line})
            if rows_per_source[src] == good_before and dups_per_source[src] == dup_before:
                n_bad = len(rejected) - bad_before
                reasons = Counter(r["reason"].split(":")[0] for r in rejected[bad_before:])
                first = rejected[bad_before]["reason"] if n_bad else "-"
                found = f"columns found: {columns}" if columns is not None else _found_fields(sample)
                unusable.append(f"{path}: no usable prompt ({n_bad} rows rejected: {dict(reasons)}; first: line "
                                f"{rejected[bad_before]['line'] if n_bad else '-'}: {first}); {found}")
    rejected_df = pl.DataFrame(rejected, schema=REJECTED_SCHEMA) if rejected else pl.DataFrame(schema=REJECTED_SCHEMA)
    if unusable:
        raise CorpusError("; ".join(unusable) + f". Shapes accepted (one record per JSONL line, JSON-array element or "
                          f"Parquet row): {SHAPES_ACCEPTED}", rejected_df)
    for i, row in enumerate(kept):
        row["index"] = i
    corpus = pl.DataFrame(kept, schema=CORPUS_SCHEMA) if kept else pl.DataFrame(schema=CORPUS_SCHEMA)
    return CorpusResult(corpus, rejected_df, dict(rows_per_source), dict(dups_per_source), all_files)
