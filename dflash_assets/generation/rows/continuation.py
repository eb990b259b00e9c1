"""Continuing the rows a cap cut: after a cap raise, a ``length`` row is resumed from the tokens it
already has instead of being generated again from its first token.

Why the result is the same data: autoregressive sampling draws token t+1 from p(. | prompt, tokens 1..t)
with per-step temperature / top-p / top-k / min-p, so a sequence whose first k tokens were drawn by one
request and the rest by another, conditioned on them, has the distribution of one drawn in a single go.
That fails when sampling treats the earlier tokens as *generated*: presence and repetition penalties
(the prefix becomes prompt, which they do not count the same way) and a per-request seed (a seeded row
is meant to be a function of seed and prompt). Rows made under those settings are regenerated whole.

What it saves: the user's cap raise 4,096 -> 8,192 re-sends ~162K rows; continued, each generates only
its tokens past 4,096 (~4.1K fewer per row, ~660M tokens, ~7 hours of a 25K tok/s node), and no
request runs longer than the new cap minus the old.

The request is SGLang's ``continue_final_message`` (SGLang >= 0.4.4): the prefix is the final assistant
message; SGLang takes it out, renders the rest of the conversation with its generation prompt and
appends the prefix text before tokenizing (``serving_chat._handle_last_assistant_message``). The prefix
is laid out as the model wrote it (:func:`~dflash_assets.generation.rows.records.completion_layout`, the
layout tokenization uses too, from text stored in the form
:func:`~dflash_assets.generation.rows.records.split_reasoning` normalises to), and ``separate_reasoning:
false`` asks for the new text raw, so thinking and answer are split here, across the seam, the same way
for every server version. SGLang re-tokenizes the prefix text, so a continued row keeps no
``output_token_ids`` (tokenization encodes its text, as for any row without ids).
"""

from __future__ import annotations

from typing import Any

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.api.replies import NO_OUTPUT_IDS
from dflash_assets.generation.rows.records import (
    IDS_RENDERED,
    THINK_CLOSE,
    THINK_OPEN,
    completion_layout,
    holds_tool_call,
    row_from_result,
)

#: Error of a continuation the server answered afresh (it ignored ``continue_final_message``).
NOT_CONTINUED = (
    "the server did not continue the final assistant message (its reply opens a new <think>): "
    "continue_final_message needs SGLang >= 0.4.4; or set inference.client.continue_truncated: false"
)


#: The first SGLang release whose chat endpoint honours ``continue_final_message``.
FIRST_CONTINUING_SGLANG = "0.4.4"


def sglang_predates_continuation(version: str | None) -> bool:
    """Whether SGLang ``version`` (e.g. ``importlib.metadata.version("sglang")``) is older than
    :data:`FIRST_CONTINUING_SGLANG`; False when unknown (None or unparsable): the reply check of
    :func:`merge_continuation` still catches a server that answers afresh."""
    from packaging.version import InvalidVersion, Version

    try:
        return version is not None and Version(version) < Version(FIRST_CONTINUING_SGLANG)
    except InvalidVersion:
        return False


def history_free(settings: GenerationSettings) -> bool:
    """Whether a row sampled under ``settings`` may be made in parts: no presence or repetition penalty
    and no per-request seed (see the module docstring)."""
    return settings.presence_penalty == 0.0 and settings.repetition_penalty == 1.0 and settings.seed is None


def continuable(row: dict[str, Any] | None, settings: GenerationSettings, check_text: bool = True) -> bool:
    """Whether ``row`` can be continued under ``settings`` rather than regenerated.

    True for a ``length`` row cut by its own cap (``completion_tokens == max_output_tokens``, below
    ``settings.max_output_tokens``), made with the same sampling fingerprint, with its text stored, when
    the sampling is history-free (no presence or repetition penalty, no seed; see the module docstring).
    A row whose error came from a failed continuation (it keeps its cut text, see
    :func:`merge_continuation`) is continuable again; any other error row is not. ``check_text=False``
    skips the text check, for callers that read only the count columns (``status``).
    """
    if row is None or row.get("finish_reason") != "length":
        return False  # first-pass error rows have no finish_reason
    if not history_free(settings):
        return False
    tokens = row.get("completion_tokens")
    if row.get("settings_fingerprint") != settings.sampling_fingerprint() or not tokens:
        return False
    if tokens != row.get("max_output_tokens") or tokens >= settings.max_output_tokens:
        return False  # not cut by its cap (a context limit), or the cap was not raised
    return not check_text or row.get("reasoning_content") is not None or bool(row.get("content"))


def prefix_text(row: dict[str, Any], opened: bool) -> str:
    """What the model wrote for ``row`` after the generation prompt (``opened``: that prompt already
    ends with ``<think>``), to send as the final assistant message."""
    return completion_layout(
        row.get("reasoning_content"), row.get("content"), bool(row.get("truncated_in_reasoning")), opened
    )


def continuation_body(
    settings: GenerationSettings,
    model: str,
    messages: list[dict[str, Any]],
    row: dict[str, Any],
    prefix: str,
    index: int | None = None,
    tools: str | list | None = None,
) -> dict[str, Any]:
    """Body for ``POST /v1/chat/completions`` continuing ``row``: its messages (and ``tools``, the conversation's
    stored tools) plus the prefix as an assistant message, ``continue_final_message``, raw text back, and
    ``max_tokens`` = the new cap minus the tokens the row has (so the whole row stays within the cap)."""
    body = settings.request_body(model, [*messages, {"role": "assistant", "content": prefix}], index, tools)
    body["max_tokens"] = settings.max_output_tokens - int(row["completion_tokens"])
    body["continue_final_message"] = True
    body["separate_reasoning"] = False
    return body


def merge_continuation(
    row: dict[str, Any], result: Any, prompt: dict[str, Any], settings: GenerationSettings
) -> dict[str, Any]:
    """The row ``row`` continued by ``result`` (a
    :class:`~dflash_assets.generation.client.completion_client.CompletionResult`).

    Text: the new text is appended where ``row`` was cut: to the reasoning when the cut was inside the
    thinking (up to a ``</think>``, after which comes the answer), else to the answer; the seam is
    stored in :func:`~dflash_assets.generation.rows.records.split_reasoning`'s form. Counts:
    ``completion_tokens`` = the row's + the new; ``prompt_tokens`` the row's (the server counts the prefix
    as prompt); ``output_token_ids`` None (the server re-tokenized the prefix text);
    ``continued_from_tokens`` the row's tokens; ``latency_s`` and ``attempts`` the sums of the row's and
    the continuation's, ``tail_chunks`` the row's.

    A failed request, a reply without ``usage.completion_tokens`` or with another ``finish_reason`` than
    stop/length, or one that starts a new ``<think>`` (a server that ignored ``continue_final_message``
    and answered afresh: :data:`NOT_CONTINUED`), gives an error row that keeps ``row``'s text, cap and
    counts, so the next run continues it again instead of regenerating it whole.
    """
    merged = row_from_result(result, prompt, settings)
    raw = (result.content or "") if result.reasoning_content is None else None
    error = result.error
    if (
        error is None
        and raw is not None
        and raw.lstrip().startswith(THINK_OPEN)
        and row.get("reasoning_content") is not None
    ):
        error = NOT_CONTINUED
    elif error is None and result.completion_tokens is None:
        error = "the continuation's reply has no usage.completion_tokens"
    elif error is None and result.finish_reason not in ("stop", "length"):
        error = f"the continuation ended with finish_reason {result.finish_reason}"
    if error is not None:
        return {
            **row,
            "error": error,
            "latency_s": merged["latency_s"],
            "server": merged["server"],
            "attempts": merged["attempts"],
            "continued_from_tokens": 0,
        }
    old_tokens = int(row["completion_tokens"])
    old_reasoning, old_answer = row.get("reasoning_content"), row.get("content") or ""
    if raw is None:  # the server split it anyway
        head, new_answer = result.reasoning_content, result.content or ""
        closed = bool(new_answer.strip()) or result.finish_reason != "length"
    else:
        head, sep, new_answer = raw.partition(THINK_CLOSE)
        closed = bool(sep)
    if old_reasoning is not None and row.get("truncated_in_reasoning"):
        reasoning = old_reasoning + head
        answer = new_answer.lstrip("\n") if closed else ""
        if closed:
            reasoning = reasoning.rstrip("\n")
    else:  # cut in the answer (or no thinking at all): everything new is answer, however the server labelled it
        reasoning, closed = old_reasoning, True
        answer = old_answer + (result.reasoning_content or "") + (result.content or "")
    merged.update(
        reasoning_content=reasoning,
        content=answer,
        prompt_tokens=row.get("prompt_tokens"),
        prompt_token_ids=row.get("prompt_token_ids"),  # the continuation's prompt holds the prefix too
        completion_tokens=old_tokens + int(result.completion_tokens or 0),
        output_token_ids=None,
        output_token_ids_source=NO_OUTPUT_IDS,
        ids_source=IDS_RENDERED,  # the server re-tokenized the prefix: the project renders the row's text
        truncated_in_reasoning=bool(result.finish_reason == "length" and reasoning is not None and not closed),
        empty_answer=not answer.strip(),
        tool_call=holds_tool_call(answer),
        continued_from_tokens=old_tokens,
        # the row's requests together: an earlier run's chunks and attempts are still part of it
        latency_s=round(float(row.get("latency_s") or 0.0) + merged["latency_s"], 4),
        attempts=int(row.get("attempts") or 0) + merged["attempts"],
        tail_chunks=int(row.get("tail_chunks") or 0),
    )
    return merged
