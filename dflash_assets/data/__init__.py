"""The data the pipeline reads and derives, no Dagster: prompt files read as records (``reader``) in the common
shapes (``shapes``), stable prompt indices and their range keys (``prompt_index``, ``ranges``), token sequences
and loss masks (``tokenization``), completion-length statistics and cap advice (``truncation``, ``cap_backtest``).

A core: imports only the cores below it (``generation``, ``dflash``, ``storage``, ``common``)."""
