"""The app: the shell commands (``cli``), the main job (``main_job``), the stage order read from the asset
graph (``stage_order``), schedules and sensors (``automation``), and the reports a user reads, each as its figures
and their lines (``status`` and ``status_lines``, ``summary`` and ``summary_lines``), and ``cost_report``,
``cost_table``.

Top of the layers (docs/design.md, "Layers"): may import every room below it."""
