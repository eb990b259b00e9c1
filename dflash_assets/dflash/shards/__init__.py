"""Hidden-state shards (no Dagster): the format on disk, written atomically and validated (``format``), a
partition's resumable extraction (``extraction``), and the shards read as a dataset of training batches
(``dataset``).

May import its own modules and ``dflash.model``, ``dflash.target``, and the cores below ``dflash``."""
