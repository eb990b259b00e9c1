"""Cutting rows locally when the cap is lowered: a row longer than the new cap becomes its own first
``cap`` tokens, with no request.

Why the result is the same data: a request capped at C draws its first C tokens exactly as an uncapped
one does (each token given the prompt and the tokens before it; the cap only stops the loop), so the
first C tokens of a longer sample are a sample of the capped request. This holds for every sampling
setting, penalties and seeds included, unlike continuing (see :mod:`~dflash_assets.generation.continuation`).

The tokens: the row's ``output_token_ids`` when the server returned them; else its text as the model
wrote it (:meth:`~dflash_assets.tokenization.SequenceBuilder.completion_text`, the layout tokenization
trains on) encoded with the target's tokenizer. A row is cut only when those tokens account for its
``completion_tokens`` exactly (the end-of-turn token of a ``stop`` row aside) and decode back to the same
text; any other row is regenerated, as before. The cut row says so: ``cut_from_tokens`` holds the
tokens it had.
"""

from __future__ import annotations

from typing import Any

from dflash_assets.generation.records import THINK_OPEN, split_reasoning
from dflash_assets.settings import GenerationSettings


def cut_to_cap(row: dict[str, Any], messages: list[dict[str, str]], settings: GenerationSettings,
               builder: Any) -> tuple[dict[str, Any] | None, str | None]:
    """``row`` cut to ``settings.max_output_tokens`` tokens, or None and why it cannot be.

    Args:
        row: a whole completions row (text included) longer than the new cap, same sampling fingerprint.
        messages: its prompt's chat messages (the template decides whether ``<think>`` opens the completion).
        builder: a :class:`~dflash_assets.tokenization.SequenceBuilder` on the target's tokenizer.

    Returns:
        ``(cut_row, None)``: ``finish_reason`` length, ``completion_tokens`` = ``max_output_tokens`` = the
        cap, text and flags of the first cap tokens, ``output_token_ids`` those tokens when the row had
        ids, ``settings`` the current ones, ``cut_from_tokens`` the row's tokens; latency, server and
        attempts those of the request that made the tokens. ``(None, reason)`` otherwise.
    """
    cap, tokens = settings.max_output_tokens, row.get("completion_tokens")
    if row.get("error") or not tokens or tokens <= cap:
        return None, "not a finished row longer than the cap"
    if row.get("settings_fingerprint") != settings.sampling_fingerprint():
        return None, "made with other sampling settings"
    tokenizer = builder.tokenizer
    stop = row.get("finish_reason") == "stop"
    thinking = row.get("reasoning_content") is not None
    from dflash_assets.tokenization import TokenizationError

    try:
        prompt = builder.prompt_text(messages, settings.enable_thinking)
        text = builder.completion_text(row, prompt)
    except TokenizationError as exc:
        return None, str(exc)
    opened = thinking and prompt.rstrip("\n").endswith(THINK_OPEN)
    if row.get("output_token_ids") is not None:
        ids = [int(t) for t in row["output_token_ids"]]
        if stop and ids and ids[-1] == builder.end_token_id:
            ids = ids[:-1]
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = tokens - 1 if stop else tokens  # a stop row's count includes its end-of-turn token
    if len(ids) != expected:
        return None, f"its text encodes to {len(ids)} tokens, not the {expected} it was generated with"
    if _decode(tokenizer, ids) != text:
        return None, "its tokens do not decode back to its text"
    head = _decode(tokenizer, ids[:cap])
    if thinking:
        reasoning, answer, closed = split_reasoning((THINK_OPEN if opened else "") + head, None)
        if reasoning is None:  # the template opened the thinking and the head holds no marker
            reasoning, answer, closed = head.lstrip("\n"), "", False
    else:
        reasoning, answer, closed = None, head, True
    cut = dict(row)
    cut.update(
        reasoning_content=reasoning,
        content=answer,
        finish_reason="length",
        completion_tokens=cap,
        output_token_ids=[int(t) for t in ids[:cap]] if row.get("output_token_ids") is not None else None,
        truncated_in_reasoning=bool(reasoning is not None and not closed),
        empty_answer=not (answer or "").strip(),
        max_output_tokens=cap,
        settings=settings.settings_json,
        cut_from_tokens=int(tokens),
    )
    return cut, None


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
