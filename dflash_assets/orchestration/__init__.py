"""What the Dagster instance knows and decides: the partitions definition, materialization history, whether
a partition is up to date (``freshness``), the blocking-check gate, pools, and runs whose process died.

Below ``stages/``: may import the cores only."""
