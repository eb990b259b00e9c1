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


def test_the_projects_launch_command_runs_only_under_a_live_steps_lease(tmp_path):
    """Finding 8, the rest: write access to Redis could still send the project's own command (any run directory,
    any config file); a node runs it only when the step's lease in that run directory holds that exact command and
    the worker's token, and the lease is younger than the start timeout."""
    import json
    import os
    import time

    from dflash_assets.dflash.training.distributed import torchrun_argv
    from dflash_assets.orchestration.node_ranks import (
        LEASE_FILE,
        RankCommandRefused,
        check_lease,
        remove_lease,
        run_node_rank,
        write_lease,
    )

    run = tmp_path / "run"
    run.mkdir()
    train = ["--shards", "/s/a", "--features", "offline", "--out", str(run), "--config-json", str(run / "c.json")]
    good = torchrun_argv(train, nproc_per_node=1, nnodes=2, rdzv_endpoint="10.0.0.1:29500", rdzv_id="run7")
    worker = "node-b@host"
    with pytest.raises(RankCommandRefused, match="no readable lease"):  # what a message sent by hand finds
        run_node_rank(good, worker, "0" * 32)

    tokens = write_lease(good, [worker, "node-c@host"])
    lease = run / LEASE_FILE
    assert oct(lease.stat().st_mode & 0o777) == "0o600"
    assert len(tokens[worker]) == 32 and tokens[worker] != tokens["node-c@host"]
    check_lease(good, worker, tokens[worker], 120.0)  # the step's own message: no error
    other = [*good[:-1], str(tmp_path / "elsewhere.json")]  # same run directory, another config file
    refusals = {
        "the command is not the one": (other, worker, tokens[worker]),
        "the token is not the one": (good, worker, tokens["node-c@host"]),  # another worker's token
        "the token is not the one the step's lease gives worker node-d": (good, "node-d@host", tokens[worker]),
    }
    for why, (argv, name, token) in refusals.items():
        with pytest.raises(RankCommandRefused, match=why) as refused:
            run_node_rank(argv, name, token)
        assert tokens[worker] not in str(refused.value) and tokens["node-c@host"] not in str(refused.value)
    body = json.loads(lease.read_text())
    lease.write_text(json.dumps({**body, "written_at": time.time() - 121}))  # older than the start timeout
    with pytest.raises(RankCommandRefused, match=r"lease is 121 s old \(at most 120 s"):
        run_node_rank(good, worker, tokens[worker])
    remove_lease(good)
    assert not lease.exists()
    remove_lease(good)  # already gone: fine
    with pytest.raises(RankCommandRefused, match="no readable lease"):
        check_lease(good, worker, tokens[worker], 120.0)
    assert os.listdir(run) == []  # nothing ran, nothing written


def test_the_lease_is_owner_only_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """The lease's tokens are never readable by others, not even for the moment between the write and a chmod:
    the temp file is created 0600 (the last stop's lease was chmodded after the rename, default-readable
    until then)."""
    import os

    from dflash_assets.dflash.training.distributed import torchrun_argv
    from dflash_assets.orchestration.node_ranks import LEASE_FILE, write_lease
    from dflash_assets.storage import atomic

    run = tmp_path / "run"
    run.mkdir()
    argv = torchrun_argv(["--out", str(run)], nproc_per_node=1, nnodes=2, rdzv_endpoint="10.0.0.1:1", rdzv_id="r")
    seen, replace = [], os.replace

    def spy(src, dst):  # the temp file's mode as it becomes the lease
        seen.append((os.path.basename(dst), os.stat(src).st_mode & 0o777))
        return replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", spy)
    old = os.umask(0o022)  # the usual default: a file made without a mode would be 0644
    try:
        write_lease(argv, ["node-b@host"])
    finally:
        os.umask(old)
    assert seen == [(LEASE_FILE, 0o600)]
