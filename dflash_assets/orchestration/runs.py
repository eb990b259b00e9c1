"""Runs whose process was killed (kill -9, lost node): find them, mark them failed, free their pool slots.

A run launched from the shell (``dagster asset materialize``, ``python -m dflash_assets run``) has no
daemon watching it, and Dagster's ``DefaultRunLauncher`` has no worker health check: a killed run stays
STARTED and keeps its ``dflash_inference`` / ``dflash_gpu`` slot, so the next run waits on it forever.

Every run of these definitions records its orchestrating process in run tags (:func:`process_tags`:
pid, its start time, machine id, boot id, pid namespace, host) when its executor starts, before any
step claims a slot (:data:`reaping_executor`); ``python -m dflash_assets run`` records the same at
launch. The same executor then reaps dead runs (:func:`reap_dead_runs`), so the same shell command run
again starts at once; the daemon does the same for runs launched from the UI through
:class:`MonitoredRunLauncher` (dagster.yaml ``run_launcher`` + ``run_monitoring``).

A run is reaped only when it is provably dead (:func:`run_process_alive`): it was recorded on this
machine (machine id, not the host name: two nodes or containers may share one), in this boot and pid
namespace, and its pid is gone or names a process with another start time; or this machine (an
``/etc/machine-id``) was rebooted since and the run logged nothing after the boot. A run of another
machine, namespace, or without these tags is never touched: when its node is lost for good, an operator
marks it failed (``python -m dflash_assets mark-failed RUN_ID``, or Terminate in the UI).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator

import dagster as dg

# the return type of RunLauncher.check_run_worker_health, which dagster does not export
from dagster._core.launcher import CheckRunHealthResult, WorkerStatus

from dflash_assets.generation.processes.machine import Identity, identity, same_machine
from dflash_assets.generation.processes.proc_info import is_running, proc_stat

PID_TAG, START_TAG, BOOT_TAG, HOST_TAG = "dflash/pid", "dflash/pid_start_time", "dflash/boot_id", "dflash/host"
MACHINE_TAG, PID_NS_TAG = "dflash/machine_id", "dflash/pid_ns"
STOP_GRACE_S = 20.0


def process_tags(pid: int | None = None) -> dict[str, str]:
    """Run tags naming process ``pid`` (default: this one, in this pid namespace): pid, start time (clock
    ticks after boot, ``/proc/<pid>/stat`` field 22), machine id, boot id, pid namespace
    (:mod:`dflash_assets.generation.processes.machine`) and host name (for messages only). With all of them a pid names
    one process of one machine."""
    pid = os.getpid() if pid is None else pid
    stat = proc_stat(pid)
    tags = {PID_TAG: str(pid), HOST_TAG: socket.gethostname()}
    if stat is not None:
        tags[START_TAG] = str(stat.start_time)
    here = identity()
    for tag, value in ((MACHINE_TAG, here.machine), (BOOT_TAG, here.boot), (PID_NS_TAG, here.pid_ns)):
        if value:
            tags[tag] = value
    return tags


def recorded_identity(tags) -> Identity:
    """The :class:`~dflash_assets.generation.processes.machine.Identity` a run's tags record (fields absent: None)."""
    return Identity(tags.get(MACHINE_TAG), tags.get(BOOT_TAG), tags.get(PID_NS_TAG))


def _btime() -> float | None:
    try:
        with open("/proc/stat") as f:
            return float(next(int(line.split()[1]) for line in f if line.startswith("btime ")))
    except (OSError, StopIteration, ValueError):
        return None


def _logged_since_boot(instance: dg.DagsterInstance | None, run: dg.DagsterRun) -> bool:
    """Whether ``run`` wrote an event after this machine booted (then it ran elsewhere: it cannot have
    died in this machine's reboot). True when unknown (no instance, no boot time)."""
    booted = _btime()
    if instance is None or booted is None:
        return True
    records = instance.get_records_for_run(run.run_id, ascending=False, limit=1).records
    return bool(records) and records[0].event_log_entry.timestamp >= booted


def _process_started_at(pid: int) -> float | None:
    """Unix time at which process ``pid`` started (about 10 ms resolution), or None without /proc."""
    stat, booted = proc_stat(pid), _btime()
    if stat is None or booted is None:
        return None
    return booted + stat.start_time / os.sysconf("SC_CLK_TCK")


def run_process_alive(run: dg.DagsterRun, instance: dg.DagsterInstance | None = None) -> bool | None:
    """Whether the process that orchestrates ``run`` (its :func:`process_tags`) still runs.

    Returns None (unknown: leave the run alone) unless the tags prove where the process ran: another
    machine (whatever its host name), another pid namespace, or missing tags (pid, start time, machine,
    boot) are None. False when its pid is gone here or names a process with another start time, or when
    this machine was rebooted since (:func:`~dflash_assets.generation.processes.machine.same_machine`) and the run
    logged nothing after the boot (``instance`` given; without it a reboot alone counts).
    """
    tags = run.tags
    try:
        pid, start = int(tags.get(PID_TAG, "0")), int(tags.get(START_TAG, ""))
    except ValueError:
        return None
    if pid <= 0:
        return None
    where = same_machine(recorded_identity(tags))
    if where == "rebooted":
        return None if _logged_since_boot(instance, run) else False
    if where != "same":
        return None
    return is_running(pid, start)


def live_step_workers(instance: dg.DagsterInstance, run: dg.DagsterRun) -> list[int]:
    """Step subprocesses of ``run`` (multiprocess executor, ``STEP_WORKER_STARTED`` events) still running.

    A pid counts only when its process started before the event that recorded it (so not recycled).
    They outlive an orchestrator killed alone (kill -9 of the run worker's pid, not its group).
    """
    if same_machine(recorded_identity(run.tags)) != "same":
        return []  # step workers run beside the orchestrator: a pid of another machine, boot or namespace means nothing
    alive = []
    for entry in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_WORKER_STARTED):
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


def reap_dead_runs(
    instance: dg.DagsterInstance, by: str, exclude: tuple[str, ...] = (), log: Callable[[str], None] | None = None
) -> list[str]:
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
        if run.run_id in exclude or run_process_alive(run, instance) is not False:
            continue
        workers = live_step_workers(instance, run)
        if workers and _stop(workers, STOP_GRACE_S):
            continue
        message = (
            f"the process running it (pid {run.tags.get(PID_TAG)} on {run.tags.get(HOST_TAG)}) is gone (killed)"
            + (f"; its step processes {workers} were stopped" if workers else "")
            + f"; marked failed and its pool slots freed by {by}"
        )
        if not _fail(instance, run, message):
            continue  # it ended meanwhile
        reaped.append(run.run_id)
        if log:
            log(f"run {run.run_id}: {message}")
    return reaped


def _fail(instance: dg.DagsterInstance, run: dg.DagsterRun, message: str) -> bool:
    """Mark ``run`` failed with ``message`` and free its pool slots; False when it is no longer STARTED."""
    if instance.get_run_by_id(run.run_id).status != dg.DagsterRunStatus.STARTED:
        return False
    instance.report_run_failed(run, message)
    if instance.event_log_storage.supports_global_concurrency_limits:
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
    return True


def mark_run_failed(instance: dg.DagsterInstance, run_id: str, by: str = "an operator") -> str:
    """Mark a STARTED run failed and free its pool slots on an operator's word: for a run whose machine
    is lost, which :func:`reap_dead_runs` cannot prove dead. Returns what was done (one line).

    Raises:
        ValueError: no such run, or it is not STARTED (naming its status).
    """
    run = instance.get_run_by_id(run_id)
    if run is None:
        raise ValueError(f"no run {run_id} in this instance (DAGSTER_HOME={os.environ.get('DAGSTER_HOME')})")
    if run.status != dg.DagsterRunStatus.STARTED:
        raise ValueError(f"run {run_id} is {run.status.value}, not STARTED: nothing to do")
    where = f"pid {run.tags.get(PID_TAG)} on {run.tags.get(HOST_TAG)}" if run.tags.get(PID_TAG) else "unknown process"
    if run_process_alive(run, instance) is True:
        raise ValueError(
            f"run {run_id} is alive on this machine ({where}): stop it instead (Ctrl-C, or Terminate in the UI)"
        )
    if not _fail(instance, run, f"marked failed by {by} (its process, {where}, was lost); its pool slots were freed"):
        raise ValueError(f"run {run_id} ended meanwhile")
    return f"run {run_id} ({where}) marked failed; its pool slots were freed"


def stop_orphaned_step_workers(
    instance: dg.DagsterInstance,
    exclude: tuple[str, ...] = (),
    log: Callable[[str], None] | None = None,
    within_s: float = 86400.0,
) -> dict[str, list[int]]:
    """Stop step processes still running for runs that already ended (failed or canceled in the last
    ``within_s`` seconds). Dagster marks a run failed when its run worker is killed (the code server sees
    the worker die) and frees its pool slots ``free_slots_after_run_end_seconds`` later, but the worker's
    step subprocess lives on: it would generate beside the run that takes the slot next. A run that ends
    by itself waits for its step processes, so a live one here is an orphan. One run query, plus one event
    query per recently ended run of this machine. Returns ``{run_id: pids stopped}``."""
    since = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=within_s)
    stopped = {}
    ended = [dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]
    for record in instance.get_run_records(dg.RunsFilter(statuses=ended, updated_after=since), limit=100):
        run = record.dagster_run
        if run.run_id in exclude or same_machine(recorded_identity(run.tags)) != "same":
            continue
        if workers := live_step_workers(instance, run):
            left = _stop(workers, STOP_GRACE_S)
            stopped[run.run_id] = [p for p in workers if p not in left]
            if log:
                log(
                    f"run {run.run_id} ended but its step processes {workers} were still running: stopped"
                    + (f" (still running: {left})" if left else "")
                )
    return stopped


#: Statuses of a run whose steps may be executing.
RUNNING_STATUSES = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


def _run_partitions(run: dg.DagsterRun, ordered: Callable[[], list[str]]) -> set[str]:
    """Partition keys ``run`` targets: its ``dagster/partition`` tag, or every key of its partition range
    (single-run backfill tags) in the order ``ordered()`` gives."""
    # the tag names Dagster writes on partitioned and single-run backfill runs; dagster does not export them
    from dagster._core.storage.tags import (
        ASSET_PARTITION_RANGE_END_TAG,
        ASSET_PARTITION_RANGE_START_TAG,
        PARTITION_NAME_TAG,
    )

    if key := run.tags.get(PARTITION_NAME_TAG):
        return {key}
    start, end = run.tags.get(ASSET_PARTITION_RANGE_START_TAG), run.tags.get(ASSET_PARTITION_RANGE_END_TAG)
    if start is None or end is None:
        return set()
    keys = ordered()
    if start not in keys or end not in keys:
        return {start, end}
    return set(keys[keys.index(start) : keys.index(end) + 1])


def other_live_runs(instance: dg.DagsterInstance, this_run_id: str) -> list[str]:
    """Ids of the runs of this instance in progress (STARTED or CANCELING, not provably dead) other than
    ``this_run_id``: files they may read or write must not be removed now."""
    return [
        r.dagster_run.run_id
        for r in instance.get_run_records(dg.RunsFilter(statuses=RUNNING_STATUSES))
        if r.dagster_run.run_id != this_run_id and run_process_alive(r.dagster_run, instance) is not False
    ]


def runs_holding_partitions(
    instance: dg.DagsterInstance,
    asset: str,
    partition_keys: list[str],
    this_run_id: str,
    ordered: Callable[[], list[str]] | None = None,
) -> dict[str, list[str]]:
    """Other runs (STARTED or CANCELING, of any machine, not provably dead: :func:`run_process_alive`)
    that materialize ``asset`` for any of ``partition_keys``: ``{run_id: [overlapping keys]}``. One
    run-storage query.

    The per-partition lock: every run is recorded STARTED in the run storage before its steps run, so a
    step that checks this first and refuses on overlap never writes beside another run of its partition
    (two that start at the same moment both refuse; none proceeds twice). Dagster's run-queue tag limits
    would cover only queued runs, not ``dagster asset materialize`` or ``python -m dflash_assets run``.

    Args:
        ordered: partition keys in order, for runs over a key range (called at most once).
    """
    wanted = set(partition_keys)
    cache: list[list[str]] = []

    def keys_in_order() -> list[str]:
        if not cache:
            cache.append(ordered() if ordered is not None else [])
        return cache[0]

    holding = {}
    for record in instance.get_run_records(dg.RunsFilter(statuses=RUNNING_STATUSES)):
        run = record.dagster_run
        if run.run_id == this_run_id:
            continue
        if run.asset_selection is not None and dg.AssetKey(asset) not in run.asset_selection:
            continue
        overlap = sorted(_run_partitions(run, keys_in_order) & wanted)
        if overlap and run_process_alive(run, instance) is not False:  # a killed run holds nothing
            holding[run.run_id] = overlap
    return holding


def partition_busy_message(instance: dg.DagsterInstance, asset: str, holding: dict[str, list[str]]) -> str:
    """The refusal of a step whose partitions another run holds: which run, where, and what to do."""
    parts = []
    for run_id, keys in holding.items():
        run = instance.get_run_by_id(run_id)
        where = f"pid {run.tags.get(PID_TAG)} on {run.tags.get(HOST_TAG)}" if run and run.tags.get(PID_TAG) else "?"
        shown = ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")
        parts.append(f"run {run_id} ({where}) is materializing {asset}[{shown}]")
    return (
        "; ".join(parts) + ": two runs of one partition would overwrite each other's files, so this one does "
        "nothing. Let that run finish (or stop it); if its machine is lost, mark it failed: "
        "`python -m dflash_assets mark-failed RUN_ID`"
    )


class ReapingExecutor(dg.Executor):
    """Wraps an executor: tags the run with its process (:func:`process_tags`) and reaps dead runs
    (:func:`reap_dead_runs`) before the wrapped executor starts the steps (and their slot claims)."""

    def __init__(self, inner: dg.Executor):
        self._inner = inner

    @property
    def retries(self):
        return self._inner.retries

    def __getattr__(self, name: str):
        # what an executor's own execution loop reads from ``plan_context.executor`` (e.g. dagster-celery's
        # ``app_args``) comes from the wrapped executor
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    @property
    def step_dependency_config(self):
        return self._inner.step_dependency_config

    def execute(self, plan_context, execution_plan) -> Iterator[dg.DagsterEvent]:
        instance, run = plan_context.instance, plan_context.dagster_run
        instance.add_run_tags(run.run_id, process_tags())
        try:
            reap_dead_runs(instance, by=f"run {run.run_id}", exclude=(run.run_id,), log=plan_context.log.warning)
        except Exception as exc:
            plan_context.log.warning(f"could not check for killed runs: {type(exc).__name__}: {exc}")
        yield from self._inner.execute(plan_context, execution_plan)


def reaping(inner: dg.ExecutorDefinition) -> dg.ExecutorDefinition:
    """``inner`` (same name and config) as a :class:`ReapingExecutor`: the run is tagged with its process and
    killed runs are reaped before ``inner`` starts the steps."""
    return dg.ExecutorDefinition(
        name=inner.name,
        config_schema=inner.config_schema,
        requirements=inner.get_requirements,
        executor_creation_fn=lambda init_context: ReapingExecutor(inner.executor_creation_fn(init_context)),
        description=f"{inner.description or inner.name} Tags the run with its process and reaps killed runs first.",
    )


#: Dagster's default executor (multiprocess, or in_process by run config), reaping killed runs first.
reaping_executor = reaping(dg.multi_or_in_process_executor)


class MonitoredRunLauncher(dg.DefaultRunLauncher):
    """Dagster's DefaultRunLauncher plus a run worker health check from :func:`run_process_alive`, so the
    daemon's run monitoring (dagster.yaml ``run_monitoring``) fails a run whose worker was killed, and its
    ``free_slots_after_run_end_seconds`` frees the slots. A worker of another machine, or one not yet
    tagged (still loading code), counts as running."""

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: dg.DagsterRun) -> CheckRunHealthResult:
        if run_process_alive(run, self._instance) is not False:
            return CheckRunHealthResult(WorkerStatus.RUNNING)
        workers = live_step_workers(self._instance, run)
        if workers and _stop(workers, STOP_GRACE_S):
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"stopping orphaned step processes {workers}")
        return CheckRunHealthResult(
            WorkerStatus.FAILED,
            f"run worker pid {run.tags.get(PID_TAG)} on {run.tags.get(HOST_TAG)} is gone (killed)"
            + (f"; its step processes {workers} were stopped" if workers else ""),
        )
