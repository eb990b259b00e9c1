"""What tests do when a system part (PostgreSQL, Redis, Chromium: Debian packages) is missing here."""

from __future__ import annotations

import os

import pytest


def skip_or_fail(missing: str | None) -> None:
    """Nothing when ``missing`` is None; else skip the test with that reason, except in CI (``$CI`` set), where it
    fails: ``.ci/run`` installs every such part, so a skip there would hide a test that never ran."""
    if missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(missing)
    pytest.skip(missing)
