"""The ``completions`` stage outside any Dagster run: a run over one partition or a range of them
(``range_run.py``), its stream of requests through one client (``range_stream.py``), the stage's stored tables
and ranged reads (``tables.py``) and what a run continues rather than generates whole (``continuing.py``).
The asset hands in what it needs from the Dagster instance as callables."""
