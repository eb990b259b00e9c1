"""Storage, no Dagster: the one storage layer over a local root or S3 (``store``), atomic local writes
(``atomic``), the cross-host store lock (``lock``), and which stage outputs exist or are stale
(``stage_outputs``, ``stale_outputs``).

A core: imports only ``common`` below it."""
