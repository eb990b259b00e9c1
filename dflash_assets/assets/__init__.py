"""One module per pipeline stage: its Dagster asset and checks, a thin body around the stage's code in
``stages/``. Below ``app/``: may import ``stages``, ``orchestration`` and the cores."""
