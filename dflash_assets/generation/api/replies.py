"""Reading an OpenAI-compatible server's replies: the fields of a chat completion (SGLang, vLLM and
transformers serve spell some differently) and the error text of a failed request.

A reply is checked before any of it becomes a row (:class:`ReplyError` otherwise, naming the field): the body
must decode (UTF-8 JSON, nested no deeper than the JSON reader goes), every text must be valid Unicode (a
lone surrogate such as JSON ``"\\ud800"`` cannot be written to the journal or Parquet), token counts must
lie in ``[0, 2**31)`` and token ids in ``[0, vocab_size)`` (``[0, 2**31)`` when the vocabulary is unknown;
ids are stored as Int32). A hostile server then costs the row it answered, never the run or the partition.
"""

from __future__ import annotations

import json
from typing import Any

_MAX_ERROR_CHARS = 500
#: Default cap on one reply body: a 32K-token reply with its token ids is under 1 MB; 280 requests in
#: flight at the cap hold at most ~2.2 GiB.
MAX_REPLY_BYTES = 8 << 20
#: Token counts and ids above this cannot be real (no context is 2**31 tokens) nor stored as Int32 ids.
MAX_TOKEN_VALUE = 2**31 - 1
#: Where a chat reply's ``choices[0]`` holds the generated ids, in the order read: SGLang's chat endpoint
#: (``response_token_ids``, with ``return_token_ids``), vLLM's and ``/v1/completions``' ``token_ids``, an
#: older SGLang's ``output_ids`` (the name ``/generate`` uses under ``meta_info``).
OUTPUT_ID_FIELDS = ("response_token_ids", "token_ids", "output_ids")
#: ``output_token_ids_source`` of a row that keeps no ids of the model's own (tokenization re-encodes its text).
NO_OUTPUT_IDS = "none"


class ReplyError(ValueError):
    """A 200 reply that cannot be a row: undecodable, not a chat completion, or a field out of range."""


def decode_reply(body: bytes) -> Any:
    """The JSON value of a reply body.

    Raises:
        ReplyError: not UTF-8 JSON, or nested deeper than the JSON reader allows (a RecursionError there).
    """
    try:
        return json.loads(body)
    except RecursionError:
        raise ReplyError(f"the {len(body):,}-byte body nests deeper than the JSON reader allows") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4,300 digits
        raise ReplyError(f"the body is not JSON ({printable(str(exc))[:200]})") from None


def printable(text: str) -> str:
    """``text`` as valid UTF-8: lone surrogates (and nothing else) written as ``\\udXXX`` escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _text(value: Any, field: str) -> str | None:
    if not isinstance(value, str):
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start].encode("unicode_escape").decode()
        raise ReplyError(
            f"{field} holds a lone surrogate ({bad} at character {exc.start:,}), which is not "
            "valid Unicode and cannot be stored"
        ) from None
    return value


def _int_or_none(value: Any, field: str) -> int | None:
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    if not 0 <= value <= MAX_TOKEN_VALUE:
        raise ReplyError(f"{field} is {_short(value)}, outside [0, 2**31): not a token count")
    return value


def _int_list_or_none(value: Any, field: str, vocab_size: int | None) -> list[int] | None:
    if not (isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        return None
    bound = min(vocab_size, MAX_TOKEN_VALUE + 1) if vocab_size else MAX_TOKEN_VALUE + 1
    if value and (min(value) < 0 or max(value) >= bound):  # C-speed scans; the position only when one is bad
        position, token = next((k, t) for k, t in enumerate(value) if not 0 <= t < bound)
        where = f"the vocabulary [0, {vocab_size:,})" if vocab_size else "[0, 2**31)"
        raise ReplyError(f"{field}[{position}] is {_short(token)}, outside {where}: not a token id")
    return list(value)


def _short(value: int) -> str:
    """An integer as text, shortened when huge (a 5,000-digit count is not worth quoting whole)."""
    text = str(value) if abs(value) < 10**30 else f"{'-' if value < 0 else ''}~2**{abs(value).bit_length() - 1}"
    return text


def parse_chat_completion(payload: Any, vocab_size: int | None = None) -> dict[str, Any]:
    """Fields of a non-streaming chat-completion reply, named as in
    :class:`~dflash_assets.generation.client.completion_client.CompletionResult`.

    Args:
        payload: the decoded JSON reply of ``POST /v1/chat/completions`` (:func:`decode_reply`).
        vocab_size: the served model's vocabulary size (token ids must be below it); None: unknown, ids
            must be below 2**31.

    Returns:
        dict with reasoning_content, content, finish_reason, prompt_tokens, completion_tokens,
        output_token_ids, prompt_token_ids (each None when the reply lacks it or gives another type), and
        output_token_ids_source: the field the ids came from (one of :data:`OUTPUT_ID_FIELDS`, ``logprobs``)
        or ``none``.

    Raises:
        ReplyError (a ValueError): the reply has no ``choices[0]`` object (not a chat completion), a text
            field holds a lone surrogate, a token count is negative or >= 2**31, or a token id is outside
            ``[0, vocab_size)``. The message names the field.
    """
    if not isinstance(payload, dict):
        raise ReplyError(f"reply is not a JSON object: {type(payload).__name__}")
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ReplyError("reply has no choices[0]")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning = message.get("reasoning")  # vLLM >= 0.10 name
    usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}

    # Generated ids, from where each engine puts them (OUTPUT_ID_FIELDS); last resort, logprobs entries that
    # carry an integer token_id. The first field that holds a list of ids wins.
    output_ids, source = None, NO_OUTPUT_IDS
    for name in OUTPUT_ID_FIELDS:
        output_ids = _int_list_or_none(choice.get(name), f"choices[0].{name}", vocab_size)
        if output_ids is not None:
            source = name
            break
    if output_ids is None:
        logprobs = choice.get("logprobs")
        entries = logprobs.get("content") if isinstance(logprobs, dict) else None
        if isinstance(entries, list) and entries:
            ids = [e.get("token_id") if isinstance(e, dict) else None for e in entries]
            output_ids = _int_list_or_none(ids, "choices[0].logprobs.content[].token_id", vocab_size)
            source = "logprobs" if output_ids is not None else NO_OUTPUT_IDS
    prompt_ids = _int_list_or_none(choice.get("prompt_token_ids"), "choices[0].prompt_token_ids", vocab_size)
    if prompt_ids is None:
        prompt_ids = _int_list_or_none(payload.get("prompt_token_ids"), "prompt_token_ids", vocab_size)

    return {
        "reasoning_content": _text(reasoning, "message.reasoning_content"),
        "content": _text(message.get("content"), "message.content"),
        "finish_reason": _text(choice.get("finish_reason"), "choices[0].finish_reason"),
        "prompt_tokens": _int_or_none(usage.get("prompt_tokens"), "usage.prompt_tokens"),
        "completion_tokens": _int_or_none(usage.get("completion_tokens"), "usage.completion_tokens"),
        "output_token_ids": output_ids,
        "output_token_ids_source": source,
        "prompt_token_ids": prompt_ids,
    }


def server_error_message(body: bytes) -> str:
    """The server's own error text from an error reply's body: OpenAI ``{"error": {"message"}}``, SGLang
    ``{"message"}``, FastAPI ``{"detail"}``, else the raw body; whitespace collapsed, at most 500 characters,
    always valid UTF-8. Never raises, whatever the body (deep nesting, bad bytes, lone surrogates)."""
    text = body.decode("utf-8", "backslashreplace")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        data = None
    message: Any = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            message = err.get("message")
        elif isinstance(err, str):
            message = err
        if message is None:
            message = data.get("message", data.get("detail"))
    if message is None:
        message = text
    if not isinstance(message, str):
        try:
            message = json.dumps(message)
        except (ValueError, TypeError, RecursionError):
            message = text
    message = printable(" ".join(message[: _MAX_ERROR_CHARS * 4].split()))
    return message[:_MAX_ERROR_CHARS] + ("..." if len(message) > _MAX_ERROR_CHARS else "")
