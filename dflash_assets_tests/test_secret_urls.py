"""Issue 50, findings 1 and 2 (and the ``amqp://`` traceback read in code): a URL that carries a password is checked
whole before any library sees it, and what the broker's and the database's libraries say is scrubbed of it.

The inputs that showed them: ``DFLASH_CELERY_BROKER=redis://:pass/word@host:6379/0`` (an unencoded ``/``: kombu's
"Port could not be cast to integer value as 'pass'" was stored in the run's ENGINE_EVENT and RUN_FAILURE events) and
``DFLASH_POSTGRES_URL=postgresql+psycopg2://dagster:pass@word@127.0.0.1/dagster`` (an unencoded ``@``: ``status``
printed ``could not translate host name "word@127.0.0.1"`` eight times).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_assets.orchestration.cluster import CELERY_BROKER_ENV, celery_broker_url
from dflash_assets.orchestration.instance_url import POSTGRES_URL_ENV, check_postgres_url

ROOT = Path(__file__).resolve().parent.parent
BROKER = "redis://:pass/word@host:6379/0"
POSTGRES = "postgresql+psycopg2://dagster:pass@word@127.0.0.1/dagster"


@pytest.fixture(autouse=True)
def forget_secrets():
    """The secrets registered by a test are scrubbed from this test's text only (``pass`` is in ``passed``)."""
    try:
        from dflash_assets.orchestration import service_urls
    except ImportError:  # 1119868: nothing is registered
        yield
        return
    before = set(service_urls._SECRETS)
    yield
    service_urls._SECRETS.clear()
    service_urls._SECRETS.update(before)


def _no_part_of_the_password(text: str) -> None:
    """No ``pass`` nor ``word`` in ``text`` but in the word "password" (the fix names what to encode in it)."""
    rest = text.lower().replace("password", "")
    assert "pass" not in rest and "word" not in rest, text


def test_a_broker_password_with_a_slash_is_refused_naming_the_variable_never_the_value(monkeypatch):
    monkeypatch.setenv(CELERY_BROKER_ENV, BROKER)
    with pytest.raises(ValueError) as err:
        celery_broker_url()
    text = str(err.value)
    assert text.startswith(f"{CELERY_BROKER_ENV} has a port that is not a number")
    assert "'/' is %2F" in text and "redis://[:PASSWORD@]HOST:6379/0" in text
    _no_part_of_the_password(text)


@pytest.mark.parametrize(
    "url, why",
    [
        ("redis://:p@ss@host:6379/0", "more than one '@'"),
        ("redis://:pa#ss@host:6379/0", "has a '#'"),
        ("redis://:pa ss@host:6379/0", "a space"),
        ("redis://host:6379/zero", "must be a database number"),
        ("redis://:pw@/0", "no host"),
    ],
)
def test_other_malformed_broker_urls_are_refused(url, why, monkeypatch):
    monkeypatch.setenv(CELERY_BROKER_ENV, url)
    with pytest.raises(ValueError, match=CELERY_BROKER_ENV) as err:
        celery_broker_url()
    assert why in str(err.value)
    assert url not in str(err.value) and "ss@" not in str(err.value)


def test_well_formed_broker_urls_pass(monkeypatch):
    for url in ("redis://:p%2Fss%40w@127.0.0.1:6379/0", "rediss://user:pw@broker.example:6380/3", "redis://h"):
        monkeypatch.setenv(CELERY_BROKER_ENV, url)
        assert celery_broker_url() == url


def test_a_postgres_password_with_an_at_sign_is_refused_naming_the_variable_never_the_value(monkeypatch):
    monkeypatch.setenv(POSTGRES_URL_ENV, POSTGRES)
    with pytest.raises(ValueError) as err:
        check_postgres_url()
    text = str(err.value)
    assert text.startswith(f"{POSTGRES_URL_ENV} has more than one '@' before the host")
    _no_part_of_the_password(text)
    monkeypatch.setenv(POSTGRES_URL_ENV, "postgresql+psycopg2://dagster:p%40ss@127.0.0.1:5432/dagster")
    assert check_postgres_url() is None


def _cli(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (CELERY_BROKER_ENV, POSTGRES_URL_ENV)} | env
    env["DAGSTER_HOME"] = str(tmp_path)
    argv = [sys.executable, "-m", "dflash_assets", "status"]
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "variable, url, first_words",
    [
        (POSTGRES_URL_ENV, POSTGRES, f"error: {POSTGRES_URL_ENV} has more than one '@'"),
        (CELERY_BROKER_ENV, BROKER, f"error: {CELERY_BROKER_ENV} has a port that is not a number"),
        # read in code: any other scheme printed a traceback from the definitions' import
        (CELERY_BROKER_ENV, "amqp://guest:s3cretAMQP@rabbit//", f"error: {CELERY_BROKER_ENV} must be a Redis URL"),
    ],
)
def test_status_says_one_line_naming_the_variable(variable, url, first_words, tmp_path):
    done = _cli({variable: url}, tmp_path)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(first_words), done.stderr[-3000:]
    out = done.stdout + done.stderr
    _no_part_of_the_password(out)
    assert "s3cretAMQP" not in out


def test_log_lines_of_the_database_libraries_are_scrubbed(monkeypatch):
    """dagster-postgres logs each failed connection with the driver's error text (``logging.warning`` on the root
    logger); whatever quotes the URL or its password reaches no handler."""
    url = "postgresql+psycopg2://dagster:S3cret%2Fpw@127.0.0.1:1/dagster"
    monkeypatch.setenv(POSTGRES_URL_ENV, url)
    check_postgres_url()
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    handler = Keep()
    logging.getLogger().addHandler(handler)
    try:
        logging.warning("Retrying failed database connection: %s", f"could not connect to {url}")
        logging.getLogger("sqlalchemy.pool").error("password S3cret/pw refused")
        try:
            raise RuntimeError("driver said S3cret%2Fpw")
        except RuntimeError:
            logging.getLogger("dagster").exception("failed")
    finally:
        logging.getLogger().removeHandler(handler)
    text = "\n".join(records)
    assert "S3cret" not in text
    assert "could not connect to ***" in text and "password *** refused" in text and "driver said ***" in text


def test_broker_errors_reach_dagster_scrubbed(monkeypatch):
    """What the executor raises becomes the run's ENGINE_EVENT and RUN_FAILURE (with its causes): an error quoting
    the broker's password is re-raised scrubbed and without its chain; others pass unchanged."""
    from dflash_assets.orchestration.service_urls import ScrubbedError, scrub, scrubbed_errors

    monkeypatch.setenv(CELERY_BROKER_ENV, "redis://:Br0kerS3cret@127.0.0.1:6379/0")
    celery_broker_url()
    with pytest.raises(ScrubbedError) as err, scrubbed_errors():
        try:
            raise ValueError("Port could not be cast to integer value as 'Br0kerS3cret'")
        except ValueError as exc:
            raise ConnectionError("broker unreachable") from exc
    assert str(err.value) == (
        "ConnectionError: broker unreachable <- ValueError: Port could not be cast to integer value as '***'"
    )
    assert err.value.__cause__ is None and err.value.__suppress_context__
    with pytest.raises(KeyError), scrubbed_errors():
        raise KeyError("no secret here")
    assert scrub("redis://:Br0kerS3cret@127.0.0.1:6379/0 and Br0kerS3cret") == "*** and ***"
