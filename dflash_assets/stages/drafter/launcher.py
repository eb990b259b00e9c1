"""Training with ``torchrun`` (several processes or nodes), the same code path as in-process training."""

import json
import os

from dflash_assets.dflash.training.config import TrainConfig
from dflash_assets.generation.processes.sessions import run_streaming


class TrainingRunError(RuntimeError):
    """A training run cannot start or did not finish; ``metadata`` (or None) says more, e.g. ``log_tail``."""

    def __init__(self, message: str, metadata: dict | None = None):
        super().__init__(message)
        self.metadata = metadata


def check_process_layout(config) -> None:
    """Check ``nproc`` / ``nnodes`` / ``rdzv_*`` of a drafter config (a bad layout is a config error even
    when the run would be reused).

    Raises:
        TrainingRunError: the layout cannot be launched, saying why.
    """
    from dflash_assets.dflash.training.distributed import torchrun_argv

    try:
        torchrun_argv(
            [],
            nproc_per_node=config.nproc,
            nnodes=config.nnodes,
            rdzv_endpoint=config.rdzv_endpoint,
            rdzv_id=config.rdzv_id,
        )
    except ValueError as exc:
        raise TrainingRunError(str(exc)) from exc


def run_torchrun(log, cfg: TrainConfig, config, export_dir: str) -> None:
    """Train with ``torchrun`` (same code path as in-process), streaming its log to ``log``. ``nnodes > 1``:
    this node joins the c10d rendezvous at ``rdzv_endpoint``; with ``$DFLASH_CELERY_BROKER`` set the other nodes'
    torchrun run as tasks on idle workers of other nodes (:mod:`dflash_assets.orchestration.node_ranks`), else
    the command for them is written to ``<run dir>/launch_other_nodes.sh`` and logged, for the user to run
    (see :mod:`dflash_assets.dflash.training.distributed`).

    Raises:
        TrainingRunError: a bad process layout, torchrun exited non-zero (``metadata["log_tail"]``: its
            last 40 lines), or a node rank on another worker failed or never started (naming the node).
    """
    from dflash_assets.dflash.training.distributed import torchrun_argv, write_node_script

    cfg_path = os.path.join(cfg.out_dir, "train_config.json")
    os.makedirs(cfg.out_dir, exist_ok=True)
    with open(cfg_path, "w") as f:
        json.dump(
            cfg.model_dump(exclude={"shards", "tokenized", "out_dir", "target_model_path"}),
            f,
        )
    train_args = [
        "--shards",
        *cfg.shards,
        "--tokenized",
        *cfg.tokenized,
        "--features",
        cfg.features,
        "--out",
        cfg.out_dir,
        "--target-model",
        cfg.target_model_path,
        "--export",
        export_dir,
        "--config-json",
        cfg_path,
    ]
    try:
        argv = torchrun_argv(
            train_args,
            nproc_per_node=config.nproc,
            nnodes=config.nnodes,
            rdzv_endpoint=config.rdzv_endpoint,
            rdzv_id=config.rdzv_id,
        )
    except ValueError as exc:
        raise TrainingRunError(str(exc)) from exc
    from dflash_assets.orchestration.cluster import celery_broker_url

    tail: list[str] = []

    def on_line(line: str) -> None:
        tail[:] = [*tail, line][-40:]
        if "step" in line or "error" in line.lower():
            log.info(line)

    if config.nnodes > 1 and celery_broker_url() is not None:
        _run_with_node_ranks(log, argv, config.nnodes, on_line, tail)
        return
    if config.nnodes > 1:
        script = write_node_script(
            os.path.join(cfg.out_dir, "launch_other_nodes.sh"),
            argv,
            {"PYTHONPATH": os.environ.get("PYTHONPATH", "")} if os.environ.get("PYTHONPATH") else None,
        )
        log.info(
            f"waiting for {config.nnodes - 1} more node(s) at {config.rdzv_endpoint}: on each, run {script} "
            "(same paths on a shared filesystem)"
        )
    log.info("launching " + " ".join(argv[:9]) + " ...")
    # its own process group, stopped whole when the step is interrupted or fails (workers included)
    code = run_streaming(argv, on_line)
    if code != 0:
        raise TrainingRunError(f"torchrun exited with {code}", metadata={"log_tail": "\n".join(tail)})


RESUME_ADVICE = "materialize dflash_drafter again: the run resumes from its last checkpoint"
#: Seconds this node waits, after its own torchrun failed, for the other ranks to say whether one of them failed.
REMOTE_VERDICT_S = 20.0


def _run_with_node_ranks(log, argv: list[str], nnodes: int, on_line, tail: list[str]) -> None:
    """Several nodes through the cluster's Celery workers (:mod:`dflash_assets.orchestration.node_ranks`): the
    other ``nnodes - 1`` nodes' torchrun as tasks on idle workers of other nodes, this node's here; a rank that
    fails or never starts stops this node's torchrun; every rank is revoked when this fails or is interrupted.

    Raises:
        TrainingRunError: no idle workers, a rank failed / did not start / was lost (naming its node), or this
            node's torchrun exited non-zero (``metadata["log_tail"]``).
    """
    from dflash_assets.orchestration.cluster import WatchedResult, celery_app, lost_after_s
    from dflash_assets.orchestration.node_ranks import (
        NodeRankError,
        NodeRanks,
        idle_workers,
        remove_lease,
        start_timeout_s,
        this_node,
        write_lease,
    )

    try:
        app, me, timeout, lost_after = celery_app(), this_node(), start_timeout_s(), lost_after_s()
        workers = idle_workers(app, nnodes - 1, me, timeout, log)
    except (NodeRankError, ValueError) as exc:
        raise TrainingRunError(str(exc)) from exc

    def watched(result, what: str) -> WatchedResult:
        return WatchedResult(result, app, "", lost_after, what, RESUME_ADVICE)

    tokens = write_lease(argv, workers)  # what the other nodes check before they run anything
    try:
        _launch_with_ranks(log, NodeRanks(app, argv, workers, timeout, watched, tokens), argv, me, on_line, tail)
    finally:
        remove_lease(argv)


def _launch_with_ranks(log, ranks, argv: list[str], me: str, on_line, tail: list[str]) -> None:
    """This node's torchrun beside the ranks already sent (``ranks``, a ``NodeRanks``): see
    :func:`_run_with_node_ranks`."""
    import threading

    from dflash_assets.dflash.training.distributed import NODE_NAME_ENV
    from dflash_assets.generation.processes.sessions import stop_process_group
    from dflash_assets.orchestration.node_ranks import NodeRankError

    workers, timeout = ranks.workers, ranks.start_timeout
    log.info(f"node ranks sent to {', '.join(workers)}; launching this node's ({me}) " + " ".join(argv[:9]) + " ...")
    local, stop = [], threading.Event()

    def on_start(proc) -> None:
        local.append(proc)
        if ranks.failure is not None:
            stop_process_group(proc, grace_s=15.0)

    def on_failure(failure: NodeRankError) -> None:
        log.error(f"{failure}; stopping this node's torchrun")
        if local:
            stop_process_group(local[0], grace_s=15.0)

    watcher = threading.Thread(target=ranks.watch, args=(on_failure, stop), name="node-rank-watch", daemon=True)
    watcher.start()
    try:
        code = run_streaming(argv, on_line, env=dict(os.environ, **{NODE_NAME_ENV: me}), on_start=on_start)
        stop.set()
        watcher.join(10)
        if ranks.failure is not None:
            raise ranks.failure
        if code != 0:
            # a rank failing elsewhere also breaks this node's rendezvous, often before the watcher hears of it:
            # give the other ranks a moment to report, and name the node that failed when one did
            try:
                ranks.collect(REMOTE_VERDICT_S)
            except NodeRankError as remote:
                if not remote.timed_out:
                    raise
            raise TrainingRunError(f"torchrun exited with {code} on {me}", metadata={"log_tail": "\n".join(tail)})
        results = ranks.collect(timeout)
    except NodeRankError as exc:
        ranks.revoke()
        raise TrainingRunError(str(exc), metadata={"log_tail": exc.log_tail or "\n".join(tail)}) from exc
    except BaseException:
        stop.set()
        ranks.revoke()
        raise
    for result in results:
        log.info(f"node rank on {result['node']} ({result['worker']}) exited with {result['exit_code']}")
