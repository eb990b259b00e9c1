"""``torchrun`` command lines for multi-GPU / multi-node drafter training (no Dagster imports).

One process per GPU (``--nproc_per_node``), data-parallel drafter (DDP: NCCL on GPU, gloo on CPU),
one frozen target replica per process in online mode (:mod:`dflash_assets.dflash.training.train`). One node:
``torchrun --standalone``. Several nodes: every node runs the same command with ``--nnodes N
--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID``; HOST:PORT is reachable from all nodes
(the first node's address is usual), ranks are assigned when all N nodes have joined. Every node must
see the inputs, the run directory and the export directory at the same paths (a shared filesystem):
global rank 0, on whichever node it lands, writes checkpoints (atomically), the log, the summary and
the export; every rank loads the latest checkpoint on resume.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence

__all__ = ["NODE_NAME_ENV", "node_name", "torchrun_argv", "write_node_script"]

#: Environment variable naming the node a training process runs on (a Celery worker's node name, ``-n NAME@%h``);
#: each rank records it in ``summary.json`` (``rank_nodes``). Unset: the host name.
NODE_NAME_ENV = "DFLASH_NODE_NAME"


def node_name() -> str:
    """This process's node: ``$DFLASH_NODE_NAME`` when set, else the host name."""
    import socket

    return os.environ.get(NODE_NAME_ENV, "").strip() or socket.gethostname()


def torchrun_argv(
    train_args: Sequence[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    rdzv_endpoint: str = "",
    rdzv_id: str = "dflash",
    rdzv_backend: str = "c10d",
    python: str = sys.executable,
) -> list[str]:
    """``python -m torch.distributed.run ... -m dflash_assets.dflash.training.train <train_args>``.

    Raises:
        ValueError: ``nnodes > 1`` without ``rdzv_endpoint`` (``HOST:PORT``), or counts below 1.
    """
    if nproc_per_node < 1 or nnodes < 1:
        raise ValueError(f"nproc_per_node ({nproc_per_node}) and nnodes ({nnodes}) must be >= 1")
    argv = [python, "-m", "torch.distributed.run"]
    if nnodes == 1:
        argv += ["--standalone", f"--nproc_per_node={nproc_per_node}"]
    else:
        if not rdzv_endpoint or ":" not in rdzv_endpoint:
            raise ValueError(
                f"nnodes={nnodes} needs rdzv_endpoint HOST:PORT reachable from every node "
                "(set ops.dflash_drafter.config.rdzv_endpoint, e.g. 10.0.0.1:29500)"
            )
        argv += [
            f"--nnodes={nnodes}",
            f"--nproc_per_node={nproc_per_node}",
            f"--rdzv-backend={rdzv_backend}",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-id={rdzv_id}",
        ]
    return [*argv, "-m", "dflash_assets.dflash.training.train", *train_args]


def write_node_script(path: str | os.PathLike, argv: Sequence[str], env: dict[str, str] | None = None) -> str:
    """Write a shell script that runs ``argv`` (the command every other node runs); returns its path."""
    from dflash_assets.storage.atomic import atomic_write_bytes

    lines = [
        "#!/bin/sh",
        "# Run this on each of the other nodes (same paths, shared filesystem): it joins the rendezvous.",
        "set -e",
    ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    lines.append("exec " + " ".join(shlex.quote(a) for a in argv))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
    os.chmod(path, 0o755)
    return str(path)
