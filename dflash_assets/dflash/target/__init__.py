"""The target as the drafter sees it (plain torch + transformers, no Dagster): which decoder layers feed the
drafter, resolved once (``layers``), their hidden states captured (``features``), which kernels a hybrid target's
linear-attention layers run (``kernels``), its cache rolled back after a verify step (``hybrid_cache``), and its
next-token distribution from stored features, its last layers run on them (``tail``).

The bottom of ``dflash``: imports the cores below ``dflash`` only."""
