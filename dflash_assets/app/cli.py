"""Shell entry point: ``python -m dflash_assets run | status | mark-failed RUN_ID``.

Every command sets ``DAGSTER_HOME`` to the project root (where ``dagster.yaml`` lives) unless it is
already set, so run history persists and the Dagster UI shows the same runs; a ``DAGSTER_HOME`` without a
``dagster.yaml`` gets a copy of the project's, so no Dagster notice or banner reaches the output.
"""

import argparse
import os
import sys
from pathlib import Path

from dflash_assets.common.settings import PROJECT_ROOT
from dflash_assets.common.stop_signals import restore_stop_signals

#: The instance settings a DAGSTER_HOME without its own dagster.yaml gets: the project's (pools, run retries, the
#: run launcher that reaps killed runs, telemetry off); where the project's file is not beside the package (an
#: installed wheel), telemetry off alone.
INSTANCE_FILE = PROJECT_ROOT / "dagster.yaml"
MINIMAL_INSTANCE = "telemetry:\n  enabled: false\n"


def _ensure_dagster_home() -> str:
    """``$DAGSTER_HOME`` (default: the project root), made, with an instance file: Dagster prints a notice of a
    missing ``dagster.yaml`` on every instance it opens, and its telemetry banner, into the run's output. A home
    without one gets the project's, and one line says so."""
    home = os.environ.setdefault("DAGSTER_HOME", str(PROJECT_ROOT))
    os.makedirs(home, exist_ok=True)
    instance_file = Path(home, "dagster.yaml")
    if not instance_file.exists():
        text = INSTANCE_FILE.read_text() if INSTANCE_FILE.is_file() else MINIMAL_INSTANCE
        instance_file.write_text(text)
        print(f"DAGSTER_HOME {home} had no dagster.yaml: wrote the project's instance settings there", flush=True)
    return home


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and dispatch; exits non-zero with a one-line error on failure."""
    restore_stop_signals()  # started in a script's background: Ctrl-C and `kill PID` still stop the run
    parser = argparse.ArgumentParser(prog="python -m dflash_assets", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="materialize the whole pipeline on the configured (default: embedded) setup")
    run.add_argument("--config", help="YAML run config for the assets (see README)")
    run.add_argument(
        "--verbose", action="store_true", help="also print Dagster's DEBUG events (always kept in the run storage)"
    )
    status = sub.add_parser(
        "status", help="per-stage partition counts, rows done / remaining under the config's settings, rate and ETA"
    )
    status.add_argument(
        "--config", help="YAML config whose generation settings and storage to judge rows by (default: $DFLASH_CONFIG)"
    )
    status.add_argument(
        "--pilot", help="forecast the whole corpus from these completions partitions only: FIRST...LAST or one key"
    )
    failed = sub.add_parser(
        "mark-failed", help="mark a STARTED run whose machine was lost failed and free its pool slots"
    )
    failed.add_argument("run_id")
    args = parser.parse_args(argv)
    home = _ensure_dagster_home()
    from dflash_assets.orchestration.cluster import celery_broker_url
    from dflash_assets.orchestration.instance_url import check_postgres_url

    try:
        check_postgres_url()  # before any command opens the instance
        celery_broker_url()  # before the definitions read it: one line, never a traceback
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    if args.command == "mark-failed":  # needs no config and no definitions
        import dagster as dg

        from dflash_assets.orchestration.runs import mark_run_failed

        try:
            with dg.DagsterInstance.get() as instance:
                print(mark_run_failed(instance, args.run_id, by="`python -m dflash_assets mark-failed`"))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            sys.exit(1)
        sys.exit(0)
    if getattr(args, "config", None):
        # before the definitions are imported: they build the resources from this file
        os.environ["DFLASH_CONFIG"] = os.path.abspath(args.config)
    from dflash_assets.common.config import ConfigError

    try:
        from dflash_assets.app import main_job as pipeline
    except (ConfigError, FileNotFoundError) as exc:
        print(f"config error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)

    if args.command == "run":
        try:
            code = pipeline.run_all(config_path_arg=args.config, dagster_home=home, verbose=args.verbose)
        except KeyboardInterrupt:
            print(
                "\ninterrupted: stopped. Rows already generated are kept; run the same command again to resume.",
                flush=True,
            )
            code = 130
        sys.exit(code)
    if args.command == "status":
        from dflash_assets.app.status import print_status

        try:
            sys.exit(print_status(pilot=args.pilot))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
