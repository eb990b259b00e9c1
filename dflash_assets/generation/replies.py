"""Reading an OpenAI-compatible server's replies: the fields of a chat completion (SGLang, vLLM and
transformers serve spell some differently) and the error text of a failed request."""

from __future__ import annotations

import json
from typing import Any

import httpx

_MAX_ERROR_CHARS = 500


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _int_list_or_none(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def parse_chat_completion(payload: Any) -> dict[str, Any]:
    """Fields of a non-streaming chat-completion reply, as :class:`~dflash_assets.generation.client.CompletionResult` names them.

    Args:
        payload: the decoded JSON reply of ``POST /v1/chat/completions``.

    Returns:
        dict with reasoning_content, content, finish_reason, prompt_tokens, completion_tokens,
        output_token_ids, prompt_token_ids (each None when the reply lacks it).

    Raises:
        ValueError: the reply has no ``choices[0]`` object (not a chat completion).
    """
    if not isinstance(payload, dict):
        raise ValueError(f"reply is not a JSON object: {type(payload).__name__}")
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("reply has no choices[0]")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning = message.get("reasoning")  # vLLM >= 0.10 name
    usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}

    # Generated ids: SGLang/vLLM `return_token_ids` -> choices[0].token_ids; older SGLang output_ids;
    # last resort, logprobs entries that carry an integer token_id.
    output_ids = _int_list_or_none(choice.get("token_ids"))
    if output_ids is None:
        output_ids = _int_list_or_none(choice.get("output_ids"))
    if output_ids is None:
        logprobs = choice.get("logprobs")
        entries = logprobs.get("content") if isinstance(logprobs, dict) else None
        if isinstance(entries, list) and entries:
            ids = [e.get("token_id") if isinstance(e, dict) else None for e in entries]
            output_ids = _int_list_or_none(ids)
    prompt_ids = _int_list_or_none(choice.get("prompt_token_ids"))
    if prompt_ids is None:
        prompt_ids = _int_list_or_none(payload.get("prompt_token_ids"))

    return {
        "reasoning_content": reasoning if isinstance(reasoning, str) else None,
        "content": message.get("content") if isinstance(message.get("content"), str) else None,
        "finish_reason": choice.get("finish_reason") if isinstance(choice.get("finish_reason"), str) else None,
        "prompt_tokens": _int_or_none(usage.get("prompt_tokens")),
        "completion_tokens": _int_or_none(usage.get("completion_tokens")),
        "output_token_ids": output_ids,
        "prompt_token_ids": prompt_ids,
    }


def server_error_message(response: httpx.Response) -> str:
    """The server's own error text: OpenAI ``{"error": {"message"}}``, SGLang ``{"message"}``,
    FastAPI ``{"detail"}``, else the raw body (truncated)."""
    text = response.text
    try:
        data = json.loads(text)
    except ValueError:
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
        message = json.dumps(message)
    message = " ".join(message.split())
    return message[:_MAX_ERROR_CHARS] + ("..." if len(message) > _MAX_ERROR_CHARS else "")
