"""The drafter evaluation around :mod:`dflash_assets.dflash.decoding.evaluation`: its settings (``config.py``, the
asset's Dagster config), prompt sets, the in-process decoding report and the serving-engine mode; the
``drafter_evaluation`` asset calls them. They raise ``dagster.Failure`` themselves, as they did inside the
asset module."""
