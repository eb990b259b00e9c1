"""The drafter's training run around :mod:`dflash_assets.dflash.train`: its identity, settings, launcher and
loss plot (no Dagster import; the ``dflash_drafter`` asset turns their errors into failures)."""
