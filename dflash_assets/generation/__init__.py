"""Generation machinery, no Dagster, in rooms by role, top to bottom: the async client (``client/``); completions
rows, their journal and a range run's plan (``rows/``); inference servers, their launchers, registry and
supervision (``servers/``); engine environments, local targets and the chat template (``engines/``); processes,
ports and machines (``processes/``); the OpenAI-compatible API both sides speak (``api/``). A room imports its own
modules and the rooms below it in this order.

A core: imports the cores below it (``dflash``, ``storage``, ``common``)."""
