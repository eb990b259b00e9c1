"""Start-up probes of OpenAI-compatible servers: one tiny generation, errors that name the URL and the fix.

The probe and the completions client share one URL rule
(:func:`~dflash_assets.generation.api.urls.chat_completions_url`),
and every text a server sends back is redacted before it goes into an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from dflash_assets.generation.api.urls import api_root, chat_completions_url, origin, redact, strip_credentials


def probe_chat(
    base_url: str,
    model: str,
    api_key: str | None = None,
    timeout_s: float = 60.0,
    extra_body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Send one tiny ``/chat/completions`` request (``max_tokens=2``) and return the decoded reply.

    The endpoint follows the client's rule (:func:`~dflash_assets.generation.api.urls.chat_completions_url`:
    ``base_url`` with or without ``/v1``). Every text from the server is redacted (``api_key``) first.

    Raises:
        httpx.TransportError: the server is not reachable (yet), or did not answer in ``timeout_s`` s.
        RuntimeError: it answered with an HTTP error, a body that is not JSON, or a reply without
            ``choices``; the message names the URL and what to try.
    """
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    body.update(extra_body or {})
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = chat_completions_url(base_url)
    shown = strip_credentials(url)
    r = httpx.post(url, json=body, headers=headers, timeout=timeout_s)
    text = redact(r.text, api_key)
    if r.status_code != 200:
        raise RuntimeError(
            f"probe POST {shown} got HTTP {r.status_code}: {text[:500]}; "
            f"{_probe_advice(r.status_code, base_url, model)}"
        )
    try:
        reply = r.json()
    except (ValueError, RecursionError):  # a body nested past the JSON reader's depth is not a reply either
        raise RuntimeError(
            f"probe POST {shown} got a reply that is not JSON: {text[:200]!r}; is "
            f"{strip_credentials(origin(base_url))} an OpenAI-compatible server (SGLang, vLLM, transformers serve)? "
            "base_urls take http://HOST:PORT or http://HOST:PORT/v1"
        ) from None
    if not isinstance(reply, dict) or not reply.get("choices"):
        raise RuntimeError(
            f"probe POST {shown} got a reply without choices: {redact(str(reply), api_key)[:500]}; "
            "is it an OpenAI-compatible chat completions endpoint?"
        )
    return reply


def _probe_advice(status: int, base_url: str, model: str) -> str:
    models = strip_credentials(api_root(base_url) + "/models")
    if status == 404:
        return (
            f"the server has no such route: check base_urls (http://HOST:PORT or http://HOST:PORT/v1; "
            f"try `curl {models}`)"
        )
    if status in (401, 403):
        return "the server refused the API key: set DFLASH_SERVER_API_KEY to the key the server was started with"
    if status in (400, 422):
        return f"check served_model_name {model!r} against the ids `curl {models}` lists"
    return f"check the server's log; `curl {models}` shows whether it is up"


def probe_external(base_url: str, model: str, api_key: str | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
    """:func:`probe_chat` for a server that should already be up: an unreachable one is a RuntimeError
    naming the URL and what to try (not a bare "Connection refused")."""
    try:
        return probe_chat(base_url, model, api_key, timeout_s=timeout_s)
    except httpx.TransportError as exc:
        shown = strip_credentials(chat_completions_url(base_url))
        raise RuntimeError(
            f"probe POST {shown} failed: {type(exc).__name__}: {redact(str(exc), api_key) or 'no answer'}; is the "
            f"server running and reachable from this host? try `curl {strip_credentials(api_root(base_url))}/models`; "
            "base_urls take http://HOST:PORT or http://HOST:PORT/v1"
        ) from None
