"""Cutting rows locally when the cap is lowered: a row longer than the new cap becomes its own first
``cap`` tokens, with no request.

Why the result is the same data: a request capped at C draws its first C tokens exactly as an uncapped
one does (each token given the prompt and the tokens before it; the cap only stops the loop), so the
first C tokens of a longer sample are a sample of the capped request. This holds for every sampling
setting, penalties and seeds included, unlike continuing (see :mod:`~dflash_assets.generation.rows.continuation`).

The tokens, in order of preference:

- the row's ``output_token_ids``, the model's own tokens (SGLang returns them: the client asks with
  ``return_token_ids``). The cut is exact.
- else its text as the model wrote it (:meth:`~dflash_assets.data.tokenization.SequenceBuilder.completion_text`,
  the layout tokenization trains on) encoded with the target's tokenizer, taken only when that encoding
  has the row's ``completion_tokens`` exactly (the end-of-turn token of a ``stop`` row aside) and decodes
  back to the same text; any other row is requested again. This is the text's own encoding, not
  necessarily the model's: a model may split a word its own way with the same count (2 of 48 SmolLM2
  samples in a review), and where the cap falls inside such a word the cut lands up to a word piece
  off. Tokenization encodes such rows' text the same way, so the data stays self-consistent.

The cut row says so: ``cut_from_tokens`` holds the tokens it had (and ``output_token_ids`` the cut
ones when it had ids).
"""

from __future__ import annotations

from typing import Any

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.rows.records import THINK_OPEN, holds_tool_call, split_reasoning


def cut_to_cap(
    row: dict[str, Any], messages: list[dict[str, str]], settings: GenerationSettings, builder: Any
) -> tuple[dict[str, Any] | None, str | None]:
    """One row of :func:`cut_rows`."""
    return cut_rows([(row, messages)], settings, builder)[0]


def cut_rows(
    rows: list[tuple[dict[str, Any], list[dict[str, str]]]], settings: GenerationSettings, builder: Any
) -> list[tuple[dict[str, Any] | None, str | None]]:
    """Each ``(row, messages)`` cut to ``settings.max_output_tokens`` tokens, or None and why it cannot be.

    Args:
        rows: whole completions rows (text included) with their prompts' chat messages (the template
            decides whether ``<think>`` opens the completion).
        builder: a :class:`~dflash_assets.data.tokenization.SequenceBuilder` on the target's tokenizer; the
            texts of rows without ids are encoded in one batch.

    Returns:
        per row ``(cut_row, None)``: ``finish_reason`` length, ``completion_tokens`` = ``max_output_tokens``
        = the cap, text and flags of the first cap tokens, ``output_token_ids`` those tokens when the row
        had ids, ``settings`` the current ones, ``cut_from_tokens`` the row's tokens,
        ``continued_from_tokens`` kept only while below the cap; latency, server and attempts those of the
        request that made the tokens. ``(None, reason)`` otherwise.
    """
    from dflash_assets.data.sequence_builder import TokenizationError

    cap, fingerprint = settings.max_output_tokens, settings.sampling_fingerprint()
    out: list[tuple[dict[str, Any] | None, str | None]] = [(None, None)] * len(rows)
    plans, texts = [], []
    prompts = builder.prompt_texts([m for _, m in rows], [settings.enable_thinking] * len(rows)) if rows else []
    for k, ((row, _), prompt) in enumerate(zip(rows, prompts, strict=True)):
        tokens = row.get("completion_tokens")
        if row.get("error") or not tokens or tokens <= cap:
            out[k] = (None, "not a finished row longer than the cap")
            continue
        if row.get("settings_fingerprint") != fingerprint:
            out[k] = (None, "made with other sampling settings")
            continue
        try:
            text = builder.completion_text(row, prompt)
        except TokenizationError as exc:
            out[k] = (None, str(exc))
            continue
        opened = row.get("reasoning_content") is not None and prompt.rstrip("\n").endswith(THINK_OPEN)
        plans.append((k, text, opened, None if row.get("output_token_ids") is not None else len(texts)))
        if row.get("output_token_ids") is None:
            texts.append(text)
    encoded = builder.encode_texts(texts) if texts else []
    tokenizer = builder.tokenizer
    for k, text, opened, position in plans:
        row = rows[k][0]
        tokens, stop = int(row["completion_tokens"]), row.get("finish_reason") == "stop"
        if position is None:
            ids = [int(t) for t in row["output_token_ids"]]
            if stop and len(ids) == tokens:
                ids = ids[:-1]  # the stop token, whichever the server counted
        else:
            ids = encoded[position]
        expected = tokens - 1 if stop else tokens  # a stop row's count includes its end-of-turn token
        if len(ids) != expected:
            out[k] = (None, "its text encodes to another token count than it was generated with")
            continue
        if position is not None and _decode(tokenizer, ids) != text:
            out[k] = (None, "its tokens do not decode back to its text")
            continue
        out[k] = (_cut(row, ids[:cap], opened, position is None, settings, tokenizer), None)
    return out


def _cut(
    row: dict[str, Any], head_ids: list[int], opened: bool, had_ids: bool, settings: GenerationSettings, tokenizer: Any
) -> dict[str, Any]:
    cap = settings.max_output_tokens
    head = _decode(tokenizer, head_ids)
    if row.get("reasoning_content") is not None:
        reasoning, answer, closed = split_reasoning((THINK_OPEN if opened else "") + head, None)
        if reasoning is None:  # the template opened the thinking and the head holds no marker
            reasoning, answer, closed = head.lstrip("\n"), "", False
    else:
        reasoning, answer, closed = None, head, True
    continued = int(row.get("continued_from_tokens") or 0)
    cut = dict(row)
    cut.update(
        reasoning_content=reasoning,
        content=answer,
        finish_reason="length",
        completion_tokens=cap,
        output_token_ids=[int(t) for t in head_ids] if had_ids else None,
        truncated_in_reasoning=bool(reasoning is not None and not closed),
        empty_answer=not (answer or "").strip(),
        tool_call=holds_tool_call(answer),
        max_output_tokens=cap,
        settings=settings.settings_json,
        continued_from_tokens=continued if continued < cap else 0,  # the cut may end inside the first request's part
        cut_from_tokens=int(row["completion_tokens"]),
    )
    return cut


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
