"""Issue 41, item 2 on loopback: Dagster's Celery executor places partitions on two nodes' workers.

Two Celery workers on this machine stand for two nodes (``node-a``, ``node-b``): each its own config file (its
own simulated SGLang servers on its own ports, its own scratch dir and server registry), both consuming the one
queue on a real Redis (Debian's ``redis-server``). The instance is the shipped ``dagster_cluster.yaml`` on a real
PostgreSQL server, the storage a real S3 endpoint (``moto_server``). The pool ``dflash_inference`` has two slots
(one per node's servers); one tick of the backfill schedule over eight partitions of ``completions`` requests two
ranges, launched together from a third shell (``dagster asset materialize``, the real definitions with
``DFLASH_CELERY_BROKER`` set).

Checked independently of Dagster's own bookkeeping: each simulated server logs the prompts it received, so every
prompt was answered exactly once and by the node whose worker ran its partition (the worker's name in the run's
events); each node did some; the tables on S3 hold every row once; ``status`` read from PostgreSQL agrees.

A node lost mid-partition (kill -9 of its worker and everything under it), its run failed by the launcher's watch
on the worker and the partition resumed on the other node from the journal on S3, is tested as a cluster runs it
unattended, the daemon ticking the backfill schedule: ``test_cluster_daemon.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
import yaml

from dflash_assets.generation.processes.ports import free_port_block
from dflash_assets.orchestration.cluster import CELERY_BROKER_ENV, CELERY_QUEUE
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.orchestration.pools import INFERENCE_POOL, ensure_pool_limits
from dflash_simulators.loopback_cluster import (
    NodeWorker,
    kill_group,
    launch_completions,
    redis_missing,
    running_redis,
)

try:
    from dflash_assets_tests.postgres_server import postgres_missing, running_postgres
    from dflash_assets_tests.s3_fixtures import MotoServer
    from dflash_assets_tests.system_parts import skip_or_fail
except ImportError:  # run from inside the tests folder
    from postgres_server import postgres_missing, running_postgres  # type: ignore[no-redef]
    from s3_fixtures import MotoServer  # type: ignore[no-redef]
    from system_parts import skip_or_fail  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_YAML = ROOT / "dflash_assets" / "configs" / "instance" / "dagster_cluster.yaml"
BIN = Path(sys.executable).parent
NODES = ("node-a", "node-b")
NUM_SERVERS, SLOTS = 1, 4
PARTITION_SIZE, NUM_PROMPTS = 4, 32  # 8 partitions
STUB = "dflash_simulators.sglang_stub"
# 20 simulated s of start-up, median 120 tokens at 87.5 tok/s per slot, 50x faster than real
SIM = ["--sim-startup-s", "20", "--sim-median-tokens", "120", "--sim-sigma", "0.5", "--sim-speed", "50"]
BUCKET, PREFIX = "dflash-cluster", "run"


def _services_missing() -> str | None:
    return postgres_missing() or redis_missing()


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """PostgreSQL, Redis and moto S3, each started here and stopped at the end of the module."""
    pytest.importorskip("dagster_celery", reason="the cluster extra: pip install -e '.[cluster]'")
    skip_or_fail(_services_missing())
    logs = tmp_path_factory.mktemp("services")
    with running_postgres() as postgres_url, running_redis() as redis_url:
        moto = MotoServer(str(logs / "moto.log"))
        try:
            yield {"postgres": postgres_url, "redis": redis_url, "s3": moto.url}
        finally:
            moto.stop()


def test_single_node_default_is_the_multiprocess_executor_unless_a_broker_is_set(monkeypatch):
    from dflash_assets.orchestration.cluster import celery_broker_url, partition_executor
    from dflash_assets.orchestration.runs import reaping_executor

    monkeypatch.delenv(CELERY_BROKER_ENV, raising=False)
    assert partition_executor(reaping_executor) is reaping_executor
    monkeypatch.setenv(CELERY_BROKER_ENV, "  ")
    assert celery_broker_url() is None and partition_executor(reaping_executor) is reaping_executor
    monkeypatch.setenv(CELERY_BROKER_ENV, "amqp://user:s3cret@host//")
    with pytest.raises(ValueError, match=CELERY_BROKER_ENV) as bad:
        celery_broker_url()
    assert "s3cret" not in str(bad.value)  # never the URL: it may hold a password
    pytest.importorskip("dagster_celery")
    monkeypatch.setenv(CELERY_BROKER_ENV, "redis://:s3cret@127.0.0.1:6379/0")
    celery = partition_executor(reaping_executor)
    assert celery.name == "celery" and celery is not reaping_executor
    from dflash_assets.orchestration.cluster import celery_app

    app = celery_app()
    assert app.conf.task_default_queue == CELERY_QUEUE and app.conf.worker_prefetch_multiplier == 1
    assert "execute_plan" in app.tasks and app.conf.task_track_started  # STARTED names the worker to watch

    from dflash_assets.orchestration.cluster import LOST_AFTER_ENV, LOST_AFTER_S, lost_after_s

    monkeypatch.delenv(LOST_AFTER_ENV, raising=False)
    assert lost_after_s() == LOST_AFTER_S
    for bad in ("soon", "0.5", "nan"):
        monkeypatch.setenv(LOST_AFTER_ENV, bad)
        with pytest.raises(ValueError, match=LOST_AFTER_ENV):
            lost_after_s()


def node_config(
    tmp: Path,
    node: str,
    s3_url: str,
    sim_args: list[str] = SIM,
    slots: int = SLOTS,
    prefix: str = PREFIX,
    target_model: dict | None = None,
) -> Path:
    """The config file of one node: shared S3 root (journal synced at every row), its own scratch, its own
    simulated servers and their request log; ``target_model``: its ``resources.target_model`` section (None: the
    default)."""
    sim = tmp / node / "sim"
    sim.mkdir(parents=True)
    config = {
        "resources": {
            "storage": {
                "root": f"s3://{BUCKET}/{prefix}",
                "endpoint_url": s3_url,
                "region": "us-east-1",
                "scratch_dir": str(tmp / node / "scratch"),
                "journal_sync_rows": 1,
            },
            "inference": {
                "mode": "sglang",
                "max_running_requests": slots,
                "startup_timeout_s": 60.0,
                "sglang": {
                    "model_path": "simulated",
                    "num_servers": NUM_SERVERS,
                    "port_base": free_port_block(NUM_SERVERS),
                    "launch_module": STUB,
                    "extra_args": [*sim_args, "--sim-request-log", str(sim / "requests.jsonl")],
                },
                "client": {"backoff_base_s": 0.05},
            },
            "generation": {"max_output_tokens": 4096, "temperature": 0.6},
        }
    }
    if target_model is not None:
        config["resources"]["target_model"] = target_model
    path = tmp / node / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def node_env(tmp: Path, node: str, services: dict, config: Path) -> dict[str, str]:
    """The environment of one node's processes: its DAGSTER_HOME (the cluster dagster.yaml), its config file,
    the shared instance, broker and S3 credentials."""
    home = tmp / node / "home"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(CLUSTER_YAML, home / "dagster.yaml")
    return {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "DFLASH_CONFIG": str(config),
        "DFLASH_POSTGRES_URL": services["postgres"],
        CELERY_BROKER_ENV: services["redis"],
        "DFLASH_SERVER_REGISTRY": str(tmp / node / "registry"),
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "DAGSTER_DISABLE_TELEMETRY": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]),
    }


def build_corpus(tmp: Path, env: dict[str, str], services: dict, num_prompts: int, partition_size: int) -> list[str]:
    """``prompt_corpus`` from a JSONL of ``num_prompts`` prompts, in a fresh database schema of the shared instance
    and on S3 (one process, in-process execution); returns the partition keys."""
    import sqlalchemy as sa

    engine = sa.create_engine(services["postgres"])
    with engine.begin() as connection:  # the module's tests share the server: each starts from an empty instance
        connection.execute(sa.text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    engine.dispose()
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"prompt {i}"}) + "\n" for i in range(num_prompts)))
    code = (
        "import dagster as dg, sys\n"
        "from dflash_assets.assets.prompts import prompt_corpus\n"
        "from dflash_assets.definitions import RESOURCES\n"
        "with dg.DagsterInstance.get() as instance:\n"
        "    result = dg.materialize([prompt_corpus], instance=instance, resources={'storage': RESOURCES['storage']},\n"
        f"        run_config={{'ops': {{'prompt_corpus': {{'config': {{'sources': [{str(prompts)!r}],"
        f" 'partition_size': {partition_size}}}}}}}}})\n"
        "sys.exit(0 if result.success else 1)\n"
    )
    local = {**env}
    local.pop(CELERY_BROKER_ENV)  # in-process, as on one node
    out = subprocess.run([sys.executable, "-c", code], env=local, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    with cluster_instance(env, services) as instance:
        keys = sorted(instance.get_dynamic_partitions(prompt_ranges.name))
        ensure_pool_limits(instance)
        instance.event_log_storage.set_concurrency_slots(INFERENCE_POOL, len(NODES))  # one per node's servers
    return keys


@contextmanager
def cluster_instance(env: dict[str, str], services: dict):
    """The shared instance as a node opens it (its DAGSTER_HOME, the URL in the environment while it opens)."""
    os.environ["DFLASH_POSTGRES_URL"] = services["postgres"]
    try:
        with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
            yield instance
    finally:
        os.environ.pop("DFLASH_POSTGRES_URL", None)


def s3_client(services: dict):
    import boto3

    return boto3.client(
        "s3", endpoint_url=services["s3"], region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )


def indices_of(pk: str) -> range:
    """The prompt indices of partition ``pk`` (``first-last``, both included)."""
    first, last = pk.split("-")
    return range(int(first), int(last) + 1)


def backfill_tick(instance: dg.DagsterInstance) -> list[tuple[str, str]]:
    """The ranges one tick of the backfill schedule requests on several nodes (what the daemon would launch)."""
    from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

    from dflash_assets.app.automation import build_backfill_schedule
    from dflash_assets.definitions import defs, partition_stages_job

    schedule = build_backfill_schedule(partition_stages_job, spread_over_nodes=True)
    context = dg.build_schedule_context(instance=instance, repository_def=defs.get_repository_def())
    data = schedule.evaluate_tick(context)
    return [(r.tags[ASSET_PARTITION_RANGE_START_TAG], r.tags[ASSET_PARTITION_RANGE_END_TAG]) for r in data.run_requests]


def received(tmp: Path, node: str) -> Counter:
    """Corpus prompts a node's simulated servers received (health probes excluded)."""
    path = tmp / node / "sim" / "requests.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return Counter(e["key"] for e in map(json.loads, lines) if e["ev"] == "recv" and e["key"].startswith("prompt"))


def worker_of_run(instance: dg.DagsterInstance, run_id: str) -> str:
    """The Celery worker (node name) that ran the run's completions step, from the event it logged there."""
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
        if entry.dagster_event and "in celery worker" in (entry.dagster_event.message or ""):
            meta = entry.dagster_event.event_specific_data.metadata
            return str(getattr(meta["Celery worker"], "value", meta["Celery worker"])).split("@")[0]
    raise AssertionError(f"run {run_id}: no step ran in a celery worker")


def test_a_backfill_of_eight_partitions_spreads_over_two_node_workers(services, tmp_path):
    """The backfill schedule's tick on several nodes requests one range per node (the pool's two slots); the two
    range runs, launched together, run one on each node's worker."""
    configs = {node: node_config(tmp_path, node, services["s3"]) for node in (*NODES, "launcher")}
    envs = {node: node_env(tmp_path, node, services, configs[node]) for node in configs}
    s3_client(services).create_bucket(Bucket=BUCKET)
    keys = build_corpus(tmp_path, envs["launcher"], services, NUM_PROMPTS, PARTITION_SIZE)
    assert len(keys) == NUM_PROMPTS // PARTITION_SIZE == 8
    with cluster_instance(envs["launcher"], services) as instance:
        ranges = backfill_tick(instance)
    assert ranges == [(keys[0], keys[3]), (keys[4], keys[7])]

    workers = [NodeWorker(node, envs[node], tmp_path / f"{node}.worker.log") for node in NODES]
    launches = []
    try:
        for worker in workers:
            worker.wait_ready()
        started = time.monotonic()
        for first, last in ranges:
            span = ["--partition-range", f"{first}...{last}"]
            launches.append((first, launch_completions(first, span, envs["launcher"], tmp_path)))
        for name, proc in launches:
            proc.wait(240)
            text = (tmp_path / f"launch-{name}.log").read_text(errors="replace")
            tails = "\n".join(w.tail() for w in workers)
            assert proc.returncode == 0, f"{name}: {text[-3000:]}\n--- workers:\n{tails}"
        wall = time.monotonic() - started
    finally:
        for _, proc in launches:
            kill_group(proc)
        for worker in workers:
            worker.stop()
    print(f"8 partitions as 2 range runs over {len(NODES)} workers: {wall:.1f} s")

    with cluster_instance(envs["launcher"], services) as instance:
        records = instance.get_run_records(dg.RunsFilter(tags={"dagster/asset_partition_range_start": keys}))
        assert len(records) == 2 and all(r.dagster_run.status == dg.DagsterRunStatus.SUCCESS for r in records)
        placed = {
            r.dagster_run.tags["dagster/asset_partition_range_start"]: worker_of_run(instance, r.dagster_run.run_id)
            for r in records
        }
    assert sorted(placed.values()) == sorted(NODES), placed  # one range on each node

    # independent of Dagster: each node's servers answered exactly the prompts of the range its worker ran
    for first, last in ranges:
        span = keys[keys.index(first) : keys.index(last) + 1]
        expected = Counter(f"prompt {i}" for pk in span for i in indices_of(pk))
        assert received(tmp_path, placed[first]) == expected, placed[first]

    client = s3_client(services)
    indices = []
    for pk in keys:
        body = client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/completions/{pk}.parquet")["Body"].read()
        frame = pl.read_parquet(body)
        assert frame["finish_reason"].is_in(["stop", "length"]).all()
        indices += frame["index"].to_list()
    assert sorted(indices) == list(range(NUM_PROMPTS))  # 0 lost, 0 duplicated

    env = {k: v for k, v in envs["launcher"].items() if k != CELERY_BROKER_ENV}
    out = subprocess.run(
        [sys.executable, "-m", "dflash_assets", "status"], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "note: could not load" not in out.stdout, out.stdout
    assert int(re.search(r"completions remaining: (\d+) prompts", out.stdout).group(1)) == 0, out.stdout
    assert f"{NUM_PROMPTS} / {NUM_PROMPTS} rows valid" in out.stdout, out.stdout
