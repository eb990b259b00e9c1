"""Matplotlib figures as PNG bytes, rendered off-screen (no Dagster, no pyplot state).

Figures are made by :func:`new_figure` as bare ``matplotlib.figure.Figure`` objects on an Agg canvas:
no GUI backend is needed or chosen (``matplotlib.use`` is never called), nothing is registered with
pyplot, and concurrent assets in one process cannot draw on each other's current figure.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["figure_png_bytes", "new_figure"]


def new_figure(figsize: tuple[float, float] = (7.0, 3.5), dpi: int = 100) -> tuple[Figure, Axes]:
    """A figure with one axes filling it, on an Agg canvas (off-screen raster renderer).

    Args:
        figsize: width, height in inches; the PNG is ``figsize * dpi`` pixels.
        dpi: dots (pixels) per inch.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)  # attaches itself as fig.canvas
    return fig, fig.add_subplot(1, 1, 1)


def figure_png_bytes(fig: Figure) -> bytes:
    """PNG bytes of ``fig`` (Agg renderer), deterministic, and the figure closed.

    The PNG carries no ``Software`` (matplotlib version) text chunk, and matplotlib writes no date
    into PNGs, so equal figures give equal bytes on every run (the pixels themselves still depend on
    the matplotlib version and fonts installed). A figure made through pyplot is closed (``plt.close``) so
    it does not pile up in pyplot's registry; a :func:`new_figure` one needs nothing and is freed with its
    last reference.
    """
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", metadata={"Software": None})
    finally:
        if getattr(fig.canvas, "manager", None) is not None:
            import matplotlib.pyplot as plt

            plt.close(fig)
    return buf.getvalue()
