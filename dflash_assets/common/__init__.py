"""What every room shares, no Dagster at import: the project config file (``config``), generation settings and
project paths (``settings``), and the reporting primitives: PNG figures, the progress bar, cost figures.

The bottom of the layers: imports nothing of the package."""
