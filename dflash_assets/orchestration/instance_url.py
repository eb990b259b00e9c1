"""The PostgreSQL URL of a cluster instance (``$DFLASH_POSTGRES_URL``, docs/scale.md), checked before Dagster uses it.

A plain ``postgresql://`` URL passes Dagster's own start-up: with psycopg 3 installed, reads and ``dagster instance``
commands work, and only the first run's event write fails (``NOTIFY run_events, $1``: a syntax error), leaving that
run stuck; without psycopg 3 it is a bare ``No module named 'psycopg'``. So the scheme is checked up front, and
the rest of the URL too (:func:`~dflash_assets.orchestration.service_urls.checked_url`): an unencoded ``@`` in the
password made libpq print a part of it as the host name, eight times, from ``status``.
"""

from __future__ import annotations

import os

from dflash_assets.orchestration.service_urls import checked_url, install_log_scrubber

#: Environment variable holding the instance's URL (``dflash_assets/configs/instance/dagster_cluster.yaml``).
POSTGRES_URL_ENV = "DFLASH_POSTGRES_URL"
POSTGRES_SCHEME = "postgresql+psycopg2"
FORM = f"{POSTGRES_SCHEME}://USER:PASSWORD@HOST:5432/DB"


def check_postgres_url() -> None:
    """Refuse a ``$DFLASH_POSTGRES_URL`` whose scheme is not ``postgresql+psycopg2`` or that is malformed or
    ambiguous (an unencoded ``@``, ``/``, ``?`` or ``#`` in the password; the driver must read the same host, port,
    user and password as RFC 3986); unset or empty passes. A URL that is set is registered for scrubbing and every
    log record of the process is scrubbed of it from then on (the database libraries' retries log their errors).

    Raises:
        ValueError: naming the variable, the scheme when it is another one, what is wrong and the form to use;
            never the URL nor a part of it (it holds the password).
    """
    raw = os.environ.get(POSTGRES_URL_ENV, "").strip()
    if not raw:
        return
    scheme = raw.split("://", 1)[0] if "://" in raw else ""
    if scheme == POSTGRES_SCHEME:
        install_log_scrubber()
        checked_url(POSTGRES_URL_ENV, raw, (POSTGRES_SCHEME,), FORM, sqlalchemy=True)
        return
    said = f"the scheme {scheme!r}" if scheme else "no scheme"
    raise ValueError(
        f"{POSTGRES_URL_ENV} has {said}: use {POSTGRES_SCHEME}://USER:PASSWORD@HOST:5432/DB. dagster-postgres needs "
        "psycopg2; a plain postgresql:// selects psycopg 3 under SQLAlchemy 2.1, on which a run's first event write "
        "fails (docs/scale.md, 'One instance for every node')"
    )
