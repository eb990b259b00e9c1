"""What every room shares, no Dagster at import: the project config file, read strictly (``config``; its root
schema, every key in one place, is ``stages.config_schema``), generation settings and project paths
(``settings``), a row's stored conversation as servers and templates take it (``conversation``: data, generation
and settings share it), and the reporting primitives: PNG figures, the progress bar, cost figures.

The bottom of the layers: imports nothing of the package."""
