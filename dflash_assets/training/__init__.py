"""The drafter's training run around :mod:`dflash_assets.dflash.train`: its settings (``config.py``, the
asset's Dagster config), identity, data, launcher, loss plot and report. The other modules import no Dagster
themselves (some reach it through the storage resource and feature_sources); they raise plain errors that
the ``dflash_drafter`` asset turns into failures."""
