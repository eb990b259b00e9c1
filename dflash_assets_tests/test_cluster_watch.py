"""Issue 50, findings 6 and 8, at unit level (real workers: test_cluster_daemon.py, test_train_nodes_celery.py).

Finding 6: a node's worker killed mid-step and restarted by a supervisor under its name before
``DFLASH_CELERY_LOST_AFTER_S`` answered pings, so the lost step's result never became ready and the run held its pool
slot for good. The watch now asks whether the task still runs anywhere.
"""

from __future__ import annotations

import time

import pytest

from dflash_assets.orchestration.cluster import WatchedResult, WorkerLostError

WORKER = "node-a@host"


class Result:
    """A Celery AsyncResult of a task STARTED on :data:`WORKER`, never finished."""

    id = "task-1"
    state = "STARTED"

    def __init__(self) -> None:
        self.info = {"hostname": WORKER, "pid": 4242}
        self.revoked: list[dict] = []

    def ready(self) -> bool:
        return False

    def revoke(self, **kwargs) -> None:
        self.revoked.append(kwargs)


class Control:
    """The broker's control API as a worker restarted under :data:`WORKER` answers it: pings answered, and the
    active tasks it lists are ``active`` (the new process runs nothing of the old one's)."""

    def __init__(self, active: list[dict]) -> None:
        self.active_tasks = active

    def ping(self, destination=None, timeout=1.0):
        return [{WORKER: {"ok": "pong"}}]

    def inspect(self, timeout=1.0, destination=None):
        control = self

        class Inspect:
            def active(self):
                return {WORKER: control.active_tasks}

        return Inspect()


class App:
    def __init__(self, active: list[dict]) -> None:
        self.control = Control(active)


def watch(result: Result, app: App, seconds: float = 2.0) -> bool:
    """Poll ``ready`` for up to ``seconds`` (the watch asks every 10 ms); whether it became ready."""
    watched = WatchedResult(result, app, "completions", lost_after=0.03)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if watched.ready():
            with pytest.raises(WorkerLostError) as err:
                watched.get()
            assert f"step completions: worker {WORKER} stopped answering while running it, or no longer runs it" in (
                str(err.value)
            )
            return True
        time.sleep(0.005)
    return False


def test_a_worker_restarted_under_its_name_does_not_keep_a_lost_step_alive():
    result = Result()
    assert watch(result, App(active=[]))  # it answers, but runs nothing of the step
    assert result.revoked == [{"terminate": True}]


def test_a_step_its_worker_still_runs_is_not_lost():
    result = Result()
    assert not watch(result, App(active=[{"id": "task-1", "hostname": WORKER}]), seconds=0.5)
    assert result.revoked == []


# Finding 8: the rank task ran any argv it was sent (`/bin/sh -c ...` ran, with the worker's environment and secrets).


def test_the_rank_task_runs_only_the_projects_launch_command(tmp_path):
    import sys

    from dflash_assets.dflash.training.distributed import torchrun_argv
    from dflash_assets.orchestration.node_ranks import RankCommandRefused, launch_command, run_node_rank

    marker = tmp_path / "ran"
    with pytest.raises(RankCommandRefused, match="only the project's own launch command runs"):
        run_node_rank(["/bin/sh", "-c", f"touch {marker}"], "node-b@host")
    assert not marker.exists()
    train = ["--shards", "/s/a", "/s/b", "--features", "offline", "--out", "/r", "--config-json", "/r/c.json"]
    good = torchrun_argv(train, nproc_per_node=1, nnodes=2, rdzv_endpoint="10.0.0.1:29500", rdzv_id="run7")
    assert launch_command(good) == good
    assert launch_command(["/other/node/python3", *good[1:]]) == good  # this node's interpreter runs
    head = [sys.executable, "-m", "torch.distributed.run"]
    bad = [
        ["/bin/sh", *good[1:]],  # not Python
        [*good[:3], "--no-python", *good[3:]],  # a torchrun option the launcher never writes
        [*good[:-2], "--out", "/r", "--", "/bin/sh"],  # an argument past the training flags
        [*good[: good.index("-m", 3)], "-m", "os", *train],  # another module
        [*head, "--standalone", "--nproc_per_node=1", "-m", "dflash_assets.dflash.training.train", *train],  # 1 node
        [*good, "--config-json", "/tmp/other.json"],  # a flag twice
        [*good[:-1], "-c"],  # a value that is an option
    ]
    for argv in bad:
        with pytest.raises(RankCommandRefused):
            launch_command(argv)
