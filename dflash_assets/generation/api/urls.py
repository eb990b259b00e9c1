"""One URL rule for every request to an inference server, and redaction of what servers send back.

A base URL may be given with or without ``/v1`` (``http://h:30000`` or ``http://h:30000/v1``); the probe,
the client and the health checks all derive their endpoints from it here, so they never disagree.
Every text a server returns (error bodies, probe replies) goes through :func:`redact` before it reaches
a log, an exception, metadata or storage: a server may echo the ``Authorization`` header back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import urlsplit, urlunsplit

REDACTED = "***"
_USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://([^/\s@]+)@")


def api_root(base_url: str) -> str:
    """``http://h:p`` or ``http://h:p/v1`` -> ``http://h:p/v1`` (the OpenAI API root; trailing ``/`` dropped)."""
    base = base_url.strip().rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def chat_completions_url(base_url: str) -> str:
    """``POST`` endpoint for chat completions: ``{api_root}/chat/completions``."""
    return api_root(base_url) + "/chat/completions"


def origin(base_url: str) -> str:
    """``http://h:p/v1`` -> ``http://h:p`` (health routes such as SGLang's ``/health`` are not under /v1)."""
    base = base_url.strip().rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def strip_credentials(url: str) -> str:
    """The URL without ``user:password@`` (URLs go into logs and errors)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host += f":{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def redact(text: str, secrets: Iterable[str | None] | str | None) -> str:
    """``text`` with every occurrence of each non-empty secret replaced by ``***``.

    Args:
        text: any text a server sent back (or an error built from it).
        secrets: one secret or several (None / empty ones are ignored), e.g. the API key.
    """
    if isinstance(secrets, str) or secrets is None:
        secrets = [secrets]
    for secret in secrets:
        if secret and secret in text:
            text = text.replace(secret, REDACTED)
    return text


def url_secrets(texts: Iterable[str]) -> list[str]:
    """The credentials written into URLs within ``texts`` (pip requirements and options such as
    ``--extra-index-url=https://user:TOKEN@host/simple`` or ``pkg @ https://TOKEN@host/pkg.whl``): the password
    of ``user:password@``, or the whole user part when there is no password (a token), for :func:`redact`."""
    found = []
    for text in texts:
        for match in _USERINFO.finditer(text):
            user, colon, password = match.group(1).partition(":")
            secret = password if colon else user
            if secret and secret not in found:
                found.append(secret)
    return found
