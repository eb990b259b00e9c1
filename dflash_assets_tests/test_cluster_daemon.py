"""Issue 41 on loopback, as a cluster runs unattended: the Dagster daemon ticks the backfill schedule on the shared
PostgreSQL instance and launches its runs; Dagster's Celery executor places their steps on two nodes' workers.

The services, node configs and corpus are :mod:`test_cluster_celery`'s (real PostgreSQL, Redis and ``moto_server``
S3; one config file per node with its own simulated SGLang server, scratch dir and server registry). The launching
node runs ``dagster-daemon run`` on the real definitions with ``DFLASH_CELERY_BROKER`` set, the schedule is turned
on with ``dagster schedule start`` and ticks every minute (``DFLASH_BACKFILL_CRON``). Nothing is launched by hand.

node-a's server has one slot decoding in real time, so it is caught mid-partition: once six of its prompts are done
it is killed (kill -9 of its worker and everything under it, its server included). Its run fails
(``DFLASH_CELERY_LOST_AFTER_S=6``); a later tick requests the unfinished partitions again and node-b, the only node
left, takes the range holding the half-done partition and resumes it from the journal on S3. node-a then comes back
(a replaced machine: its server on new ports) and takes what is queued, like node-b: the tick's other range, and
the tokenized and hidden-state runs the ticks request, one per partition, whose steps go to whichever worker is free.

Checked independently of Dagster's bookkeeping where it can be: each simulated server logs the prompts it received;
each stored row names the server that made it. Every row is stored once; no prompt whose row node-a finished was
sent again, every other one was sent once (to node-b or to node-a back); the partition node-a died in holds rows of
both nodes, node-b having been sent exactly those its journal did not hold. Every partition's tokenized rows and
hidden-state shards are stored. From the run history on PostgreSQL: every run came from the schedule (no run retry,
no hand launch) and only the lost one failed, the first tick's two ranges ran one on each node, the resuming run
came from a later tick and ran on node-b, no worker ran two steps at once and no pool held more steps than its
slots; ``status`` read from PostgreSQL agrees with the stored files.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import dagster as dg
import polars as pl
import yaml

from dflash_assets.app.automation import BACKFILL_CRON_ENV
from dflash_assets.orchestration.cluster import CELERY_BROKER_ENV, LOST_AFTER_ENV
from dflash_assets.orchestration.pools import GPU_POOL
from dflash_simulators.loopback_cluster import NodeWorker, start_daemon, start_schedule, stop_tree

try:
    from dflash_assets_tests.test_cluster_celery import (
        BUCKET,
        NODES,
        SIM,
        build_corpus,
        cluster_instance,
        indices_of,
        node_config,
        node_env,
        s3_client,
        services,  # the module fixture: PostgreSQL, Redis, moto S3
    )
except ImportError:  # run from inside the tests folder
    from test_cluster_celery import (  # type: ignore[no-redef]
        BUCKET,
        NODES,
        SIM,
        build_corpus,
        cluster_instance,
        indices_of,
        node_config,
        node_env,
        s3_client,
        services,  # noqa: F401
    )

SCHEDULE = "backfill_unfinished_partitions"
PREFIX = "daemon"
PARTITION_SIZE, NUM_PROMPTS = 4, 32  # 8 partitions
STAGES = ("completions", "tokenized_sequences", "hidden_states")
# node-a: one slot decoding in real time (~1.4 s a prompt), so the kill finds it mid-partition
SLOW = ["--sim-startup-s", "2", "--sim-median-tokens", "120", "--sim-sigma", "0.3", "--sim-speed", "1"]
# node-b: 5 s of real start-up, so node-b cannot finish its range before the tick's other range is handed out
FAST = ["--sim-startup-s", "250", *SIM[2:]]
# the later stages read the target model: the Qwen3.6-architecture stand-in, whose tokenizer has the <think> tokens
# of the simulated server's replies (SmolLM2's has none: every row would be set aside)
TARGET = {"local_model": "qwen3.6-hybrid-standin"}
KILL_AFTER_DONE = 6  # node-a's prompts done when it is killed: its second partition holds 1-2 of them
STEP_WORKER = "in celery worker"
IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]


def wait_for(predicate, timeout_s: float, what: str, logs) -> object:
    """Poll ``predicate`` every 0.5 s until it returns something truthy (returned); on timeout fail with ``logs()``."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s\n{logs()}"
        time.sleep(0.5)
    return value


def requests_log(folder: Path) -> list[dict]:
    """The corpus prompts' events in a simulated server's request log (health probes excluded)."""
    path = folder / "sim" / "requests.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["key"].startswith("prompt")]


def server_port(config: Path) -> int:
    return yaml.safe_load(config.read_text())["resources"]["inference"]["sglang"]["port_base"]


def step_workers(instance: dg.DagsterInstance, run_id: str) -> dict[str, str]:
    """``{step_key: node}``: the Celery worker each step of the run ran in (the event it logged there)."""
    placed = {}
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
        event = entry.dagster_event
        if event and STEP_WORKER in (event.message or ""):
            meta = event.event_specific_data.metadata["Celery worker"]
            placed[event.step_key] = str(getattr(meta, "value", meta)).split("@")[0]
    return placed


def step_intervals(instance: dg.DagsterInstance, record) -> dict[str, tuple[float, float]]:
    """``{step_key: (start, end)}`` (epoch s) of a finished run's steps; a step that never logged its end (its worker
    was killed) ends with the run."""
    starts, ends = {}, {}
    for entry in instance.all_logs(record.dagster_run.run_id):
        kind = entry.dagster_event.event_type if entry.dagster_event else None
        if kind == dg.DagsterEventType.STEP_START:
            starts[entry.step_key] = entry.timestamp
        elif kind in (dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE):
            ends[entry.step_key] = entry.timestamp
    return {key: (start, ends.get(key, record.end_time)) for key, start in starts.items()}


def range_of(record) -> tuple[str, str]:
    """The first and last partition of a range run."""
    tags = record.dagster_run.tags
    return tags["dagster/asset_partition_range_start"], tags["dagster/asset_partition_range_end"]


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The largest number of ``intervals`` open at one instant."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])  # an end before a start
    most = current = 0
    for _, step in edges:
        current += step
        most = max(most, current)
    return most


def test_the_daemon_backfills_over_two_nodes_and_a_lost_node_resumes_elsewhere(services, tmp_path):
    started = time.monotonic()
    s3 = services["s3"]
    configs = {
        "node-a": node_config(tmp_path, "node-a", s3, SLOW, slots=1, prefix=PREFIX, target_model=TARGET),
        "node-b": node_config(tmp_path, "node-b", s3, FAST, prefix=PREFIX, target_model=TARGET),
        "launcher": node_config(tmp_path, "launcher", s3, prefix=PREFIX, target_model=TARGET),
    }
    envs = {node: node_env(tmp_path, node, services, configs[node]) for node in configs}
    envs["launcher"].update({BACKFILL_CRON_ENV: "* * * * *", LOST_AFTER_ENV: "6"})
    # on 2 cores shared with other work, the daemon's code server took over Dagster's default 60 s to start a run
    # (each run process imports the definitions, torch included): that launch failed and was retried
    envs["launcher"]["DAGSTER_GRPC_TIMEOUT_SECONDS"] = "300"
    s3_client(services).create_bucket(Bucket=BUCKET)
    keys = build_corpus(tmp_path, envs["launcher"], services, NUM_PROMPTS, PARTITION_SIZE)
    assert len(keys) == 8
    with cluster_instance(envs["launcher"], services) as instance:
        instance.event_log_storage.set_concurrency_slots(GPU_POOL, len(NODES))  # one per node's GPUs

    workers = {node: NodeWorker(node, envs[node], tmp_path / f"{node}.worker.log") for node in NODES}
    daemon = None

    def logs() -> str:
        daemon_log = (tmp_path / "daemon.log").read_text(errors="replace")[-4000:]
        return "--- daemon:\n" + daemon_log + "".join(f"\n--- {w.log.name}:\n{w.tail()}" for w in workers.values())

    try:
        for worker in workers.values():
            worker.wait_ready()
        daemon = start_daemon(envs["launcher"], tmp_path)
        start_schedule(SCHEDULE, envs["launcher"], tmp_path)
        on_at = time.time()

        def node_a_done() -> list[int]:
            done = [int(e["key"].split()[1]) for e in requests_log(tmp_path / "node-a") if e["ev"] == "done"]
            return done if len(done) >= KILL_AFTER_DONE else []

        a_done = set(wait_for(node_a_done, 300, f"{KILL_AFTER_DONE} prompts done on node-a", logs))
        workers["node-a"].kill()
        killed_at = time.time()
        # the partition node-a was in: the first of its range it had not finished (one slot: prompts in order)
        first = min(int(e["key"].split()[1]) for e in requests_log(tmp_path / "node-a"))
        in_range = [pk for pk in keys if indices_of(pk)[-1] >= first][: len(keys) // 2]
        half = next(pk for pk in in_range if not set(indices_of(pk)) <= a_done)

        with cluster_instance(envs["launcher"], services) as instance:

            def failed_run():
                return instance.get_run_records(dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE]))

            (lost,) = wait_for(failed_run, 120, "failed run after the kill", logs)
            detected_s = lost.end_time - killed_at

            def resumed_on_b() -> bool:
                sent = {e["key"] for e in requests_log(tmp_path / "node-b") if e["ev"] == "recv"}
                return bool(sent & {f"prompt {i}" for i in indices_of(half)})

            wait_for(resumed_on_b, 600, f"a request of {half} on node-b", logs)
            # node-a back, a replaced machine (its server on new ports, its own request log): the rest spreads
            configs["node-a-back"] = node_config(tmp_path, "node-a-back", s3, FAST, prefix=PREFIX, target_model=TARGET)
            envs["node-a-back"] = node_env(tmp_path, "node-a-back", services, configs["node-a-back"])
            workers["node-a"] = NodeWorker("node-a", envs["node-a-back"], tmp_path / "node-a-back.worker.log")
            workers["node-a"].wait_ready()

            def done() -> bool:
                return all(set(keys) <= instance.get_materialized_partitions(dg.AssetKey(s)) for s in STAGES)

            wait_for(done, 900, "every stage of every partition", logs)
            # a run's last step is stored before the run process records its end: stopping the daemon in between
            # killed that run process, leaving a run that had done its work STARTED for good (CI, stop 53)
            in_flight = dg.RunsFilter(statuses=IN_FLIGHT)
            wait_for(lambda: not instance.get_run_records(in_flight), 120, "every run to record its end", logs)
            wall = time.monotonic() - started
    finally:
        stop_tree(daemon)
        for worker in workers.values():
            worker.stop()

    with cluster_instance(envs["launcher"], services) as instance:
        records = instance.get_run_records(dg.RunsFilter(job_name="partition_stages"))
        records.sort(key=lambda r: r.create_timestamp)
        runs = {r.dagster_run.run_id: r for r in records}
        placed = {run_id: step_workers(instance, run_id) for run_id in runs}
        intervals = {run_id: step_intervals(instance, r) for run_id, r in runs.items()}
        lost_log = "\n".join(
            f"{e.dagster_event.message} {getattr(e.dagster_event.event_specific_data, 'error', None)}"
            for e in instance.all_logs(lost.dagster_run.run_id)
            if e.dagster_event
        )
    summary = {
        r.dagster_run.run_id[:8]: (r.dagster_run.status.value, r.dagster_run.tags.get("dagster/partition"), placed[i])
        for i, r in runs.items()
    }
    print(
        f"{len(runs)} runs; killed at +{killed_at - on_at:.0f} s after the schedule was turned on, run failed "
        f"{detected_s:.1f} s later; every stage done at {wall:.0f} s: {summary}"
    )

    # every run came from the schedule's ticks, none launched by hand; no range run is a run retry (the schedule
    # requests a failed range's partitions again); the only other failures allowed are launches that never reached
    # a worker (a loaded machine), each retried by Dagster's run retry with success
    assert all(r.dagster_run.tags.get("dagster/schedule_name") == SCHEDULE for r in records), summary
    ranges = [r for r in records if "dagster/asset_partition_range_start" in r.dagster_run.tags]
    assert not [r for r in ranges if "dagster/parent_run_id" in r.dagster_run.tags], summary
    lost_id = lost.dagster_run.run_id
    (lost,) = [r for r in records if r.dagster_run.run_id == lost_id]  # as the history holds it now
    retried = {r.dagster_run.tags.get("dagster/parent_run_id"): r for r in records}
    for record in records:
        run_id = record.dagster_run.run_id
        if record.dagster_run.status != dg.DagsterRunStatus.SUCCESS and run_id != lost_id:
            assert record not in ranges and not placed[run_id], summary
            retry = retried.get(run_id)
            assert retry is not None and retry.dagster_run.status == dg.DagsterRunStatus.SUCCESS, summary
    records = [r for r in records if r is lost or r.dagster_run.status == dg.DagsterRunStatus.SUCCESS]
    ranges = [r for r in ranges if r in records]
    first_tick = [r for r in ranges if r.dagster_run.tags["dagster/tick"] == ranges[0].dagster_run.tags["dagster/tick"]]
    assert {range_of(r) for r in first_tick} == {
        (keys[0], keys[3]),
        (keys[4], keys[7]),
    }  # one range per dflash_inference slot
    assert sorted(placed[r.dagster_run.run_id]["completions"] for r in first_tick) == sorted(NODES)  # one per node
    assert lost in first_tick and placed[lost.dagster_run.run_id] == {"completions": "node-a"}
    assert "stopped answering" in lost_log, lost_log[-3000:]
    assert detected_s < 30, detected_s  # three missed pings at 2 s, then the run's end

    # the stored rows: every prompt once; which node made each (its server's port in the row)
    ports = {node: server_port(configs[node]) for node in ("node-a", "node-b", "node-a-back")}
    assert len(set(ports.values())) == 3, ports  # random blocks (1 in ~12,000 would meet)
    client = s3_client(services)
    maker = {}
    for pk in keys:
        body = client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/completions/{pk}.parquet")["Body"].read()
        for row in pl.read_parquet(body).iter_rows(named=True):
            (node,) = [n for n, port in ports.items() if row["server"] == f"http://127.0.0.1:{port}/v1"]
            assert row["index"] not in maker, row["index"]  # 0 duplicated
            maker[row["index"]] = node
    assert sorted(maker) == list(range(NUM_PROMPTS))  # 0 lost
    kept = {f"prompt {i}" for i, node in maker.items() if node == "node-a"}
    everything = {f"prompt {i}" for i in range(NUM_PROMPTS)}
    received = {node: Counter(e["key"] for e in requests_log(tmp_path / node) if e["ev"] == "recv") for node in ports}
    # what node-a finished was never sent again; the rest was sent once, to node-b or to node-a back
    assert received["node-b"] + received["node-a-back"] == Counter(everything - kept)
    assert kept <= {e["key"] for e in requests_log(tmp_path / "node-a") if e["ev"] == "done"}
    # the partition node-a was in holds rows of both: node-b was sent exactly those the journal did not hold
    assert {maker[i] for i in indices_of(half)} == {"node-a", "node-b"}, {i: maker[i] for i in indices_of(half)}
    half_prompts = {f"prompt {i}" for i in indices_of(half)}
    assert Counter({k: n for k, n in received["node-b"].items() if k in half_prompts}) == Counter(half_prompts - kept)
    # ... by a run of a later tick, on node-b
    (resumed,) = [
        r for r in ranges if range_of(r)[0] <= half <= range_of(r)[1] and r.create_timestamp.timestamp() > lost.end_time
    ]
    assert resumed.dagster_run.status == dg.DagsterRunStatus.SUCCESS
    assert placed[resumed.dagster_run.run_id] == {"completions": "node-b"}
    assert resumed.dagster_run.tags["dagster/tick"] != lost.dagster_run.tags["dagster/tick"]

    # the later stages: one run per partition, every step in a node's worker
    later = [r for r in records if r not in ranges]
    assert sorted(r.dagster_run.tags["dagster/partition"] for r in later) == keys
    for record in later:
        assert set(placed[record.dagster_run.run_id]) == {"tokenized_sequences", "hidden_states"}
        assert set(placed[record.dagster_run.run_id].values()) <= set(NODES)
        assert record.dagster_run.status == dg.DagsterRunStatus.SUCCESS

    # pools and nodes: no worker ran two steps at once, no pool held more steps than its slots
    by_node: dict[str, list] = {}
    by_step: dict[str, list] = {}
    for run_id, steps in intervals.items():
        for step, span_s in steps.items():
            by_node.setdefault(placed[run_id][step], []).append(span_s)
            by_step.setdefault(step, []).append(span_s)
    assert all(most_at_once(spans) == 1 for spans in by_node.values()), by_node
    assert most_at_once(by_step["completions"]) <= len(NODES) and most_at_once(by_step["hidden_states"]) <= len(NODES)
    later_nodes = Counter(node for r in later for node in placed[r.dagster_run.run_id].values())
    print(f"later-stage steps per node: {dict(later_nodes)}")

    # status, read from PostgreSQL, agrees with the stored files
    for pk in keys:  # every partition's tokenized rows (kept or set aside) and its hidden-state shards are stored
        tokenized = [
            f"{PREFIX}/tokenized_sequences/{pk}.parquet",
            f"{PREFIX}/tokenized_sequences/{pk}.set_aside.parquet",
        ]
        frames = [pl.read_parquet(client.get_object(Bucket=BUCKET, Key=key)["Body"].read()) for key in tokenized]
        stored = [i for frame in frames if frame.height for i in frame["index"].to_list()]
        assert sorted(stored) == list(indices_of(pk)), pk
        index = json.loads(
            client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/hidden_states/{pk}/index.json")["Body"].read()
        )
        for shard in index["shards"]:
            head = client.head_object(Bucket=BUCKET, Key=f"{PREFIX}/hidden_states/{pk}/{shard['name']}")
            assert head["ContentLength"] == shard["bytes"], (pk, shard)
    env = {k: v for k, v in envs["launcher"].items() if k != CELERY_BROKER_ENV}
    out = subprocess.run(
        [sys.executable, "-m", "dflash_assets", "status"], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "note: could not load" not in out.stdout, out.stdout
    for stage in STAGES:
        assert re.search(rf"^{stage}\s+8\s+0\s+0\s+0$", out.stdout, re.MULTILINE), out.stdout
    assert int(re.search(r"completions remaining: (\d+) prompts", out.stdout).group(1)) == 0, out.stdout
    assert f"{NUM_PROMPTS} / {NUM_PROMPTS} rows valid" in out.stdout, out.stdout
