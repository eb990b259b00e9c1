"""Simulated nodes on Dagster's Celery executor: efficiency of two node workers against one, in one run.

Each "node" is a Celery worker of ``dflash_assets.orchestration.cluster`` (``dflash_simulators.loopback_cluster``)
with its own config file: its own simulated SGLang servers (``dflash_simulators.sglang_stub``: start-up, slots,
per-slot decode rate, user-like lengths, time-compressed by ``--speed``) on its own ports. Everything else is real:
Redis (Debian's ``redis-server``, started here on a free port) as the broker, the definitions with
``DFLASH_CELERY_BROKER`` set, ``dagster asset materialize --partition-range`` per node-sized range (what the
backfill schedule requests on several nodes: one range per ``dflash_inference`` slot, launched together), the
completions asset, client and journal. All nodes share this one machine: a SQLite instance and a local storage root
stand in for PostgreSQL and S3 (test_cluster_celery.py checks those), and every node's client, worker and the
launchers compete for the same cores.

For W in (1, 2) workers, the same prompts from an empty instance: efficiency = generated tokens / (W x servers x
slots x tok/s per slot x (wall - one start-up)), in simulated seconds as ``bench_node`` counts them: wall = (real
wall - time the servers were up) + speed x that time, so the GPU side counts at its simulated size and everything
else (the launch, Dagster's hand-off through Celery, the client, writes) at its real size; real wall from the first
launch to the last run's end. The headline is efficiency(2) / efficiency(1): 1.0 means the second node adds its
whole capacity. What lowers it: time that does not shrink with a node's share of the work (the launch of a run,
the step's hand-off, the drain at the end of a range, where the last long requests hold a few slots), which weighs
twice as much against half the decoding; and, here only, two nodes' clients on shared cores. Baseline: one worker,
same prompts, same run. Also printed: the same efficiency on the real wall (overheads counted x speed).

    python bench/bench_cluster.py [--prompts 640] [--partitions 8] [--servers 1] [--slots 16] [--speed 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from bench_node import sim_wall
from headline import headline

from dflash_assets.generation.processes.ports import free_port_block
from dflash_assets.orchestration.cluster import CELERY_BROKER_ENV
from dflash_simulators.loopback_cluster import NodeWorker, kill_group, launch_completions, redis_missing, running_redis

BIN = Path(sys.executable).parent
STUB = "dflash_simulators.sglang_stub"
RATIO_GOAL = 0.9


def node_config(tmp: Path, node: str, data: Path, a: argparse.Namespace) -> Path:
    """The config file of one node: the shared storage root, its own simulated servers on their own ports (their
    starts in ``<node>.starts``, their requests in ``<node>.requests.jsonl``)."""
    sim = ["--sim-startup-s", str(a.startup_s), "--sim-median-tokens", str(a.median_tokens), "--sim-sigma"]
    sim += [str(a.sigma), "--sim-speed", str(a.speed), "--sim-decode-tok-per-s", str(a.tok_per_s)]
    sim += ["--sim-starts-file", str(tmp / f"{node}.starts"), "--sim-request-log", str(tmp / f"{node}.requests.jsonl")]
    config = {
        "resources": {
            "storage": {"root": str(data)},
            "inference": {
                "mode": "sglang",
                "max_running_requests": a.slots,
                "startup_timeout_s": a.startup_s / a.speed + 120.0,
                "sglang": {
                    "model_path": "simulated",
                    "num_servers": a.servers,
                    "port_base": free_port_block(a.servers),
                    "launch_module": STUB,
                    "extra_args": sim,
                },
                "client": {"backoff_base_s": 0.05},
            },
            "generation": {"max_output_tokens": 4096, "temperature": 0.6},
        }
    }
    path = tmp / f"{node}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def build_corpus(tmp: Path, env: dict[str, str], a: argparse.Namespace, workers: int) -> list[str]:
    """``prompt_corpus`` in-process (no broker), the pool ``dflash_inference`` set to ``workers`` slots (one per
    node's servers); returns the partition keys, sorted by first prompt."""
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"prompt {i}"}) + "\n" for i in range(a.prompts)))
    code = (
        "import dagster as dg, sys\n"
        "from dflash_assets.assets.prompts import prompt_corpus\n"
        "from dflash_assets.definitions import RESOURCES\n"
        "from dflash_assets.orchestration.partitions import prompt_ranges\n"
        "from dflash_assets.orchestration.pools import INFERENCE_POOL, ensure_pool_limits\n"
        "with dg.DagsterInstance.get() as instance:\n"
        "    ok = dg.materialize([prompt_corpus], instance=instance, resources={'storage': RESOURCES['storage']},\n"
        f"        run_config={{'ops': {{'prompt_corpus': {{'config': {{'sources': [{str(prompts)!r}],"
        f" 'partition_size': {a.prompts // a.partitions}}}}}}}}}).success\n"
        "    ensure_pool_limits(instance)\n"
        f"    instance.event_log_storage.set_concurrency_slots(INFERENCE_POOL, {workers})\n"
        "    print('KEYS ' + ','.join(instance.get_dynamic_partitions(prompt_ranges.name)))\n"
        "sys.exit(0 if ok else 1)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    keys = [line[5:] for line in out.stdout.splitlines() if line.startswith("KEYS ")]
    if out.returncode != 0 or not keys:
        raise RuntimeError(f"prompt_corpus failed: {out.stdout[-1000:]}{out.stderr[-2000:]}")
    return sorted(keys[-1].split(","), key=lambda pk: int(pk.split("-")[0]))


def phases(tmp: Path, nodes: list[str], launched: float) -> tuple[float, list[str]]:
    """Real seconds the nodes' servers were up (first start of any to last reply of any) and, per node, where its
    time went after the launch (wall clock): its servers' first start, first request, last reply (from the
    simulated servers' own logs).

    Raises:
        RuntimeError: a node's servers never started or answered nothing.
    """
    born, last, lines = [], [], []
    for node in nodes:
        starts, log = tmp / f"{node}.starts", tmp / f"{node}.requests.jsonl"
        if not starts.exists() or not log.exists():
            raise RuntimeError(f"{node}: no server started or no request answered; see {tmp}")
        born.append(min(float(line.split()[0]) for line in starts.read_text().splitlines()))
        events = [json.loads(line) for line in log.read_text().splitlines()]
        recv = [e["t"] for e in events if e["ev"] == "recv"]
        done = [e["t"] for e in events if e["ev"] == "done"]
        last.append(max(done))
        lines.append(
            f"{node}: servers started at {born[-1] - launched:.1f} s, first request {min(recv) - launched:.1f} s, "
            f"last reply {last[-1] - launched:.1f} s ({len(done)} replies)"
        )
    return max(last) - min(born), lines


def run_once(workers: int, a: argparse.Namespace, redis_url: str) -> dict:
    """A fresh instance, corpus and ``workers`` node workers; one range run per worker, launched together.

    Returns ``{"wall_s", "up_s", "tokens", "ranges", "rows"}``: real seconds from the first launch to the last
    run's end and of those the servers were up (first start to last reply), generated tokens and rows in the
    completions tables. Raises RuntimeError when a run fails (logs kept in tmp).
    """
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-cluster-{workers}-"))
    home, data = tmp / "home", tmp / "data"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    base = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "DAGSTER_DISABLE_TELEMETRY": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    base.pop(CELERY_BROKER_ENV, None)
    launcher = {**base, "DFLASH_CONFIG": str(node_config(tmp, "launcher", data, a))}
    keys = build_corpus(tmp, launcher, a, workers)
    share = -(-len(keys) // workers)
    ranges = [keys[i : i + share] for i in range(0, len(keys), share)]

    nodes, launches = [], []
    try:
        for w in range(workers):
            env = {**base, CELERY_BROKER_ENV: redis_url, "DFLASH_CONFIG": str(node_config(tmp, f"node-{w}", data, a))}
            env["DFLASH_SERVER_REGISTRY"] = str(tmp / f"registry-{w}")
            nodes.append(NodeWorker(f"node-{w}", env, tmp / f"node-{w}.log", cwd=tmp))
        for node in nodes:
            node.wait_ready(180)
        started, launched = time.monotonic(), time.time()
        env = {**launcher, CELERY_BROKER_ENV: redis_url}
        for span in ranges:
            launches.append(launch_completions(span[0], ["--partition-range", f"{span[0]}...{span[-1]}"], env, tmp))
        for proc in launches:
            if proc.wait(1800) != 0:
                tails = "\n".join(n.tail(1500) for n in nodes)
                raise RuntimeError(f"a range run failed; see {tmp}/launch-*.log\n{tails}")
        wall = time.monotonic() - started
    finally:
        for proc in launches:
            kill_group(proc)
        for node in nodes:
            node.stop()
    frames = [pl.read_parquet(data / "completions" / f"{pk}.parquet") for pk in keys]
    tokens = sum(int(f["completion_tokens"].sum()) for f in frames)
    rows = sum(f.height for f in frames)
    up, lines = phases(tmp, [f"node-{w}" for w in range(workers)], launched)
    for line in lines:
        print(f"  workers {workers}, {line}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return {"wall_s": wall, "up_s": up, "tokens": tokens, "ranges": len(ranges), "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=640)
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--servers", type=int, default=1, help="simulated servers per node")
    p.add_argument("--slots", type=int, default=16, help="max_running_requests per server")
    p.add_argument("--tok-per-s", type=float, default=87.5, help="simulated decode rate per slot")
    p.add_argument("--startup-s", type=float, default=180.0, help="simulated server start-up")
    p.add_argument("--median-tokens", type=int, default=600, help="median output length (lognormal)")
    p.add_argument("--sigma", type=float, default=0.6, help="sigma of the output lengths' lognormal")
    p.add_argument("--speed", type=float, default=10.0, help="GPU time compression")
    a = p.parse_args()
    if missing := redis_missing():
        sys.exit(missing)
    results = {}
    with running_redis() as url:
        for workers in (1, 2):
            r = run_once(workers, a, url)
            if r["rows"] != a.prompts:
                raise RuntimeError(f"{workers} worker(s): {r['rows']} rows for {a.prompts} prompts")
            capacity = workers * a.servers * a.slots * a.tok_per_s  # tokens per simulated second
            wall = sim_wall(r["wall_s"], r["up_s"], a.speed)
            r["efficiency"] = r["tokens"] / (capacity * (wall - a.startup_s))
            real = r["tokens"] / (capacity * a.speed * (r["wall_s"] - a.startup_s / a.speed))
            results[workers] = r
            print(
                f"workers {workers}: {r['ranges']} range run(s), {r['rows']} rows, {r['tokens']} tokens; "
                f"{r['wall_s']:.1f} s real, servers up {r['up_s']:.1f} s of it; simulated wall {wall:.0f} s "
                f"(start-up {a.startup_s:g} s, decoding at capacity {r['tokens'] / capacity:.0f} s); "
                f"efficiency {r['efficiency']:.3f} (on the real wall, overheads x{a.speed:g}: {real:.3f})",
                flush=True,
            )
    ratio = results[2]["efficiency"] / results[1]["efficiency"]
    print(f"speed-up: {results[1]['wall_s'] / results[2]['wall_s']:.2f}x wall; efficiency ratio {ratio:.3f}")
    headline(
        f"simulated node efficiency, 2 Celery workers / 1 ({a.prompts} prompts, {a.slots} slots x "
        f"{a.servers} server per node, speed {a.speed:g}; all nodes on this machine)",
        ratio,
        f">= {RATIO_GOAL}",
        ratio >= RATIO_GOAL,
    )
    return 0 if ratio >= RATIO_GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
