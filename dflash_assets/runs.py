"""Runs whose process was killed (kill -9, lost node): find them, mark them failed, free their pool slots.

A run launched from the shell (``dagster asset materialize``, ``python -m dflash_assets run``) has no
daemon watching it, and Dagster's ``DefaultRunLauncher`` has no worker health check: a killed run stays
STARTED and keeps its ``dflash_inference`` / ``dflash_gpu`` slot, so the next run waits on it forever.

Every run of these definitions records its orchestrating process in run tags (:func:`process_tags`:
pid, its start time, boot id, host) when its executor starts, before any step claims a slot
(:data:`reaping_executor`). The same executor then reaps dead runs (:func:`reap_dead_runs`), so the same
shell command run again starts at once; the daemon does the same for runs launched from the UI through
:class:`MonitoredRunLauncher` (dagster.yaml ``run_launcher`` + ``run_monitoring``).

A run is reaped only when every process it recorded is verifiably gone on this host: the pid does not
exist, or exists with another start time (recycled), or the machine was rebooted since. A run of
another host, or without these tags, is never touched.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator

import dagster as dg
from dagster._core.events import DagsterEventType
from dagster._core.executor.base import Executor
from dagster._core.launcher import CheckRunHealthResult, WorkerStatus
from dagster._core.launcher.default_run_launcher import DefaultRunLauncher

from dflash_assets.generation.processes import boot_id, is_running, proc_stat

PID_TAG, START_TAG, BOOT_TAG, HOST_TAG = "dflash/pid", "dflash/pid_start_time", "dflash/boot_id", "dflash/host"
STOP_GRACE_S = 20.0


def process_tags(pid: int | None = None) -> dict[str, str]:
    """Run tags naming process ``pid`` (default: this one): pid, start time (clock ticks after boot,
    ``/proc/<pid>/stat`` field 22), boot id and host name. With all four a recycled pid never matches."""
    pid = os.getpid() if pid is None else pid
    stat = proc_stat(pid)
    tags = {PID_TAG: str(pid), HOST_TAG: socket.gethostname()}
    if stat is not None:
        tags[START_TAG] = str(stat.start_time)
    if boot := boot_id():
        tags[BOOT_TAG] = boot
    return tags


def _process_started_at(pid: int) -> float | None:
    """Unix time at which process ``pid`` started (about 10 ms resolution), or None without /proc."""
    stat = proc_stat(pid)
    if stat is None:
        return None
    try:
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    return btime + stat.start_time / os.sysconf("SC_CLK_TCK")


def run_process_alive(run: dg.DagsterRun) -> bool | None:
    """Whether the process that orchestrates ``run`` (its :func:`process_tags`) still runs.

    Returns None (unknown: leave the run alone) for a run without the tags or of another host; False
    when the machine rebooted since, the pid is gone, or the pid now names a process started later.
    A run tagged with a pid only (no start time) counts as alive while any process has that pid.
    """
    tags = run.tags
    try:
        pid = int(tags.get(PID_TAG, "0"))
    except ValueError:
        return None
    if pid <= 0 or tags.get(HOST_TAG) != socket.gethostname():
        return None
    boot = boot_id()
    if tags.get(BOOT_TAG) and boot and tags[BOOT_TAG] != boot:
        return False
    start = tags.get(START_TAG)
    return is_running(pid, int(start) if start else None)


def live_step_workers(instance: dg.DagsterInstance, run: dg.DagsterRun) -> list[int]:
    """Step subprocesses of ``run`` (multiprocess executor, ``STEP_WORKER_STARTED`` events) still running.

    A pid counts only when its process started before the event that recorded it (so not recycled).
    They outlive an orchestrator killed alone (kill -9 of the run worker's pid, not its group).
    """
    boot = boot_id()
    if run.tags.get(HOST_TAG) != socket.gethostname() or (run.tags.get(BOOT_TAG) and boot and run.tags[BOOT_TAG] != boot):
        return []  # step workers run on the orchestrator's host: a pid from another host or boot means nothing here
    alive = []
    for entry in instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_WORKER_STARTED):
        meta = entry.dagster_event.event_specific_data.metadata if entry.dagster_event else {}
        try:
            pid = int(getattr(meta.get("pid"), "value", meta.get("pid")) or 0)
        except (TypeError, ValueError):
            continue
        started = _process_started_at(pid) if pid > 0 and is_running(pid, None) else None
        if started is not None and started <= entry.timestamp + 1.0:
            alive.append(pid)
    return alive


def _stop(pids: list[int], grace_s: float) -> list[int]:
    """SIGTERM (Dagster turns it into a step interrupt: journals closed, servers stopped), then SIGKILL
    after ``grace_s``. Returns the pids still running at the end."""
    starts = {pid: proc_stat(pid) for pid in pids}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    left = list(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if starts[p] and is_running(p, starts[p].start_time)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.2)
    return [p for p in left if starts[p] and is_running(p, starts[p].start_time)]


def reap_dead_runs(instance: dg.DagsterInstance, by: str, exclude: tuple[str, ...] = (),
                   log: Callable[[str], None] | None = None) -> list[str]:
    """Mark STARTED runs whose orchestrating process is gone as failed and free their pool slots.

    One run-storage query (STARTED runs); for each of them with a dead orchestrator, one event query
    for its step workers. Step workers still running (their orchestrator was killed alone) are stopped
    first (SIGTERM, SIGKILL after :data:`STOP_GRACE_S`); a run whose worker would not stop is left
    for the next call.

    Args:
        instance: the Dagster instance holding the runs.
        by: who reaps, for the failure message (e.g. "the next `dagster asset materialize`").
        exclude: run ids never to touch (the caller's own run).
        log: called with one line per reaped run.

    Returns:
        The run ids marked failed.
    """
    stop_orphaned_step_workers(instance, exclude, log)
    reaped = []
    for record in instance.get_run_records(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED])):
        run = record.dagster_run
        if run.run_id in exclude or run_process_alive(run) is not False:
            continue
        workers = live_step_workers(instance, run)
        if workers and _stop(workers, STOP_GRACE_S):
            continue
        message = (
            f"the process running it (pid {run.tags.get(PID_TAG)} on {run.tags.get(HOST_TAG)}) is gone (killed)"
            + (f"; its step processes {workers} were stopped" if workers else "")
            + f"; marked failed and its pool slots freed by {by}"
        )
        if instance.get_run_by_id(run.run_id).status != dg.DagsterRunStatus.STARTED:
            continue  # it ended meanwhile
        instance.report_run_failed(run, message)
        if instance.event_log_storage.supports_global_concurrency_limits:
            instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        reaped.append(run.run_id)
        if log:
            log(f"run {run.run_id}: {message}")
    return reaped


def stop_orphaned_step_workers(instance: dg.DagsterInstance, exclude: tuple[str, ...] = (),
                               log: Callable[[str], None] | None = None, within_s: float = 86400.0) -> dict[str, list[int]]:
    """Stop step processes still running for runs that already ended (failed or canceled in the last
    ``within_s`` seconds). Dagster marks a run failed when its run worker is killed (the code server sees
    the worker die) and frees its pool slots ``free_slots_after_run_end_seconds`` later, but the worker's
    step subprocess lives on: it would generate beside the run that takes the slot next. A run that ends
    by itself waits for its step processes, so a live one here is an orphan. One run query, plus one event
    query per recently ended run of this host. Returns ``{run_id: pids stopped}``."""
    since = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=within_s)
    stopped = {}
    ended = [dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]
    for record in instance.get_run_records(dg.RunsFilter(statuses=ended, updated_after=since), limit=100):
        run = record.dagster_run
        if run.run_id in exclude or run.tags.get(HOST_TAG) != socket.gethostname():
            continue
        if workers := live_step_workers(instance, run):
            left = _stop(workers, STOP_GRACE_S)
            stopped[run.run_id] = [p for p in workers if p not in left]
            if log:
                log(f"run {run.run_id} ended but its step processes {workers} were still running: stopped"
                    + (f" (still running: {left})" if left else ""))
    return stopped


class ReapingExecutor(Executor):
    """Wraps an executor: tags the run with its process (:func:`process_tags`) and reaps dead runs
    (:func:`reap_dead_runs`) before the wrapped executor starts the steps (and their slot claims)."""

    def __init__(self, inner: Executor):
        self._inner = inner

    @property
    def retries(self):
        return self._inner.retries

    @property
    def step_dependency_config(self):
        return self._inner.step_dependency_config

    def execute(self, plan_context, execution_plan) -> Iterator[dg.DagsterEvent]:
        instance, run = plan_context.instance, plan_context.dagster_run
        instance.add_run_tags(run.run_id, process_tags())
        try:
            reap_dead_runs(instance, by=f"run {run.run_id}", exclude=(run.run_id,), log=plan_context.log.warning)
        except Exception as exc:  # noqa: BLE001 - reaping is best effort; the run itself goes on
            plan_context.log.warning(f"could not check for killed runs: {type(exc).__name__}: {exc}")
        yield from self._inner.execute(plan_context, execution_plan)


def _reaping(inner: dg.ExecutorDefinition) -> dg.ExecutorDefinition:
    return dg.ExecutorDefinition(
        name=inner.name,
        config_schema=inner.config_schema,
        requirements=inner.get_requirements,
        executor_creation_fn=lambda init_context: ReapingExecutor(inner.executor_creation_fn(init_context)),
        description=f"{inner.description or inner.name} Tags the run with its process and reaps killed runs first.",
    )


#: Dagster's default executor (multiprocess, or in_process by run config), reaping killed runs first.
reaping_executor = _reaping(dg.multi_or_in_process_executor)


class MonitoredRunLauncher(DefaultRunLauncher):
    """Dagster's DefaultRunLauncher plus a run worker health check from :func:`run_process_alive`, so the
    daemon's run monitoring (dagster.yaml ``run_monitoring``) fails a run whose worker was killed, and its
    ``free_slots_after_run_end_seconds`` frees the slots. A worker of another host, or one not yet
    tagged (still loading code), counts as running."""

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: dg.DagsterRun) -> CheckRunHealthResult:
        if run_process_alive(run) is not False:
            return CheckRunHealthResult(WorkerStatus.RUNNING)
        workers = live_step_workers(self._instance, run)
        if workers and _stop(workers, STOP_GRACE_S):
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"stopping orphaned step processes {workers}")
        return CheckRunHealthResult(
            WorkerStatus.FAILED,
            f"run worker pid {run.tags.get(PID_TAG)} on {run.tags.get(HOST_TAG)} is gone (killed)"
            + (f"; its step processes {workers} were stopped" if workers else ""),
        )
