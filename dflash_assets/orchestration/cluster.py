"""Several nodes, one pipeline: Dagster's Celery executor places each step of a run on a node's worker.

Off unless ``$DFLASH_CELERY_BROKER`` is set (a Redis URL, ``redis://[:PASSWORD@]HOST:6379/0``): the single-node
default stays Dagster's multiprocess / in-process executor on the SQLite instance. With it set, every run of these
definitions (the ``partition_stages`` job, the backfill schedule's and the cap-change sensor's runs, a backfill from
the UI, ``dagster asset materialize``) hands each step to ``dagster-celery``: the run's process (on whichever node
launched it) sends the step as a Celery task to the queue :data:`CELERY_QUEUE` on the broker, and the first idle
worker of any node runs it there, with that node's config file (``$DFLASH_CONFIG``: its servers, GPUs, scratch).
A backfill of N partitions is N runs, so their steps spread over the workers.

A worker is Celery's own command on the app of this module (:data:`app`, same broker, backend and queue as the
executor), one task at a time per node (``-c 1``: a completions step takes the node's servers, a hidden-states
step its GPUs)::

    celery -A dflash_assets.orchestration.cluster worker -Q dagster -c 1 -n NODE@%h

Every node needs the same instance (``dagster_cluster.yaml``, PostgreSQL: the worker reads the run and writes the
step's events there) and the same storage root (S3); a worker imports ``dflash_assets.definitions`` itself.
The broker URL, password included, stays in the environment: nothing here writes it to a file or a log.
"""

from __future__ import annotations

import os

import dagster as dg

#: Environment variable holding the Redis URL of the Celery broker (and result backend); unset: single node.
CELERY_BROKER_ENV = "DFLASH_CELERY_BROKER"
#: The queue every node's worker consumes (dagster-celery's default queue, so the executor needs no step tags).
CELERY_QUEUE = "dagster"


def celery_broker_url() -> str | None:
    """The broker URL from :data:`CELERY_BROKER_ENV`, or None when unset or empty (single-node mode).

    Raises:
        ValueError: the variable is set to something other than a ``redis://`` / ``rediss://`` URL (naming the
            variable, never its value: it may hold a password).
    """
    url = os.environ.get(CELERY_BROKER_ENV, "").strip()
    if not url:
        return None
    if not url.startswith(("redis://", "rediss://")):
        raise ValueError(
            f"{CELERY_BROKER_ENV} must be a Redis URL (redis://[:PASSWORD@]HOST:6379/0, the broker every node's "
            f"worker reads); unset it to run on one node"
        )
    return url


def _celery_executor_def() -> dg.ExecutorDefinition:
    # dagster-celery is the `cluster` extra: imported only when a broker is configured
    try:
        from dagster_celery import celery_executor
    except ImportError as exc:
        raise ImportError(
            f"{CELERY_BROKER_ENV} is set but dagster-celery is not installed: pip install -e '.[cluster]' "
            f"(or unset {CELERY_BROKER_ENV} to run on one node)"
        ) from exc
    # an env reference, not the URL: Dagster shows executor config in the UI
    source = {"env": CELERY_BROKER_ENV}
    return celery_executor.configured({"broker": source, "backend": source}, name="celery")


def partition_executor(default: dg.ExecutorDefinition) -> dg.ExecutorDefinition:
    """The executor of these definitions: ``default`` (the single-node executor) unless a broker is configured
    (:func:`celery_broker_url`), then Dagster's Celery executor on that broker, wrapped by the same run tagging
    and reaping as ``default`` (:func:`dflash_assets.orchestration.runs.reaping`).

    Raises:
        ValueError: a malformed broker URL. ImportError: a broker is configured without dagster-celery.
    """
    from dflash_assets.orchestration.runs import reaping

    if celery_broker_url() is None:
        return default
    return reaping(_celery_executor_def())


def celery_app():
    """The Celery app a node's worker runs (broker, backend, queue and settings as the executor's), with
    dagster-celery's step task registered.

    Raises:
        RuntimeError: :data:`CELERY_BROKER_ENV` is unset (a worker needs the broker).
    """
    from dagster._core.execution.retries import RetryMode  # dagster-celery's own executor takes it
    from dagster_celery.executor import CeleryExecutor
    from dagster_celery.make_app import make_app
    from dagster_celery.tasks import create_task

    url = celery_broker_url()
    if url is None:
        raise RuntimeError(f"{CELERY_BROKER_ENV} is not set: export the Redis URL of the cluster's broker, then start")
    celery = make_app(CeleryExecutor(retries=RetryMode(RetryMode.DISABLED), broker=url, backend=url).app_args())
    create_task(celery)
    return celery


def __getattr__(name: str):
    # `celery -A dflash_assets.orchestration.cluster` looks up `app`; built on first access so that importing this
    # module (the definitions do) needs neither celery nor a broker
    if name == "app":
        globals()["app"] = built = celery_app()
        return built
    raise AttributeError(name)
