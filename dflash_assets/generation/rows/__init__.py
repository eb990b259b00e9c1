"""Completions rows (no Dagster): their schema, a reply made a row and when a row is still valid (``records``),
the append-only row journal and its copy to storage (``journal``, ``journal_sync``), what a range run requests and
reports (``range_plan``), continuing rows a cap cut (``continuation``) and a run's end in chunks (``tail_chunks``).

May import its own modules and ``generation.api``, and the cores below ``generation``."""
