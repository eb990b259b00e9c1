"""The other nodes of a multi-node drafter training, started as Celery tasks on other nodes' workers.

With ``$DFLASH_CELERY_BROKER`` set and ``nnodes > 1``, the ``dflash_drafter`` step (running on one node's worker)
starts torchrun there and sends the same torchrun command, once per other node, as the task :data:`RANK_TASK` to
the direct queue of an idle worker of another node (Celery's ``worker_direct``: every worker also consumes a queue
named after itself, ``NAME@HOST.dq2``, so no extra ``-Q`` and no node list in any config). With a c10d rendezvous
every node runs the same command; torchrun assigns the ranks once all have joined.

Why each rank goes to a chosen idle worker and not to a shared queue: a worker runs one task at a time (``-c 1``),
so the step's own worker, busy with the step, can never take a rank of its own run; and a rank sent to a worker
busy with another step would wait behind it while the ranks already started wait at the rendezvous. So the step
asks the workers what they run (``inspect().active()``), waits up to :data:`START_TIMEOUT_ENV` seconds for enough
idle workers of other nodes, and fails naming the busy ones if there are not enough. A rank task occupies its
worker like any step: nothing else (a hidden-states step on that node's GPUs) starts there while it trains.

The step watches its ranks while its own torchrun runs: a rank not started within the timeout (its worker took
another step meanwhile), a rank that exits non-zero, or a worker that stops answering pings
(:class:`~dflash_assets.orchestration.cluster.WatchedResult`) stops the local torchrun and fails the step naming the
node; when the step fails or is interrupted, every rank is revoked (SIGTERM to the task, which stops its torchrun's
process group). Every node must see the run directory, the inputs and the export at the same paths (a shared
filesystem): the command carries the launching node's paths.

The broker is not trusted (issue 50, finding 8). A node runs a rank only for a live step: before sending, the
step writes a lease, :data:`LEASE_FILE` in the run directory (the shared filesystem, which Redis cannot write),
holding the exact command, one random token per chosen worker and the time it was written; each task carries
its worker's token. The node rebuilds the command (:func:`launch_command`), reads the lease from the command's
``--out`` directory and runs only if the command is the lease's, the token is its own worker's and the lease is
younger than the start timeout; the step removes the lease when its launch ends.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Sequence

from dflash_assets.dflash.training.distributed import NODE_NAME_ENV, node_name

#: The Celery task that runs one node's torchrun (registered on the cluster's app).
RANK_TASK = "dflash.train_node_rank"
#: Environment variable: seconds the step waits for idle workers of other nodes, and then for each rank task to
#: start on its worker. Default :data:`START_TIMEOUT_S`.
START_TIMEOUT_ENV = "DFLASH_RANK_START_TIMEOUT_S"
START_TIMEOUT_S = 120.0
#: Lines of a rank's output kept for its result (the end of its log).
TAIL_LINES = 40


class NodeRankError(RuntimeError):
    """A node rank could not be started, did not start in time, failed, or its worker was lost (the node is named
    in the message); ``log_tail`` holds the end of that rank's output when known."""

    def __init__(self, message: str, log_tail: str = "", timed_out: bool = False) -> None:
        super().__init__(message)
        self.log_tail = log_tail
        self.timed_out = timed_out  # the rank only had not ended yet (no failure seen)


class RankStopped(Exception):
    """Raised in a rank task when its worker is told to terminate it (revoke): stops its torchrun first."""


def start_timeout_s() -> float:
    """:data:`START_TIMEOUT_ENV` in seconds (default :data:`START_TIMEOUT_S`).

    Raises:
        ValueError: not a number of seconds >= 1 (naming the variable).
    """
    raw = os.environ.get(START_TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else START_TIMEOUT_S
    except ValueError:
        value = 0.0
    if not value >= 1.0:
        raise ValueError(f"{START_TIMEOUT_ENV}={raw!r}: give the seconds (>= 1) to wait for the other nodes' ranks")
    return value


def node_of(worker: str) -> str:
    """The node name of a worker name ``NAME@HOST`` (``-n NAME@%h``): ``NAME``."""
    return worker.split("@", 1)[0]


def this_node() -> str:
    """The node this process runs on: the name of the Celery worker running the current task (a step on a
    worker), else :func:`~dflash_assets.dflash.training.distributed.node_name` (``$DFLASH_NODE_NAME`` or the host
    name)."""
    try:
        from celery import current_task
    except ImportError:
        return node_name()
    hostname = getattr(getattr(current_task, "request", None), "hostname", None) if current_task else None
    return node_of(hostname) if hostname else node_name()


#: The flags of the training module a rank command may carry (the launcher's ``run_torchrun``); the first two take
#: several values.
TRAIN_FLAGS = ("--shards", "--tokenized", "--features", "--out", "--target-model", "--export", "--config-json")
LIST_FLAGS = ("--shards", "--tokenized")
TORCHRUN_OPTIONS = ("--nnodes", "--nproc_per_node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id")
TRAIN_MODULE = "dflash_assets.dflash.training.train"


class RankCommandRefused(ValueError):
    """A rank task's command is not the project's own multi-node launch command (the message says which part)."""


def launch_command(argv: Sequence[str]) -> list[str]:
    """The command a rank task runs for ``argv``, rebuilt on this node: only the project's own multi-node launch
    command runs, in ``torchrun_argv``'s form with this node's Python (``sys.executable``), the training module
    :data:`TRAIN_MODULE`, the rendezvous options it writes (:data:`TORCHRUN_OPTIONS`, c10d, two nodes or more)
    and the training flags :data:`TRAIN_FLAGS`. The broker's messages are not trusted (issue 50, finding 8: the
    task ran ``/bin/sh -c ...`` with the worker's environment and secrets, and the documented broker URL needs no
    password).

    Raises:
        RankCommandRefused: anything else, naming the first part that is not the launch command's (cut to 80
            characters).
    """

    from dflash_assets.dflash.training.distributed import torchrun_argv

    def refuse(why: str) -> RankCommandRefused:
        return RankCommandRefused(f"refused to run a node rank: {why}; only the project's own launch command runs")

    args = [str(a) for a in argv]
    # the launching node's interpreter is not run: this node's own (sys.executable) is, whatever the path sent
    if args[1:3] != ["-m", "torch.distributed.run"] or not os.path.basename(args[0]).startswith("python"):
        raise refuse("it is not PYTHON -m torch.distributed.run")
    options: dict[str, str] = {}
    rest = args[3:]
    while rest and rest[0].startswith("--"):
        key, _, value = rest.pop(0).partition("=")
        if key not in TORCHRUN_OPTIONS or not value or key in options:
            raise refuse(f"torchrun option {key[:80]!r} is not one the launch command writes")
        options[key] = value
    if rest[:2] != ["-m", TRAIN_MODULE]:
        raise refuse(f"the module run is not {TRAIN_MODULE}")
    rest, train_args = rest[2:], []
    while rest:
        flag = rest.pop(0)
        if flag not in TRAIN_FLAGS or flag in train_args:
            raise refuse(f"training argument {flag[:80]!r} is not one of {', '.join(TRAIN_FLAGS)} (each once)")
        values = []
        while rest and rest[0] not in TRAIN_FLAGS and (not values or flag in LIST_FLAGS):
            if rest[0].startswith("-"):
                raise refuse(f"training argument {rest[0][:80]!r} is not one of {', '.join(TRAIN_FLAGS)}")
            values.append(rest.pop(0))
        train_args += [flag, *values]
    try:
        nnodes, nproc = int(options.get("--nnodes", "")), int(options.get("--nproc_per_node", ""))
    except ValueError:
        raise refuse("--nnodes and --nproc_per_node must be numbers") from None
    if options.get("--rdzv-backend") != "c10d" or nnodes < 2 or nproc < 1:
        raise refuse("a node rank is a c10d rendezvous of two or more nodes")
    return torchrun_argv(
        train_args,
        nproc_per_node=nproc,
        nnodes=nnodes,
        rdzv_endpoint=options.get("--rdzv-endpoint", ""),
        rdzv_id=options.get("--rdzv-id", ""),
    )


#: The lease a step writes in its run directory while it launches node ranks (see the module docstring).
LEASE_FILE = "node_ranks.lease.json"


def out_dir_of(argv: Sequence[str]) -> str:
    """The run directory of a launch command: the value of its ``--out`` flag.

    Raises:
        RankCommandRefused: the command has no ``--out`` value.
    """
    args = list(argv)
    if "--out" not in args[:-1]:
        raise RankCommandRefused("refused to run a node rank: the command names no run directory (--out)")
    return str(args[args.index("--out") + 1])


def write_lease(argv: Sequence[str], workers: Sequence[str]) -> dict[str, str]:
    """Write the lease for sending ``argv`` to ``workers`` (``NAME@HOST``) into the command's run directory,
    atomically and readable by its owner only; returns ``{worker: token}`` (32 hex characters each).

    Raises:
        RankCommandRefused: ``argv`` has no ``--out``.
        OSError: the run directory cannot be written.
    """
    from dflash_assets.storage.atomic import atomic_write_bytes

    tokens = {w: secrets.token_hex(16) for w in workers}
    lease = {"argv": [str(a) for a in argv], "tokens": tokens, "written_at": time.time()}
    path = os.path.join(out_dir_of(argv), LEASE_FILE)
    atomic_write_bytes(path, json.dumps(lease).encode(), mode=0o600)  # owner-only from creation, temp file too
    return tokens


def remove_lease(argv: Sequence[str]) -> None:
    """Remove the lease of ``argv`` (the launch ended); a missing one is fine."""
    try:
        os.remove(os.path.join(out_dir_of(argv), LEASE_FILE))
    except FileNotFoundError:
        pass


def check_lease(argv: Sequence[str], worker: str, token: str, max_age_s: float) -> None:
    """Check, on the node, that ``argv`` is sent by a live step: the lease in its ``--out`` directory holds this
    exact command, ``token`` is ``worker``'s and the lease is at most ``max_age_s`` seconds old.

    Raises:
        RankCommandRefused: no lease, another command, a wrong token or an old lease (the message says which,
            never a token).
    """

    def refuse(why: str) -> RankCommandRefused:
        return RankCommandRefused(f"refused to run a node rank: {why}; only a live dflash_drafter step's launch runs")

    path = os.path.join(out_dir_of(argv), LEASE_FILE)
    try:
        with open(path) as f:
            lease = json.load(f)
        expected, written_at = lease["tokens"].get(worker, ""), float(lease["written_at"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise refuse(f"no readable lease at {path[:200]}") from None
    if lease.get("argv") != [str(a) for a in argv]:
        raise refuse("the command is not the one the step's lease holds")
    if not (isinstance(expected, str) and expected and hmac.compare_digest(expected, str(token))):
        raise refuse(f"the token is not the one the step's lease gives worker {worker[:80]}")
    age_s = time.time() - written_at
    if not -60.0 <= age_s <= max_age_s:  # a minute of clock skew between nodes is tolerated
        raise refuse(f"the step's lease is {age_s:.0f} s old (at most {max_age_s:.0f} s, {START_TIMEOUT_ENV})")


def run_node_rank(argv: Sequence[str], worker: str, token: str = "") -> dict:
    """Run one node's torchrun (its own process group), the command :func:`launch_command` rebuilds from
    ``argv``, with :data:`NODE_NAME_ENV` set to this worker's node; returns ``{"worker", "node", "exit_code",
    "log_tail"}`` (the last :data:`TAIL_LINES` lines). SIGTERM (the task revoked with ``terminate=True``) stops
    torchrun's whole group, then raises :class:`RankStopped`.

    Raises:
        RankCommandRefused: ``argv`` is not the project's launch command, or no live step's lease holds it for
            this worker and ``token`` (:func:`check_lease`; nothing runs)."""
    from dflash_assets.generation.processes.sessions import run_streaming

    rebuilt = launch_command(argv)
    check_lease(argv, worker, token, start_timeout_s())
    argv = rebuilt

    node = node_of(worker)
    tail: list[str] = []

    def on_line(line: str) -> None:
        tail[:] = [*tail, line][-TAIL_LINES:]

    def stopped(signum, frame):
        raise RankStopped(f"node rank on {node} stopped (task revoked)")

    previous = None
    if threading.current_thread() is threading.main_thread():  # prefork pool: the task runs on the main thread
        previous = signal.signal(signal.SIGTERM, stopped)
    try:
        code = run_streaming(argv, on_line, env=dict(os.environ, **{NODE_NAME_ENV: node}), grace_s=15.0)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return {"worker": worker, "node": node, "exit_code": code, "log_tail": "\n".join(tail)}


def register_rank_task(celery) -> None:
    """Register :data:`RANK_TASK` (:func:`run_node_rank` on the worker that takes it) on the Celery app."""

    @celery.task(name=RANK_TASK, bind=True)
    def train_node_rank(self, argv: list[str], token: str = "") -> dict:
        return run_node_rank(argv, self.request.hostname, token)


def idle_workers(app, count: int, exclude_node: str, timeout_s: float, log) -> list[str]:
    """``count`` workers (``NAME@HOST``) of nodes other than ``exclude_node`` that run no task, asked every 2 s
    for up to ``timeout_s`` seconds (sorted by name: the same choice for the same cluster).

    Raises:
        NodeRankError: fewer such workers within the time, naming the busy ones.
    """
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        active = app.control.inspect(timeout=1.0).active() or {}
        others = {w: tasks for w, tasks in active.items() if node_of(w) != exclude_node}
        idle = sorted(w for w, tasks in others.items() if not tasks)
        if len(idle) >= count:
            return idle[:count]
        busy = sorted(w for w, tasks in others.items() if tasks)
        if time.monotonic() > deadline:
            raise NodeRankError(
                f"training on {count + 1} nodes needs {count} idle Celery worker(s) on nodes other than "
                f"{exclude_node}; after {timeout_s:.0f} s ({START_TIMEOUT_ENV}) idle: {idle or 'none'}, busy: "
                f"{busy or 'none'}. Start a worker on each other node (docs/scale.md) or wait for their steps"
            )
        if not said:
            log.info(f"waiting for {count} idle worker(s) of other nodes (idle: {idle or 'none'}, busy: {busy})")
            said = True
        time.sleep(2.0)


class NodeRanks:
    """The node ranks of one run, each a :data:`RANK_TASK` sent to the direct queue of one worker with that
    worker's lease token (``tokens``, from :func:`write_lease`).

    ``watched(result, what)`` wraps each task's result in a watch on its worker
    (:class:`~dflash_assets.orchestration.cluster.WatchedResult`: ``ready``, ``get``, lost workers). ``watch`` (a
    thread) calls ``on_failure(message)`` once when a rank fails before the local torchrun ends;
    ``collect`` waits for every rank's result; ``revoke`` terminates every rank still running.
    """

    def __init__(
        self,
        app,
        argv: Sequence[str],
        workers: list[str],
        start_timeout: float,
        watched: Callable,
        tokens: dict[str, str],
    ):
        from celery.utils.nodenames import worker_direct

        self.workers, self.start_timeout = workers, start_timeout
        self.sent = time.monotonic()
        self.results = {
            w: app.send_task(RANK_TASK, args=[list(argv), tokens[w]], queue=worker_direct(w), routing_key=w)
            for w in workers
        }
        self.watched = {w: watched(r, f"node rank on {node_of(w)}") for w, r in self.results.items()}
        self.failure: NodeRankError | None = None

    def _check(self, worker: str) -> NodeRankError | None:
        """The failure of ``worker``'s rank so far (None while it runs or after it succeeded)."""
        result, watched, node = self.results[worker], self.watched[worker], node_of(worker)
        if result.state == "PENDING" and time.monotonic() - self.sent > self.start_timeout:
            return NodeRankError(
                f"the node rank sent to {node} ({worker}) did not start within {self.start_timeout:.0f} s "
                f"({START_TIMEOUT_ENV}): its worker is busy or gone"
            )
        if not watched.ready():
            return None
        try:
            value = watched.get()
        except Exception as exc:  # the task raised, or its worker was lost
            return NodeRankError(f"the node rank on {node} ({worker}) failed: {exc}")
        if value.get("exit_code") != 0:
            return NodeRankError(
                f"the node rank on {node} ({worker}): torchrun exited with {value.get('exit_code')}",
                value.get("log_tail", ""),
            )
        return None

    def watch(self, on_failure: Callable[[NodeRankError], None], stop: threading.Event) -> None:
        """Until ``stop`` is set: check every rank each second; at the first failure call ``on_failure``."""
        while not stop.wait(1.0):
            for worker in self.workers:
                failure = self._check(worker)
                if failure is not None:
                    self.failure = failure
                    on_failure(failure)
                    return

    def collect(self, timeout_s: float) -> list[dict]:
        """Every rank's result (``{"worker", "node", "exit_code", "log_tail"}``), waiting up to ``timeout_s``.

        Raises:
            NodeRankError: a rank failed, never started or did not end within ``timeout_s``, naming its node.
        """
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            while not self.watched[worker].ready():
                failure = self._check(worker)
                if failure is not None:
                    raise failure
                if time.monotonic() > deadline:
                    raise NodeRankError(
                        f"the node rank on {node_of(worker)} ({worker}) did not end {timeout_s:.0f} s after this "
                        "node's torchrun",
                        timed_out=True,
                    )
                time.sleep(0.5)
            failure = self._check(worker)
            if failure is not None:
                raise failure
        return [self.results[w].get(disable_sync_subtasks=False) for w in self.workers]  # see WatchedResult.get

    def revoke(self) -> None:
        """Terminate every rank not finished (SIGTERM to its task: it stops its torchrun's process group)."""
        for result in self.results.values():
            if not result.ready():
                result.revoke(terminate=True, signal="SIGTERM")
