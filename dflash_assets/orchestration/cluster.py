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

A worker that stops answering while it runs a step (its node lost, kill -9) fails that step after
``$DFLASH_CELERY_LOST_AFTER_S`` (:class:`WatchedResult`), so its run fails and the partition can be requested again.

Every node needs the same instance (``dagster_cluster.yaml``, PostgreSQL: the worker reads the run and writes the
step's events there) and the same storage root (S3); a worker imports ``dflash_assets.definitions`` itself.
The broker URL, password included, stays in the environment: nothing here writes it to a file or a log.
"""

from __future__ import annotations

import os
import re
import time

import dagster as dg

from dflash_assets.orchestration.service_urls import checked_url, install_log_scrubber, scrubbed_errors

#: Environment variable holding the Redis URL of the Celery broker (and result backend); unset: single node.
CELERY_BROKER_ENV = "DFLASH_CELERY_BROKER"
BROKER_FORM = "redis://[:PASSWORD@]HOST:6379/0"
#: The queue every node's worker consumes (dagster-celery's default queue, so the executor needs no step tags).
CELERY_QUEUE = "dagster"


def celery_broker_url() -> str | None:
    """The broker URL from :data:`CELERY_BROKER_ENV`, or None when unset or empty (single-node mode).

    The whole URL is checked before kombu or redis-py sees it (:func:`~.service_urls.checked_url`: an unencoded
    ``/`` in the password once made kombu quote a part of it, as the port, in the run's events), its database is a
    number, and every log record of the process is scrubbed of it from then on.

    Raises:
        ValueError: the variable is set to something other than a ``redis://`` / ``rediss://`` URL, or a malformed
            or ambiguous one (naming the variable, what is wrong and the form; never its value: it may hold a
            password).
    """
    url = os.environ.get(CELERY_BROKER_ENV, "").strip()
    if not url:
        return None
    if not url.startswith(("redis://", "rediss://")):
        raise ValueError(
            f"{CELERY_BROKER_ENV} must be a Redis URL ({BROKER_FORM}, the broker every node's worker reads); "
            "unset it to run on one node"
        )
    install_log_scrubber()
    parts = checked_url(CELERY_BROKER_ENV, url, ("redis", "rediss"), BROKER_FORM)
    if parts.path not in ("", "/") and not re.fullmatch(r"/[0-9]{1,5}", parts.path):
        raise ValueError(f"{CELERY_BROKER_ENV}'s path must be a database number (/0): use {BROKER_FORM}")
    return url


#: Environment variable: seconds after which a worker that stops answering pings while it runs a step counts as
#: lost (its node died, or kill -9); its step then fails, and with it the run. Default :data:`LOST_AFTER_S`.
LOST_AFTER_ENV = "DFLASH_CELERY_LOST_AFTER_S"
LOST_AFTER_S = 60.0
#: Celery settings of both sides: a task's state becomes STARTED with the worker's name when a worker begins it; a
#: worker takes a task only when it has a free process (by default a busy worker reserves one more: a second range
#: would wait behind the first on one node while another node idles); every worker also consumes a queue of its own
#: (``NAME@HOST.dq2``), where a multi-node training sends the other nodes' ranks (:mod:`.node_ranks`).
CELERY_SETTINGS = {"task_track_started": True, "worker_disable_prefetch": True, "worker_direct": True}


def lost_after_s() -> float:
    """:data:`LOST_AFTER_ENV` in seconds (default :data:`LOST_AFTER_S`).

    Raises:
        ValueError: not a number of seconds >= 1 (naming the variable).
    """
    raw = os.environ.get(LOST_AFTER_ENV, "").strip()
    try:
        value = float(raw) if raw else LOST_AFTER_S
    except ValueError:
        value = 0.0
    if not value >= 1.0:
        raise ValueError(f"{LOST_AFTER_ENV}={raw!r}: give the seconds (>= 1) after which a silent worker is lost")
    return value


class WorkerLostError(RuntimeError):
    """No worker runs a started step any more (its node was lost, its worker killed or restarted)."""


class WatchedResult:
    """A step's Celery result (``celery.result.AsyncResult``) as dagster-celery's execution loop reads it
    (``ready``, ``get``, ``revoke``), plus a watch on the task itself: once it is STARTED, the workers are asked
    every ``lost_after_s / 3`` seconds which tasks they run (``inspect().active()``); three answers in a row in
    which no worker lists it make the result ready, ``get`` raise :class:`WorkerLostError` and the task revoked
    (terminated, should its worker come back). Without this a run whose worker died waits forever: with early
    acknowledgement no other worker ever receives the task. Liveness is the task's, never the worker name's: a
    worker a supervisor restarted under the same name answers pings but runs nothing of the lost step (issue 50,
    finding 6: the run held its pool slot for good).
    ``what`` names the task in that error (default ``step <step_key>``), ``advice`` says what to do next."""

    def __init__(
        self,
        result,
        app,
        step_key: str,
        lost_after: float,
        what: str = "",
        advice: str = "request the partition again: another node's worker resumes it from the journal in storage",
    ) -> None:
        self._result, self._app, self._what, self._advice = result, app, what or f"step {step_key}", advice
        self._every = lost_after / 3
        self._last, self._misses = time.monotonic(), 0
        self._lost: str | None = None

    def _worker(self) -> str | None:
        """The worker that started the task (None while queued or when unknown)."""
        info = self._result.info if self._result.state == "STARTED" else None
        return info.get("hostname") if isinstance(info, dict) else None

    def ready(self) -> bool:
        if self._lost is not None or self._result.ready():
            return True
        if time.monotonic() - self._last < self._every:
            return False
        self._last = time.monotonic()
        worker = self._worker()
        if worker is None:
            self._misses = 0
            return False
        self._misses = 0 if self._running_somewhere() else self._misses + 1
        if self._misses >= 3 and not self._result.ready():  # it may have ended since it was last asked
            self._lost = worker
            self._result.revoke(terminate=True)
            return True
        return False

    def _running_somewhere(self) -> bool:
        """Whether a worker that answers lists the task among those it runs now (no answer: not running)."""
        try:
            active = self._app.control.inspect(timeout=min(self._every, 5.0)).active() or {}
        except Exception:  # the broker unreachable: nothing says the task runs
            return False
        task_id = self._result.id
        return any(isinstance(t, dict) and t.get("id") == task_id for tasks in active.values() for t in tasks or ())

    def get(self):
        if self._lost is not None:
            raise WorkerLostError(
                f"{self._what}: worker {self._lost} stopped answering while running it, or no longer runs it (lost "
                f"node, killed, or restarted under its name; {3 * self._every:.0f} s, {LOST_AFTER_ENV}); {self._advice}"
            )
        # The dflash_drafter step waits on its node ranks from inside its own Celery task, where Celery refuses a
        # blocking get (prefork workers: "Never call result.get() within a task!"). Safe here: the awaited task
        # runs on another worker's queue, never on this one's (-c 1, busy with this step).
        return self._result.get(disable_sync_subtasks=False)

    def revoke(self, *args, **kwargs):
        return self._result.revoke(*args, **kwargs)


def _celery_executor_def() -> dg.ExecutorDefinition:
    # dagster-celery is the `cluster` extra: imported only when a broker is configured
    try:
        from dagster_celery.core_execution_loop import core_celery_execution_loop
        from dagster_celery.executor import CELERY_CONFIG, CeleryExecutor, _submit_task
    except ImportError as exc:
        raise ImportError(
            f"{CELERY_BROKER_ENV} is set but dagster-celery is not installed: pip install -e '.[cluster]' "
            f"(or unset {CELERY_BROKER_ENV} to run on one node)"
        ) from exc
    from dagster._core.execution.retries import RetryMode  # dagster-celery's own executor takes it

    class WatchedCeleryExecutor(CeleryExecutor):
        """dagster-celery's executor; each step's result is a :class:`WatchedResult`."""

        def execute(self, plan_context, execution_plan):
            lost_after = lost_after_s()

            def submit(app, context, step, queue, priority, known_state):
                result = _submit_task(app, context, step, queue, priority, known_state)
                return WatchedResult(result, app, step.key, lost_after)

            # the broker's errors reach the run's events (ENGINE_EVENT, RUN_FAILURE) and the UI scrubbed of its URL
            with scrubbed_errors():
                yield from core_celery_execution_loop(plan_context, execution_plan, step_execution_fn=submit)

    @dg.executor(name="celery", config_schema=CELERY_CONFIG, requirements=dg.multiple_process_executor_requirements())
    def watched_celery_executor(init_context):
        config = init_context.executor_config
        return WatchedCeleryExecutor(
            broker=config.get("broker"),
            backend=config.get("backend"),
            config_source=config.get("config_source"),
            include=config.get("include"),
            retries=RetryMode.from_config(config["retries"]),
        )

    # an env reference, not the URL: Dagster shows executor config in the UI
    source = {"env": CELERY_BROKER_ENV}
    return watched_celery_executor.configured(
        {"broker": source, "backend": source, "config_source": CELERY_SETTINGS}, name="celery"
    )


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
    dagster-celery's step task and the node-rank task of multi-node training
    (:data:`~dflash_assets.orchestration.node_ranks.RANK_TASK`) registered.

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
    executor = CeleryExecutor(
        retries=RetryMode(RetryMode.DISABLED), broker=url, backend=url, config_source=dict(CELERY_SETTINGS)
    )
    from dflash_assets.orchestration.node_ranks import register_rank_task

    celery = make_app(executor.app_args())
    create_task(celery)
    register_rank_task(celery)  # the other nodes of a multi-node training
    return celery


def __getattr__(name: str):
    # `celery -A dflash_assets.orchestration.cluster` looks up `app`; built on first access so that importing this
    # module (the definitions do) needs neither celery nor a broker
    if name == "app":
        globals()["app"] = built = celery_app()
        return built
    raise AttributeError(name)
