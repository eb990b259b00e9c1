"""Issue 41, item 3 on loopback: the other node of a two-node drafter training started as a Celery task.

A real Redis (Debian's ``redis-server``) is the broker; Celery workers (``celery -A dflash_assets.orchestration.cluster
worker``, ``-c 1``) stand for the nodes. The test process stands for the ``dflash_drafter`` step on ``node-a``
(``DFLASH_NODE_NAME=node-a``, what a step running on node-a's worker reads from Celery) and calls the drafter's
launcher (:func:`~dflash_assets.stages.drafter.launcher.run_torchrun`) with the broker set, as the step does.
Training: a tiny random-init Llama target, offline shards, gloo, 1 process x 2 nodes on a c10d rendezvous.
One test goes the real path instead: a Dagster run of ``dflash_drafter`` (``dagster asset materialize``, the
cluster instance on a real PostgreSQL) whose step Dagster's Celery executor places on one of two node workers, so
the launcher runs, and waits on the other node's rank, inside that worker's prefork Celery task.

Checked independently of the launcher's own report: ``summary.json``, written by global rank 0 from an all-gather,
says world size 2 with one rank on node-a and one on node-b (each rank reads its node from its environment, which
node-b's worker set), both replicas agree, the export exists; node-b's worker log shows the rank task succeeded.
A node whose Python environment is broken (its torchrun worker exits at start) fails the launch naming that node,
and stops this node's torchrun (left alone, it would wait at the rendezvous for the gloo timeout).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest
import torch
import yaml

from dflash_assets.dflash.shards.extraction import extract_partition
from dflash_assets.dflash.shards.format import read_index
from dflash_assets.dflash.training.config import TrainConfig
from dflash_assets.orchestration.cluster import CELERY_BROKER_ENV
from dflash_assets.orchestration.node_ranks import RANK_TASK, START_TIMEOUT_ENV
from dflash_assets.stages.drafter.config import DrafterConfig
from dflash_assets.stages.drafter.launcher import TrainingRunError, run_torchrun
from dflash_simulators.loopback_cluster import NodeWorker, descendants, redis_missing, running_redis

try:
    from dflash_assets_tests.postgres_server import postgres_missing, running_postgres
    from dflash_assets_tests.system_parts import skip_or_fail
    from dflash_assets_tests.tiny_target import LAYER_IDS, VOCAB, make_rows, make_target
except ImportError:  # run from inside the tests folder
    from postgres_server import postgres_missing, running_postgres  # type: ignore[no-redef]
    from system_parts import skip_or_fail  # type: ignore[no-redef]
    from tiny_target import LAYER_IDS, VOCAB, make_rows, make_target  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_YAML = ROOT / "dflash_assets" / "configs" / "instance" / "dagster_cluster.yaml"
BIN = Path(sys.executable).parent
STEPS = 6


class Log:
    """The step's log as the launcher writes it (``info`` / ``error``), kept in memory."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(msg)

    warning = error = info

    def text(self) -> str:
        return "\n".join(self.lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def broker():
    """A real Redis server for the module."""
    pytest.importorskip("dagster_celery", reason="the cluster extra: pip install -e '.[cluster]'")
    skip_or_fail(redis_missing())
    with running_redis() as url:
        yield url


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny target and two offline shards of its features (12 rows)."""
    root = tmp_path_factory.mktemp("nodes")
    model, target = make_target(root)
    rows = make_rows(12)
    out = root / "hs"
    extract_partition(model, rows, out, LAYER_IDS, rows_per_shard=6, dtype=torch.bfloat16)
    tok = root / "tok.parquet"
    pl.DataFrame(rows).write_parquet(tok)
    return {"target": str(target), "shards": [str(out / s["name"]) for s in read_index(out)["shards"]]}


def worker_env(broker: str, extra_path: str = "") -> dict[str, str]:
    paths = [p for p in (extra_path, str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")) if p]
    return {
        **os.environ,
        CELERY_BROKER_ENV: broker,
        "OMP_NUM_THREADS": "1",
        "DAGSTER_DISABLE_TELEMETRY": "1",
        "PYTHONPATH": os.pathsep.join(paths),
    }


def start_workers(names: list[str], envs: dict[str, dict], tmp: Path) -> list[NodeWorker]:
    workers = [NodeWorker(n, envs[n], tmp / f"{n}.worker.log", cwd=ROOT) for n in names]
    try:
        for worker in workers:
            worker.wait_ready()
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers


def layout() -> DrafterConfig:
    return DrafterConfig(nproc=1, nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id=f"t{time.time_ns()}")


def train_config(d: dict, out: Path) -> TrainConfig:
    return TrainConfig(
        shards=d["shards"],
        features="offline",
        out_dir=str(out),
        target_model_path=d["target"],
        num_hidden_layers=1,
        num_context_features=len(LAYER_IDS),
        target_layer_ids=LAYER_IDS,
        block_size=4,
        mask_token_id=VOCAB - 1,
        max_anchors=4,
        batch_size=1,
        lr=3e-3,
        max_steps=STEPS,
        checkpoint_every=0,
        eval_fraction=0.0,
        log_every=1,
        seed=11,
        device="cpu",
    )


@pytest.fixture
def on_node_a(broker, monkeypatch):
    """This process as the step on node-a, the broker set."""
    monkeypatch.setenv(CELERY_BROKER_ENV, broker)
    monkeypatch.setenv("DFLASH_NODE_NAME", "node-a")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(START_TIMEOUT_ENV, "60")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return broker


def test_the_other_node_rank_runs_as_a_task_on_the_other_nodes_worker(on_node_a, data, tmp_path):
    """node-a's worker is idle but is this node: the rank goes to node-b's; both ranks train, rank 0 exports."""
    envs = {n: worker_env(on_node_a) for n in ("node-a", "node-b")}
    out, export = tmp_path / "run", tmp_path / "export"
    log = Log()
    started = time.monotonic()
    workers = start_workers(["node-a", "node-b"], envs, tmp_path)
    ready = time.monotonic()
    try:
        run_torchrun(log, train_config(data, out), layout(), str(export))
    finally:
        for worker in workers:
            worker.stop()
    print(f"workers ready in {ready - started:.1f} s; two-node training {time.monotonic() - ready:.1f} s")

    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == STEPS, summary
    assert sorted(summary["rank_nodes"]) == ["node-a", "node-b"], summary["rank_nodes"]
    assert len(set(summary["rank_param_checksums"])) == 1  # the replicas agree bit for bit
    assert [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()] == list(
        range(1, STEPS + 1)
    )
    assert (export / "model.safetensors").stat().st_size > 0 and (export / "config.json").is_file()
    assert not (out / "launch_other_nodes.sh").exists()  # nothing left for a hand-run
    assert "node rank on node-b (node-b@" in log.text() and "exited with 0" in log.text(), log.text()
    b_log = workers[1].tail(20000)
    assert f"Task {RANK_TASK}[" in b_log and "succeeded" in b_log, b_log
    assert f"Task {RANK_TASK}[" not in workers[0].tail(20000)  # this node's own worker took nothing


def test_a_failing_node_rank_fails_the_launch_naming_the_node(on_node_a, data, tmp_path):
    """node-c's Python stops every torchrun worker at start (a broken node): the launch fails within seconds
    naming node-c with its log's end, and this node's torchrun, which would wait for node-c's rank, is stopped."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if 'LOCAL_RANK' in os.environ:  # a torchrun worker, not the Celery worker\n"
        "    sys.exit('node-c: this node cannot import its training code')\n"
    )
    envs = {"node-c": worker_env(on_node_a, str(broken))}
    workers = start_workers(["node-c"], envs, tmp_path)
    log = Log()
    started = time.monotonic()
    try:
        with pytest.raises(TrainingRunError) as failed:
            run_torchrun(log, train_config(data, tmp_path / "run"), layout(), str(tmp_path / "export"))
        wall = time.monotonic() - started
    finally:
        for worker in workers:
            worker.stop()
    print(f"failing node rank reported after {wall:.1f} s")
    message = str(failed.value)
    assert "node-c" in message and "exited with" in message, message
    assert "cannot import its training code" in (failed.value.metadata or {}).get("log_tail", ""), failed.value.metadata
    assert wall < 60, wall  # not the rendezvous' or gloo's own timeouts
    assert not (tmp_path / "export" / "model.safetensors").exists()


def test_no_idle_worker_on_another_node_fails_after_the_start_timeout(on_node_a, data, tmp_path, monkeypatch):
    """Only this node's worker is up: nothing to send the rank to; the launch fails after the start timeout (2 s)."""
    monkeypatch.setenv(START_TIMEOUT_ENV, "2")
    workers = start_workers(["node-a"], {"node-a": worker_env(on_node_a)}, tmp_path)
    try:
        with pytest.raises(TrainingRunError, match=r"needs 1 idle Celery worker\(s\) on nodes other than node-a"):
            run_torchrun(Log(), train_config(data, tmp_path / "run"), layout(), str(tmp_path / "export"))
    finally:
        for worker in workers:
            worker.stop()
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_rank_sent_by_hand_through_the_broker_runs_nothing(on_node_a, data, tmp_path):
    """Issue 50, finding 8: anyone who can write to Redis can send node-b's worker the project's own launch command
    (here: a real training's); with no live step's lease in its run directory the task fails on the node, refused,
    and no torchrun starts there."""
    from celery.utils.nodenames import worker_direct

    from dflash_assets.dflash.training.distributed import torchrun_argv
    from dflash_assets.orchestration.cluster import celery_app

    workers = start_workers(["node-b"], {"node-b": worker_env(on_node_a)}, tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    cfg = train_config(data, out)
    (out / "train_config.json").write_text(cfg.model_dump_json())
    train = ["--shards", *cfg.shards, "--features", "offline", "--out", str(out), "--config-json", str(out / "c.json")]
    argv = torchrun_argv(train, nproc_per_node=1, nnodes=2, rdzv_endpoint=layout().rdzv_endpoint, rdzv_id="byhand")
    try:
        (name,) = [w for w in celery_app().control.inspect(timeout=2.0).ping() or {} if w.startswith("node-b@")]
        sent = celery_app().send_task(RANK_TASK, args=[argv, "0" * 32], queue=worker_direct(name), routing_key=name)
        with pytest.raises(Exception, match="refused to run a node rank: no readable lease"):
            sent.get(timeout=60, propagate=True)
        below = torchruns_below(workers[0])
        # the result is back before the worker's log has the task's failure line (seen in CI): wait for it
        deadline = time.monotonic() + 30
        while "RankCommandRefused" not in workers[0].tail(20000) and time.monotonic() < deadline:
            time.sleep(0.2)
        b_log = workers[0].tail(20000)
    finally:
        for worker in workers:
            worker.stop()
    assert below == [] and "RankCommandRefused" in b_log, b_log
    assert not (out / "train_log.jsonl").exists()


def test_a_rank_whose_worker_is_restarted_under_its_name_is_lost(on_node_a, data, tmp_path):
    """Issue 50, finding 6 with a real worker: node-b's worker runs a rank (its torchrun waiting at the rendezvous
    for node-a, which never comes) and is killed with kill -9, and a supervisor starts it again under the same name
    at once, well before the lost-after time. The new worker answers pings but runs nothing of the rank: the watch
    says lost within three missed answers, instead of waiting on a result that never comes."""
    from celery.utils.nodenames import worker_direct

    from dflash_assets.dflash.training.distributed import torchrun_argv
    from dflash_assets.orchestration.cluster import WatchedResult, WorkerLostError, celery_app
    from dflash_assets.orchestration.node_ranks import write_lease

    env = worker_env(on_node_a)
    workers = start_workers(["node-b"], {"node-b": env}, tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    train = ["--shards", *data["shards"], "--features", "offline", "--out", str(out)]
    argv = torchrun_argv(train, nproc_per_node=1, nnodes=2, rdzv_endpoint=layout().rdzv_endpoint, rdzv_id="lost")
    app = celery_app()
    try:
        (name,) = [w for w in app.control.inspect(timeout=2.0).ping() or {} if w.startswith("node-b@")]
        tokens = write_lease(argv, [name])
        sent = app.send_task(RANK_TASK, args=[argv, tokens[name]], queue=worker_direct(name), routing_key=name)
        watched = WatchedResult(sent, app, "", 3.0, "node rank on node-b")
        deadline = time.monotonic() + 60
        while not torchruns_below(workers[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sent.state == "STARTED" and torchruns_below(workers[0]), workers[0].tail()
        workers[0].kill()  # kill -9 of the worker and everything below it
        workers[0] = NodeWorker("node-b", env, tmp_path / "node-b.again.worker.log", cwd=ROOT)
        workers[0].wait_ready()
        assert name in (app.control.inspect(timeout=2.0).ping() or {})  # the same name answers again
        restarted = time.monotonic()
        while not watched.ready() and time.monotonic() < restarted + 60:
            time.sleep(0.2)
        lost_s = time.monotonic() - restarted
        with pytest.raises(WorkerLostError, match="restarted under its name"):
            watched.get()
    finally:
        for worker in workers:
            worker.stop()
    print(f"rank on the restarted worker judged lost {lost_s:.1f} s after the restart")
    assert lost_s < 30, lost_s  # three answers 1 s apart, not the 60 s of waiting


def torchruns_below(worker: NodeWorker) -> list[int]:
    """The torchrun processes (agent or training worker) below a node's Celery worker."""
    found = []
    for pid in descendants(worker.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"torch.distributed.run" in cmdline or b"dflash_assets.dflash.training.train" in cmdline:
            found.append(pid)
    return found


class Interrupted(Exception):
    """Stands for Dagster's step interrupt (raised in the step's thread while torchrun runs)."""


def test_an_interrupted_launch_stops_the_other_nodes_rank(on_node_a, data, tmp_path):
    """The step is interrupted mid-training (an exception raised in its thread, as Dagster's interrupt is, once
    the run's log shows a step): this node's torchrun is stopped and the rank task on node-b revoked, which stops
    node-b's torchrun and its training process."""
    workers = start_workers(["node-b"], {"node-b": worker_env(on_node_a)}, tmp_path)
    out = tmp_path / "run"
    seen: list[list[int]] = []

    def interrupt(signum, frame):
        raise Interrupted("step interrupted")

    def when_training() -> None:
        deadline = time.monotonic() + 90
        log = out / "train_log.jsonl"
        while not (log.is_file() and log.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.1)
        seen.append(torchruns_below(workers[0]))
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    cfg = train_config(data, out).model_copy(update={"max_steps": 100000})
    try:
        threading.Thread(target=when_training, daemon=True).start()
        with pytest.raises(Interrupted):
            run_torchrun(Log(), cfg, layout(), str(tmp_path / "export"))
        deadline = time.monotonic() + 30
        while torchruns_below(workers[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = torchruns_below(workers[0])
        # the worker logs the task's failure after its torchrun group is gone: wait for that line too
        while "RankStopped" not in workers[0].tail(20000) and time.monotonic() < deadline + 30:
            time.sleep(0.2)
        b_log = workers[0].tail(20000)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        for worker in workers:
            worker.stop()
    assert seen and len(seen[0]) >= 2, seen  # node-b's torchrun agent and its training process were running
    assert left == [], b_log
    assert "RankStopped" in b_log, b_log  # the task was revoked and stopped its torchrun itself


@pytest.fixture(scope="module")
def postgres():
    """A real PostgreSQL server for the module: the cluster instance (``dagster_cluster.yaml``) every node opens."""
    skip_or_fail(postgres_missing())
    with running_postgres() as url:
        yield url


PK = "0000000-0000011"  # one prompt range, its 12 rows' hidden states stored as two shards


def test_a_dagster_run_of_dflash_drafter_trains_on_two_nodes_through_the_celery_executor(broker, postgres, tmp_path):
    """The real path: ``dagster asset materialize --select dflash_drafter`` from a third shell with the broker set
    (``nnodes: 2``, gloo, 1 process per node); Dagster's Celery executor hands the step to node-a's or node-b's
    worker, where the launcher starts torchrun and waits, inside that worker's prefork task, on the rank task it
    sends to the other node's worker (Celery refuses such a wait unless told it is safe: without that every
    multi-node training through the executor failed with "Never call result.get() within a task!").

    Inputs stand in for the upstream stages: the partition key added to the instance (PostgreSQL, the shipped
    ``dagster_cluster.yaml``) and the partition's hidden states written by :func:`extract_partition` of a tiny
    random-init Llama into the storage root's ``hidden_states/<key>/``, as the hidden_states stage lays them out;
    local storage shared by both nodes (one machine: the shared filesystem ``docs/scale.md`` asks for). Not
    covered: separate machines, GPUs (NCCL), S3 storage, the upstream stages run in the same cluster, and a failed or
    interrupted step through Dagster (the direct-launcher tests below cover those).
    """
    model, target = make_target(tmp_path / "tiny")
    data = tmp_path / "data"
    extract_partition(model, make_rows(12), data / "hidden_states" / PK, LAYER_IDS, rows_per_shard=6)
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "resources": {"storage": {"root": str(data)}, "target_model": {"model_path": str(target)}},
                "ops": {"hidden_states": {"config": {"target_layer_ids": LAYER_IDS}}},
            }
        )
    )
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(CLUSTER_YAML, home / "dagster.yaml")
    env = {
        **worker_env(broker),
        "DAGSTER_HOME": str(home),
        "DFLASH_POSTGRES_URL": postgres,
        "DFLASH_CONFIG": str(config),
        START_TIMEOUT_ENV: "60",
    }
    env.pop("DFLASH_NODE_NAME", None)  # a worker's node is its name
    code = (
        "import dagster as dg\n"
        "from dflash_assets.orchestration.partitions import prompt_ranges\n"
        "with dg.DagsterInstance.get() as instance:\n"
        f"    instance.add_dynamic_partitions(prompt_ranges.name, [{PK!r}])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    two_nodes = layout()
    settings = {
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "block_size": 4,
        "mask_token_id": VOCAB - 1,
        "max_anchors": 4,
        "batch_size": 1,
        "lr": 3e-3,
        "max_steps": STEPS,
        "checkpoint_every": 0,
        "eval_fraction": 0.0,
        "seed": 11,
        "features": "offline",
        "nproc": 1,
        "nnodes": 2,
        "rdzv_endpoint": two_nodes.rdzv_endpoint,
        "rdzv_id": two_nodes.rdzv_id,
    }
    run_config = json.dumps({"ops": {"dflash_drafter": {"config": settings}}})
    argv = [str(BIN / "dagster"), "asset", "materialize", "-m", "dflash_assets.definitions"]
    argv += ["--select", "dflash_drafter", "--config-json", run_config]
    started = time.monotonic()
    workers = start_workers(["node-a", "node-b"], {n: env for n in ("node-a", "node-b")}, tmp_path)
    ready = time.monotonic()
    try:
        launch = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    finally:
        for worker in workers:
            worker.stop()
    print(f"workers ready in {ready - started:.1f} s; the Dagster run {time.monotonic() - ready:.1f} s")
    logs = {w.node: w.tail(200000) for w in workers}
    shown = "\n".join([launch.stdout[-3000:], launch.stderr[-6000:], *(f"{n}: {t[-3000:]}" for n, t in logs.items())])
    assert launch.returncode == 0, shown
    # which worker ran the step (dagster-celery's task), and that the rank went to the other one
    step_nodes = [n for n, t in logs.items() if re.search(r"Task execute_plan\[[0-9a-f-]+\] succeeded", t)]
    assert len(step_nodes) == 1, shown
    rank_node = "node-b" if step_nodes[0] == "node-a" else "node-a"
    assert f"Task {RANK_TASK}[" in logs[rank_node] and f"Task {RANK_TASK}[" not in logs[step_nodes[0]], shown
    (summary_path,) = (data / "dflash_drafter" / "runs").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["world_size"] == 2 and summary["step"] == STEPS, summary
    assert sorted(summary["rank_nodes"]) == ["node-a", "node-b"], summary["rank_nodes"]
    assert len(set(summary["rank_param_checksums"])) == 1  # the replicas agree bit for bit
    assert (data / "dflash_drafter" / "export" / "model.safetensors").stat().st_size > 0
    assert "RUN_SUCCESS" in launch.stdout + launch.stderr, shown


def test_node_names_and_the_start_timeout_setting(monkeypatch):
    """Outside a worker this process's node is $DFLASH_NODE_NAME (else the host name); a worker's is the NAME of
    its NAME@HOST; a bad start timeout names its variable."""
    from dflash_assets.orchestration.node_ranks import START_TIMEOUT_S, node_of, start_timeout_s, this_node

    monkeypatch.setenv("DFLASH_NODE_NAME", "node-x")
    assert this_node() == "node-x" and node_of("node-b@host-1") == "node-b"
    monkeypatch.delenv("DFLASH_NODE_NAME")
    assert this_node() == socket.gethostname()
    monkeypatch.delenv(START_TIMEOUT_ENV, raising=False)
    assert start_timeout_s() == START_TIMEOUT_S
    for bad in ("soon", "0", "nan"):
        monkeypatch.setenv(START_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=START_TIMEOUT_ENV):
            start_timeout_s()
