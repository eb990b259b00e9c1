"""A live progress bar in a terminal for long stages (tqdm); the run log keeps its own lines.

A stage creates one :class:`StageProgressBar` and calls :meth:`StageProgressBar.update_to` from wherever it
already reports progress. The bar draws only when stderr is a terminal (``python -m dflash_assets run`` or
``dagster asset materialize`` typed in a shell); under the Dagster daemon, in CI or with output piped
nothing is drawn, so logs hold no carriage-return noise. ``DFLASH_PROGRESS_BAR=0`` turns it off, ``=1``
forces it on (for a test driving a pseudo-terminal).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tqdm import tqdm


def bars_enabled(stream=None) -> bool:
    """Whether progress bars draw: ``$DFLASH_PROGRESS_BAR`` (``0``/``1``) if set, else whether ``stream``
    (default stderr) is a terminal."""
    setting = os.environ.get("DFLASH_PROGRESS_BAR", "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


class StageProgressBar:
    """One stage's bar: done/total in ``unit`` (rows, steps, prompts), their rate and the ETA that tqdm
    computes, plus stage figures (e.g. ``tok/s``) as a postfix. A no-op when :func:`bars_enabled` is false.

    Use as a context manager, or call :meth:`close`. Never raises from :meth:`update_to`: a bar must not
    stop the stage it reports on.
    """

    def __init__(self, description: str, total: int | None, unit: str = "row", *, enabled: bool | None = None):
        self._bar = None
        if bars_enabled() if enabled is None else enabled:
            self._bar = tqdm(
                total=total, desc=description, unit=unit, dynamic_ncols=True, smoothing=0.1, file=sys.stderr, leave=True
            )

    @property
    def active(self) -> bool:
        """Whether a bar is being drawn."""
        return self._bar is not None

    def update_to(self, done: int, total: int | None = None, **figures: Any) -> None:
        """Move the bar to ``done`` units (absolute, not an increment); ``total`` changes the end (a range
        run whose plan grew); ``figures`` (name -> value, e.g. ``tok_s=1234``) show after the bar."""
        if self._bar is None:
            return
        try:
            if total is not None and total != self._bar.total:
                self._bar.total = total
            self._bar.n = done
            if figures:
                self._bar.set_postfix(
                    {k.replace("_s", "/s") if k.endswith("_s") else k: v for k, v in figures.items()}, refresh=False
                )
            self._bar.refresh()
        except Exception:
            self._bar = None

    def close(self) -> None:
        """End the bar (leaves its last state on screen)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> StageProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
