"""Training the drafter (plain torch, no Dagster): the run's settings and config (``config``), the entry point
``python -m dflash_assets.dflash.training.train`` (``train``) and its named steps (``setup``, ``loop``), the data
order per (step, rank) (``batches``), checkpoints (``checkpoints``), held-out loss and accuracy (``held_out``),
online target features computed per batch (``online``), this process's place in a ``torchrun`` job
(``process_group``) and ``torchrun`` command lines (``distributed``).

May import its own modules and ``dflash.export``, ``dflash.shards``, ``dflash.model``, ``dflash.target``, and the
cores below ``dflash``."""
