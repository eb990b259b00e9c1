"""The cost resource: the price that turns the per-stage device-seconds into money."""

import dagster as dg
from pydantic import Field


class CostResource(dg.ConfigurableResource):
    """Prices for the per-stage cost table (:mod:`dflash_assets.app.cost_table`) and the forecast.

    ``device_hour_usd``: USD per device-hour of a stage's device (one GPU on a GPU node; one CPU core, or
    one CPU-second of process time, on a CPU run; one server for external servers). None (the default):
    the table shows device-hours only. No asset reads it: ``status`` and the summary do.
    """

    device_hour_usd: float | None = Field(
        strict=True,
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="USD per device-hour (e.g. one GPU's hourly price); None: no money column.",
    )
