"""Completions rows: their schema, how a server reply becomes a row, and when a row is still valid.

A row is *valid under settings S* when it was made with S's sampling settings (same fingerprint), has
no error, and either stopped on its own within S's cap (``stop`` and ``completion_tokens <= cap``) or
was cut at exactly S's cap (``length`` and made with ``max_output_tokens == cap``). Raising the cap
therefore invalidates only ``length`` rows; lowering it only rows longer than the new cap.
"""

from __future__ import annotations

from array import array
from typing import Any

import polars as pl

from dflash_assets.common.settings import GenerationSettings

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: How a tool call opens in the model's own text: the Hermes format that the Qwen2.5-3.6 templates and the shipped
#: SmolLM2 tools template write (Qwen3.6 puts ``<function=...>`` inside it).
TOOL_CALL_OPEN = "<tool_call>"

COMPLETIONS_SCHEMA = {
    "index": pl.Int64,
    "prompt_id": pl.String,
    # the corpus's content_hash of the messages this row answers: a row is used only where the corpus has
    # that prompt at its index (null: a row made before the column existed, see prompt_mismatch)
    "prompt_hash": pl.String,
    "source": pl.String,
    "reasoning_content": pl.String,
    "content": pl.String,
    "finish_reason": pl.String,
    "prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
    "output_token_ids": pl.List(pl.Int32),
    # the reply field output_token_ids came from (response_token_ids: SGLang chat; token_ids: vLLM; output_ids;
    # logprobs), "none" when the row keeps no ids of the model's own; null: a row made before the column existed
    "output_token_ids_source": pl.String,
    "truncated_in_reasoning": pl.Boolean,
    "empty_answer": pl.Boolean,
    "max_output_tokens": pl.Int64,
    "settings_fingerprint": pl.String,
    "settings": pl.String,
    "latency_s": pl.Float64,
    "server": pl.String,
    "attempts": pl.Int64,
    "error": pl.String,
    # tokens of this row written by an earlier request and continued after a cap raise (0: one request)
    "continued_from_tokens": pl.Int64,
    # tokens this row had before a lower cap cut it locally to its first max_output_tokens (0: not cut)
    "cut_from_tokens": pl.Int64,
    # requests that made this row when the end of a run generated it in chunks
    # (inference.client.tail_chunk_tokens; 0: one)
    "tail_chunks": pl.Int64,
    # the servers' context (tokens) the prompt was judged against before it was sent (null: unknown); a row
    # set aside as too long for it (finish_reason prompt_too_long) is judged again when it or the cap changes
    "context_length": pl.Int64,
    # the prompt's token ids as the server rendered them (vLLM with return_token_ids; null: the server gave none,
    # or the row was continued or made in chunks): tokenized_sequences checks its own rendering gives exactly them
    "prompt_token_ids": pl.List(pl.Int32),
    # the corpus's kind of the context this row answers (prompt, after_tool, follow_up; null: a row made before)
    "turn_kind": pl.String,
    # the regenerated turn holds a tool call (TOOL_CALL_OPEN in its answer; null: a row made before the column)
    "tool_call": pl.Boolean,
    # where the row's training ids come from (IDS_SERVER: the reply gave the prompt's ids and the generated ids,
    # tokenized_sequences takes them as they are; IDS_RENDERED: it did not, the project renders the context; null:
    # a row made before the column, read as IDS_UNKNOWN, never as the server's)
    "ids_source": pl.String,
    # the engine that served the row (sglang, vllm, transformers, openai) and its version as the server said it
    # ("unknown" when it did not; servers/origin.py), and the SHA-256 of the chat template it rendered with
    "engine": pl.String,
    "engine_version": pl.String,
    "template_sha256": pl.String,
}
#: ``ids_source`` values: the server's ids; the project's rendering; a row made before the column
IDS_SERVER, IDS_RENDERED, IDS_UNKNOWN = "server", "rendered", "unknown"
#: Counts that rows made before the column existed read as 0.
_ZERO_IF_MISSING = ("continued_from_tokens", "cut_from_tokens", "tail_chunks")
#: Token counts and ids: below 2**31 (the Int32 id column; no context is that long), never negative.
_TOKEN_LIMIT = 2**31
_TOKEN_COUNTS = frozenset(
    {"prompt_tokens", "completion_tokens", "continued_from_tokens", "cut_from_tokens", "context_length"}
)

#: ``finish_reason`` of a row set aside, never sent: its templated prompt leaves no room for the cap under the
#: servers' context (:func:`too_long_row`).
PROMPT_TOO_LONG = "prompt_too_long"


def row_problem(row: dict[str, Any]) -> str | None:
    """Why ``row`` cannot be stored as a completions row as it is, or None when it can.

    Each column present must have its COMPLETIONS_SCHEMA type exactly (polars would otherwise coerce in
    silence: ``1.5`` -> 1, ``"7"`` -> 7, an id ``2**31`` in the Int32 list -> null, or refuse the whole table:
    ``2**63`` in an Int64); text must be valid Unicode (no lone surrogate); integers non-negative, token counts
    and ids below 2**31. A missing column or None is allowed (null). The reason names the column.
    """
    for name, dtype in COMPLETIONS_SCHEMA.items():
        value = row.get(name)
        if value is None:
            continue
        if dtype == pl.String:
            if not isinstance(value, str):
                return f"{name} is a {type(value).__name__}, not text"
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                return f"{name} holds a lone surrogate at character {exc.start:,} (not valid Unicode)"
        elif dtype == pl.Int64:
            if type(value) is not int:
                return f"{name} is a {type(value).__name__}, not an integer"
            limit, said = (_TOKEN_LIMIT, "2**31") if name in _TOKEN_COUNTS else (2**63, "2**63")
            if not 0 <= value < limit:
                return f"{name} is {value if abs(value) < 10**30 else 'huge'}, outside [0, {said})"
        elif dtype == pl.Boolean:
            if not isinstance(value, bool):
                return f"{name} is a {type(value).__name__}, not a boolean"
        elif dtype == pl.Float64:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                return f"{name} is a {type(value).__name__}, not a number"
        else:  # a list of token ids: checked in C (array), ~50x faster than a Python loop over 4K ids
            try:
                ids = array("q", value) if isinstance(value, list) else None
            except OverflowError:
                return f"{name} holds an id outside [0, 2**31)"
            except TypeError:
                ids = None
            if ids is None:
                return f"{name} is not a list of integers"
            if ids and not (min(ids) >= 0 and max(ids) < _TOKEN_LIMIT):
                bad = next(t for t in ids if not 0 <= t < _TOKEN_LIMIT)
                return f"{name} holds {bad}, outside [0, 2**31)"
    return None


def set_aside_row(prompt: dict[str, Any], reason: str) -> dict[str, Any]:
    """The row stored in place of one that cannot be stored (:func:`row_problem`): the prompt's identity and
    the reason as its ``error`` (so the next run requests it again), no data from the row."""
    return _unsent_row(
        prompt, error=f"set aside: the row could not be stored ({reason}); the next run requests it again"
    )


def _unsent_row(prompt: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A row of every :data:`COMPLETIONS_SCHEMA` column that holds the prompt's identity, zero counts and no
    generated data, then ``fields``: the one shape of a row no reply filled."""
    row: dict[str, Any] = dict.fromkeys(COMPLETIONS_SCHEMA)
    row.update(
        index=int(prompt["index"]),
        prompt_id=prompt["prompt_id"],
        prompt_hash=prompt.get("content_hash"),
        source=prompt["source"],
        truncated_in_reasoning=False,
        empty_answer=False,
        attempts=0,
        continued_from_tokens=0,
        cut_from_tokens=0,
        tail_chunks=0,
    )
    row.update(fields)
    return row


def too_long_row(prompt: dict[str, Any], settings: GenerationSettings, prompt_tokens: int) -> dict[str, Any]:
    """The row of a prompt set aside, never sent: ``finish_reason`` :data:`PROMPT_TOO_LONG`, its templated
    length ``prompt_tokens`` (the target's chat template with the generation prompt and the thinking flag), the
    cap ``max_output_tokens`` and the servers' ``context_length`` it was judged against (``settings``), no
    text and no tokens. Not an error: the next run does not send it while cap and context stay
    (:func:`invalid_reason`)."""
    return _unsent_row(
        prompt,
        finish_reason=PROMPT_TOO_LONG,
        prompt_tokens=int(prompt_tokens),
        completion_tokens=0,
        max_output_tokens=settings.max_output_tokens,
        settings_fingerprint=settings.sampling_fingerprint(),
        settings=settings.settings_json,
        context_length=settings.context_length,
    )


def too_long_reason(prompt_tokens: int, settings: GenerationSettings, room: int) -> str:
    """Why a prompt is set aside: its length, the context, the cap and what that leaves, in one phrase."""
    return (
        f"{PROMPT_TOO_LONG}: the templated prompt is {prompt_tokens:,} tokens; context {settings.context_length:,} "
        f"- cap {settings.max_output_tokens:,} leaves room for {max(room, 0):,}"
    )


def split_reasoning(content: str | None, reasoning_content: str | None) -> tuple[str | None, str, bool]:
    """Separate thinking from the answer, in the stored form :func:`completion_layout` renders back.

    With a reasoning parser (SGLang ``--reasoning-parser qwen3``) the server already split them. Without
    one, a reply holding ``<think> ... </think>`` is split here; a reply with ``<think>`` (or a
    reasoning_content) but no closing tag was cut inside the thinking.

    Stored form, whatever the parser version kept of the newlines around the markers: the reasoning
    without the newlines that open it and, once closed, without those before ``</think>``; the answer
    without the newlines after ``</think>`` (the Qwen3 template's own rendering: ``reasoning.strip('\\n')``,
    ``content.lstrip('\\n')``). Text at a cut is kept as is: a continuation goes on from it.

    Returns:
        ``(reasoning, answer, thinking_closed)``; ``reasoning`` is None when the model did not think.
    """
    content = content or ""
    if reasoning_content is not None:
        reasoning, answer = reasoning_content, content
        closed = bool(content.strip()) or THINK_CLOSE in reasoning_content
    elif THINK_OPEN in content or THINK_CLOSE in content:
        head, sep, tail = content.partition(THINK_CLOSE)
        reasoning, answer, closed = head.split(THINK_OPEN, 1)[-1], (tail if sep else ""), bool(sep)
    else:
        return None, content, True
    reasoning = reasoning.lstrip("\n")
    if closed:
        reasoning = reasoning.rstrip("\n")
    return reasoning, answer.lstrip("\n"), closed


def completion_layout(reasoning: str | None, answer: str | None, truncated_in_reasoning: bool, opened: bool) -> str:
    """The completion as the model emitted it after the generation prompt: ``<think>\\n{reasoning}\\n</think>
    \\n\\n{answer}`` (Qwen3 layout), only ``<think>\\n{reasoning}`` when the cap cut the thinking, the answer
    alone when there is no reasoning. ``opened``: the generation prompt already ends with ``<think>`` (Qwen3.6
    layout), so the tag is not repeated. Shared by tokenization and by continuing cut rows, so the tokens
    trained on and the prefix a continuation sends are the same text."""
    if reasoning is None:
        return answer or ""
    head = "" if opened else f"{THINK_OPEN}\n"
    if truncated_in_reasoning:
        return f"{head}{reasoning}"
    return f"{head}{reasoning}\n{THINK_CLOSE}\n\n{answer or ''}"


def holds_tool_call(answer: str | None) -> bool:
    """Whether a turn's answer text (after the thinking) holds a tool call: :data:`TOOL_CALL_OPEN` in it."""
    return bool(answer) and TOOL_CALL_OPEN in answer


def row_from_result(result: Any, prompt: dict[str, Any], settings: GenerationSettings) -> dict[str, Any]:
    """One completions row (COMPLETIONS_SCHEMA) from a client result and its corpus row.

    ``truncated_in_reasoning``: cut by the cap before the thinking closed (the answer is empty).
    ``empty_answer``: a finished request whose answer text is empty or whitespace.
    ``output_token_ids_source``: the result's, ``none`` when it holds no ids.
    ``turn_kind``: the corpus row's; ``tool_call``: :func:`holds_tool_call` of the answer (None for an error row).
    ``ids_source``: :data:`IDS_SERVER` when the reply gave both the prompt's and the generated ids, else
    :data:`IDS_RENDERED` (None for an error row); ``engine``, ``engine_version``, ``template_sha256``: the
    result's ``origin`` (what the servers said of themselves), None where it says nothing.
    """
    ok = result.error is None
    reasoning, answer, closed = split_reasoning(result.content, result.reasoning_content) if ok else (None, None, True)
    ids = result.output_token_ids
    prompt_ids = getattr(result, "prompt_token_ids", None) if ok else None
    origin = getattr(result, "origin", None) or {}
    return {
        "index": int(prompt["index"]),
        "prompt_id": prompt["prompt_id"],
        "prompt_hash": prompt.get("content_hash"),
        "source": prompt["source"],
        "reasoning_content": reasoning,
        "content": answer,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "output_token_ids": ids,
        "output_token_ids_source": getattr(result, "output_token_ids_source", None) if ids is not None else "none",
        "truncated_in_reasoning": bool(
            ok and result.finish_reason == "length" and reasoning is not None and not closed
        ),
        "empty_answer": bool(ok and not (answer or "").strip()),
        "max_output_tokens": settings.max_output_tokens,
        "settings_fingerprint": settings.sampling_fingerprint(),
        "settings": settings.settings_json,
        "latency_s": round(float(result.latency_s), 4),
        "server": result.server,
        "attempts": int(result.attempts),
        "error": result.error,
        "continued_from_tokens": 0,
        "cut_from_tokens": 0,
        "tail_chunks": 0,
        "context_length": settings.context_length,
        "prompt_token_ids": prompt_ids,
        "turn_kind": prompt.get("turn_kind"),
        "tool_call": holds_tool_call(answer) if ok else None,
        "ids_source": (IDS_SERVER if ids is not None and prompt_ids is not None else IDS_RENDERED) if ok else None,
        "engine": origin.get("engine"),
        "engine_version": origin.get("engine_version"),
        "template_sha256": origin.get("template_sha256"),
    }


#: The columns :func:`invalid_reason` and :func:`prompt_mismatch` read: deciding a stored row's validity never
#: needs its text.
VALIDITY_COLUMNS = (
    "error",
    "settings_fingerprint",
    "completion_tokens",
    "finish_reason",
    "max_output_tokens",
    "prompt_hash",
    "prompt_id",
    "prompt_tokens",
    "context_length",
)

PROMPT_CHANGED = "prompt changed"
TOO_LONG_CAP = "too long under another cap"
TOO_LONG_CONTEXT = "too long under another context"
PROMPT_UNKNOWN = "prompt unknown"


def prompt_mismatch(row: dict[str, Any], prompt: dict[str, Any]) -> str | None:
    """Why ``row`` does not answer ``prompt`` (the corpus row at its index), or None when it does.

    :data:`PROMPT_CHANGED`: the row names another prompt (``prompt_hash`` differs from the corpus's
    ``content_hash``). :data:`PROMPT_UNKNOWN`: the row was made before rows named their prompt (no
    ``prompt_hash``), and nothing proves which prompt it answers: requested again (the safe choice: the
    corpus used to renumber on every build). The one proof accepted: a prompt without an id field has its
    content hash as ``prompt_id``, so an old row with that ``prompt_id`` answers exactly this content.
    """
    stored, chash = row.get("prompt_hash"), prompt.get("content_hash")
    if stored is not None:
        return None if stored == chash else PROMPT_CHANGED
    return None if chash is not None and row.get("prompt_id") == chash else PROMPT_UNKNOWN


def invalid_reason(row: dict[str, Any], settings: GenerationSettings) -> str | None:
    """Why ``row`` must be regenerated under ``settings``, or None when it stays valid.

    Reasons: ``error``, ``sampling or chat template changed`` (another fingerprint), ``cap raised`` (a ``length``
    row cut below the new cap), ``cap lowered`` (longer than the new cap), ``finish_reason <x>`` (abort and other
    non-final ends), and for a row set aside as too long (:data:`PROMPT_TOO_LONG`) :data:`TOO_LONG_CAP` or
    :data:`TOO_LONG_CONTEXT`: it was judged under another cap, or another context than ``settings.context_length``
    (None: not known here, so only the cap is compared); judged again, it may now fit.
    """
    if row.get("error"):
        return "error"
    if row.get("settings_fingerprint") != settings.sampling_fingerprint():
        return "sampling or chat template changed"
    cap, tokens, reason = settings.max_output_tokens, row.get("completion_tokens"), row.get("finish_reason")
    if reason == PROMPT_TOO_LONG:
        if row.get("max_output_tokens") != cap:
            return TOO_LONG_CAP
        if settings.context_length is not None and row.get("context_length") != settings.context_length:
            return TOO_LONG_CONTEXT
        return None
    if tokens is None:
        return "no completion_tokens"
    if tokens > cap:
        return "cap lowered"
    if reason == "stop":
        return None
    if reason == "length":
        return None if row.get("max_output_tokens") == cap else "cap raised"
    return f"finish_reason {reason}"


def rows_to_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """Rows sorted by ``index`` as a DataFrame with COMPLETIONS_SCHEMA (deterministic bytes on write)."""
    rows = sorted(rows, key=lambda r: r["index"])
    if not rows:
        return pl.DataFrame(schema=COMPLETIONS_SCHEMA)
    # rows made before the column existed were made by one request
    return pl.DataFrame(rows, schema=COMPLETIONS_SCHEMA).with_columns(pl.col(c).fill_null(0) for c in _ZERO_IF_MISSING)


def align_to_schema(frame: pl.DataFrame) -> pl.DataFrame:
    """A stored completions table with exactly COMPLETIONS_SCHEMA's columns, in its order and types:
    columns an older table lacks are null (``continued_from_tokens``, ``cut_from_tokens`` 0, as
    :func:`rows_to_frame` reads them), columns the schema no longer has are dropped."""
    columns = [
        pl.col(name).cast(dtype) if name in frame.columns else pl.lit(None, dtype).alias(name)
        for name, dtype in COMPLETIONS_SCHEMA.items()
    ]
    return frame.select(columns).with_columns(pl.col(c).fill_null(0) for c in _ZERO_IF_MISSING)


def no_good_row_message(rows: list[dict[str, Any]], pk: str, quote: int = 3) -> str | None:
    """The failure message for a partition none of whose rows succeeded, or None when one did (or none exist).

    Such a partition must fail its run, not be recorded as materialized: the first ``quote`` distinct
    errors (already redacted by the client) are quoted with their row index.
    """
    if not rows or any(not r.get("error") for r in rows):
        return None
    first, seen = [], set()
    for row in sorted(rows, key=lambda r: r["index"]):
        if row["error"] not in seen:
            seen.add(row["error"])
            first.append(f"row {row['index']}: {row['error']}")
        if len(first) == quote:
            break
    return (
        f"{pk}: all {len(rows)} rows ended in error; first errors: "
        + "; ".join(first)
        + ". Fix the cause and rerun the partition (finished rows are checkpointed; failed ones are requested again)"
    )
