"""The drafter's training run around :mod:`dflash_assets.dflash.training.train`: its settings (``config.py``, the
asset's Dagster config), where its target features come from (``features.py``: the storage plan decides
offline shards or the online target, in one place), identity, launcher, loss plot and report. The
``dflash_drafter`` asset calls down into these; ``features.py`` and ``config.py`` use Dagster types, the others
import no Dagster themselves and raise plain errors that the asset turns into failures."""
