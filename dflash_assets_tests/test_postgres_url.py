"""``$DFLASH_POSTGRES_URL`` with a scheme other than psycopg2's is refused before Dagster uses it.

The input that showed it (a new user following docs/scale.md, 2026-12-06): ``postgresql://`` with psycopg 3
installed let ``status`` and ``dagster instance concurrency set`` succeed, then the first run failed writing its first
event (``NOTIFY run_events, $1``: a syntax error) and stayed NOT_STARTED; without psycopg 3 it was a bare traceback
ending in ``No module named 'psycopg'``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_assets.orchestration.instance_url import POSTGRES_URL_ENV, check_postgres_url

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "S3cretPGpw"


@pytest.mark.parametrize(
    "url, scheme",
    [
        (f"postgresql://dflash:{PASSWORD}@127.0.0.1:5432/dagster", "'postgresql'"),
        (f"postgres://dflash:{PASSWORD}@db:5432/dagster", "'postgres'"),
        (f"postgresql+psycopg://dflash:{PASSWORD}@db/dagster", "'postgresql+psycopg'"),
        (f"dflash:{PASSWORD}@db:5432/dagster", "no scheme"),
    ],
)
def test_another_scheme_is_refused_naming_it_and_never_the_password(url, scheme, monkeypatch):
    monkeypatch.setenv(POSTGRES_URL_ENV, url)
    with pytest.raises(ValueError) as err:
        check_postgres_url()
    text = str(err.value)
    assert f"{POSTGRES_URL_ENV} has {scheme if scheme == 'no scheme' else 'the scheme ' + scheme}" in text
    assert "postgresql+psycopg2://USER:PASSWORD@HOST:5432/DB" in text
    assert PASSWORD not in text and "dflash:" not in text


@pytest.mark.parametrize("value", [None, "", f"postgresql+psycopg2://dflash:{PASSWORD}@db:5432/dagster"])
def test_psycopg2_or_unset_passes(value, monkeypatch):
    if value is None:
        monkeypatch.delenv(POSTGRES_URL_ENV, raising=False)
    else:
        monkeypatch.setenv(POSTGRES_URL_ENV, value)
    assert check_postgres_url() is None


def run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        POSTGRES_URL_ENV: f"postgresql://dflash:{PASSWORD}@127.0.0.1:9/dagster",
        "DAGSTER_HOME": str(tmp_path),
    }
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_cli_and_the_definitions_refuse_it_before_opening_the_instance(tmp_path):
    status = run(["-m", "dflash_assets", "status"], tmp_path)
    assert status.returncode == 1
    assert status.stderr.strip().splitlines() == [
        f"error: {POSTGRES_URL_ENV} has the scheme 'postgresql': use postgresql+psycopg2://USER:PASSWORD@HOST:5432/DB. "
        "dagster-postgres needs psycopg2; a plain postgresql:// selects psycopg 3 under SQLAlchemy 2.1, on which a "
        "run's first event write fails (docs/scale.md, 'One instance for every node')"
    ]
    # what `dagster asset materialize`, the daemon and every worker load
    definitions = run(["-c", "import dflash_assets.definitions"], tmp_path)
    assert definitions.returncode == 1
    assert f"ValueError: {POSTGRES_URL_ENV} has the scheme 'postgresql'" in definitions.stderr
    assert PASSWORD not in status.stderr + status.stdout + definitions.stderr + definitions.stdout
