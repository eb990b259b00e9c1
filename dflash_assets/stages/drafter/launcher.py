"""Training with ``torchrun`` (several processes or nodes), the same code path as in-process training."""

import json
import os

from dflash_assets.dflash.train_config import TrainConfig
from dflash_assets.generation.processes import run_streaming


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
    from dflash_assets.dflash.distributed import torchrun_argv

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
    this node joins the c10d rendezvous at ``rdzv_endpoint``; the command for the other nodes is written to
    ``<run dir>/launch_other_nodes.sh`` and logged (see :mod:`dflash_assets.dflash.distributed`).

    Raises:
        TrainingRunError: a bad process layout, or torchrun exited non-zero (``metadata["log_tail"]``: its
            last 40 lines).
    """
    from dflash_assets.dflash.distributed import torchrun_argv, write_node_script

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
    tail: list[str] = []

    def on_line(line: str) -> None:
        tail[:] = [*tail, line][-40:]
        if "step" in line or "error" in line.lower():
            log.info(line)

    # its own process group, stopped whole when the step is interrupted or fails (workers included)
    code = run_streaming(argv, on_line)
    if code != 0:
        raise TrainingRunError(f"torchrun exited with {code}", metadata={"log_tail": "\n".join(tail)})
