"""The ``completions`` stage outside any Dagster run: a run over one partition or a range of them
(``range_run.py``), its stream of requests through one client (``range_stream.py``), the stage's stored tables
and ranged reads (``tables.py``), what a run continues rather than generates whole (``continuing.py``), the
on-policy mode (``on_policy.py``) and the stage's config, both modes' (``config.py``).
The asset hands in what it needs from the Dagster instance as callables."""
