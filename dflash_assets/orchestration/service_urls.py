"""URLs that carry a password (the cluster's broker and database), checked before any library sees them, and the
errors and log lines of those libraries scrubbed of them.

A password with an unencoded ``/``, ``@``, ``?`` or ``#`` moves the URL's own delimiters: in
``redis://:pass/word@host:6379/0`` the host part ends at the ``/``, so kombu read ``pass`` as the port and said so in
its error (stored in the run's events); in ``postgresql+psycopg2://dagster:pass@word@127.0.0.1/dagster`` libpq took
``word@127.0.0.1`` for the host and printed it in every retry. So each URL is split here as RFC 3986 says
(:func:`urllib.parse.urlsplit`; the database's also by :func:`sqlalchemy.engine.make_url`, which must read the same
parts), and one that is ambiguous or malformed is a one-line error naming the variable and what to fix, never the
value nor any part of it.

Errors and log lines that the broker's and the database's libraries write still may quote what they were given, so
:func:`scrub` replaces the URL and its secret parts (the password, raw and percent-decoded, and the user info) by
``***`` in any text, :func:`install_log_scrubber` does it to every log record of the process, and
:func:`scrubbed_errors` to an exception on its way to Dagster (its events, the UI).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import SplitResult, unquote, urlsplit

__all__ = [
    "ScrubbedError",
    "ServiceUrlError",
    "checked_url",
    "install_log_scrubber",
    "register_secret_url",
    "scrub",
    "scrubbed_errors",
]

#: RFC 3986 ``userinfo``: unreserved, sub-delims, ``:`` and percent-encoded octets; nothing else unencoded.
_USERINFO = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:]|%[0-9A-Fa-f]{2})*")
_ENCODE_HINT = (
    "percent-encode the user and password (Python: urllib.parse.quote(password, safe='')): '@' is %40, '/' is %2F, "
    "':' in the user is %3A, '?' is %3F, '#' is %23, '%' is %25"
)


class ServiceUrlError(ValueError):
    """A URL in the environment that cannot be used as it is; the message names the variable, never the value."""


@dataclass(frozen=True)
class _Parts:
    host: str | None
    port: int | None
    user: str
    password: str
    path: str


def _split(env: str, raw: str, form: str) -> tuple[SplitResult, _Parts]:
    def bad(why: str) -> ServiceUrlError:
        return ServiceUrlError(f"{env} {why}: use {form}; {_ENCODE_HINT}")

    if any(c.isspace() or not c.isprintable() for c in raw):
        raise bad("holds a space or a control character")
    parts = urlsplit(raw)
    netloc = parts.netloc
    if "@" in netloc and netloc.count("@") > 1:
        raise bad("has more than one '@' before the host (an '@' in the user or password is not encoded)")
    userinfo = netloc.rpartition("@")[0] if "@" in netloc else ""
    if not _USERINFO.fullmatch(userinfo):
        raise bad("has a character in its user or password that must be percent-encoded")
    if parts.fragment or raw.endswith("#"):
        raise bad("has a '#' (an unencoded '#' in the password ends the URL there)")
    try:
        port = parts.port
    except ValueError:
        raise bad("has a port that is not a number in 0-65535 (a ':' or '/' in the password is not encoded?)") from None
    host = parts.hostname
    user, _, password = userinfo.partition(":")
    try:
        user, password = unquote(user, errors="strict"), unquote(password, errors="strict")
    except UnicodeDecodeError:
        raise bad("has a percent-encoded user or password that is not UTF-8") from None
    return parts, _Parts(host, port, user, password, parts.path)


def checked_url(env: str, raw: str, schemes: tuple[str, ...], form: str, *, sqlalchemy: bool = False) -> SplitResult:
    """``raw`` (the value of environment variable ``env``) split as RFC 3986 says, once it is unambiguous: a scheme
    of ``schemes``, at most one ``@`` before the host, user info percent-encoded where it must be, no fragment, a
    host (unless the query names one: ``?host=/run/postgresql``), a numeric port. With ``sqlalchemy`` the URL must
    also read the same to :func:`sqlalchemy.engine.make_url` (what dagster-postgres opens). Registers the URL with
    :func:`register_secret_url`, so its parts are scrubbed from log lines and errors from then on.

    Raises:
        ServiceUrlError: naming ``env``, the scheme found when it is not one of ``schemes`` (a scheme holds no
            secret), what is wrong and the form ``form`` to use; never the URL nor a part of it.
    """
    scheme = raw.split("://", 1)[0] if "://" in raw else ""
    if scheme not in schemes:
        said = f"the scheme {scheme!r}" if scheme and _USERINFO.fullmatch(scheme) else "no scheme"
        raise ServiceUrlError(f"{env} has {said}: use {form}")
    register_secret_url(raw)  # before any check can fail: the caller's error must not quote it either
    parts, got = _split(env, raw, form)
    if not got.host and "host=" not in parts.query:
        raise ServiceUrlError(
            f"{env} has no host (a '/', '?' or '#' in the password ends the host part early): use {form}; "
            f"{_ENCODE_HINT}"
        )
    if sqlalchemy:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            url = make_url(raw)
        except (ArgumentError, ValueError):
            url = None
        same = url is not None and ((url.host or "").lower(), url.port, url.username or "", url.password or "") == (
            (got.host or "").lower(),
            got.port,
            got.user,
            got.password,
        )
        if not same:
            raise ServiceUrlError(f"{env} reads differently to the database driver: use {form}; {_ENCODE_HINT}")
    return parts


# -- scrubbing ---------------------------------------------------------------------------------------------------

_SECRETS: set[str] = set()
_SECRETS_LOCK = threading.Lock()


def register_secret_url(raw: str) -> None:
    """Scrub ``raw`` and its secret parts from every later :func:`scrub` (the log scrubber and
    :func:`scrubbed_errors` included): the whole URL, its user info, and its password raw and percent-decoded.
    Parts are found leniently, so a malformed URL registers too."""
    rest = raw.strip().split("://", 1)[-1]
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    # a password with '/' or '@' unencoded: everything between the scheme and the last '@' is secret too
    found = {raw.strip()}
    for info in (authority.rpartition("@")[0], rest.rpartition("@")[0]):
        password = info.partition(":")[2]
        found |= {info, password, unquote(password)}
    with _SECRETS_LOCK:
        _SECRETS.update(s for s in found if s)


def scrub(text: str) -> str:
    """``text`` with every registered URL and secret part replaced by ``***`` (longest first)."""
    with _SECRETS_LOCK:
        secrets = sorted(_SECRETS, key=len, reverse=True)
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, "***")
    return text


_INSTALLED = False


def install_log_scrubber() -> None:
    """Scrub every log record this process makes from now on (any logger, any handler, Dagster's and the
    libraries' included): its message is formatted and scrubbed at creation, and its exception text too.
    Idempotent."""
    global _INSTALLED
    with _SECRETS_LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
    make = logging.getLogRecordFactory()
    formatter = logging.Formatter()

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if not _SECRETS:
            return record
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging reports it itself, unscrubbed args aside
            message = str(record.msg)
        record.msg, record.args = scrub(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = scrub(formatter.formatException(record.exc_info))
        return record

    logging.setLogRecordFactory(factory)


class ScrubbedError(RuntimeError):
    """An error whose text held a secret URL's part: its type and scrubbed message, without the original chain."""


@contextmanager
def scrubbed_errors() -> Iterator[None]:
    """Re-raise an exception of the block whose message (or a cause's) holds a registered secret as a
    :class:`ScrubbedError` with the scrubbed text of the whole chain and no chain of its own (Dagster stores an
    error's causes in its events); other exceptions pass unchanged."""
    try:
        yield
    except Exception as exc:
        chain, seen = [], set()
        current: BaseException | None = exc
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            chain.append(f"{type(current).__name__}: {current}")
            current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
        text = " <- ".join(chain)
        clean = scrub(text)
        if clean == text:
            raise
        raise ScrubbedError(clean).with_traceback(exc.__traceback__) from None


def env_url(env: str) -> str:
    """The stripped value of ``env`` ('' when unset)."""
    return os.environ.get(env, "").strip()
