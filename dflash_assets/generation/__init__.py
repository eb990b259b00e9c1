"""Generation machinery, no Dagster: local model preparation, engine environments, server launchers and
supervision, the async client, the row journal, and which machine a recorded pid belongs to (``machine``).

A core: imports the cores below it (``dflash``, ``storage``, ``common``)."""
