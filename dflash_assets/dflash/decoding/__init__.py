"""Speculative decoding with a DFlash drafter and its measures (plain torch + transformers, no Dagster):
``speculative`` (decoding with an HF target), ``evaluation`` (acceptance length, lossless check, speedup),
``teacher_forced`` (quick estimates of tau without decoding), ``acceptance`` and ``tau`` (the statistics).

May import its own modules and ``dflash.shards``, ``dflash.model``, ``dflash.target``, and the cores below
``dflash``."""
