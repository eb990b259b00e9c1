"""The real pipeline on a simulated GPU node: servers started once per run, slots kept busy across partitions.

Only the GPU is simulated: N ``dflash_simulators.sglang_stub`` processes stand in for
``python -m sglang.launch_server`` (start-up time, slots, per-slot decode rate, user-like output
lengths, time-compressed by ``--speed``). Everything else is the real thing: ``sglang`` mode of the
inference resource launching them, the completions asset, client, journal, and Dagster itself through
``dagster asset materialize --select completions --partition-range FIRST...LAST``.

Scenarios (each prints ``name: value`` lines):

1. ``base``: fresh range at cap 4,096: server starts, efficiency = generated tokens / (capacity x
   (wall - one start-up)), each partition's materialization time against the run's end. Beside it,
   ``ideal_fifo_efficiency``: the same lengths through a perfect first-come scheduler with zero
   overhead (the bound any client that cannot know lengths in advance has: slots drain at the end).
   ``tail``: the same fresh range with ``inference.client.tail_chunk_tokens`` (``--tail-chunk-tokens``, 512) on:
   the last ``--tail-prompts-per-slot`` x slots prompts generated in chunks, each continued after every
   fresh prompt (:mod:`dflash_assets.generation.rows.tail_chunks`); besides efficiency: the follow-ups, the
   prefix tokens they re-send, how many of those the servers' prefix cache held and how many it charged
   as prefill (the stand-in's ``--sim-prefill-tok-per-s``, during which that server's decoding waits),
   and whether every row is what one request at 4,096 makes.
2. ``cap_bump``: cap 8,192, same range: requests vs rows that had finish_reason length; wall vs
   max(longest request, tokens / capacity) + one start-up. The cut rows are continued from their 4,096
   tokens (SGLang ``continue_final_message``); then, on a copy of the state before it, the same raise
   with ``continue_truncated: false`` (every cut row regenerated whole): wall, tokens and the
   first-come bound of each, and a check that every row equals what one request at 8,192 makes.
3. ``kill``: fresh range, kill -9 of the materialize process group mid-range, then the same command:
   time to start, every prompt once, finished rows not re-sent, re-sent <= in flight at the kill,
   no server left.
4. ``server_kill``: fresh range, kill -9 of one server mid-run: the run completes, rows once, restarts,
   the fault in metadata.

Time: the servers' start-up and decoding run ``--speed`` times faster than real; everything else (the
Dagster CLI, the client, journal and Parquet writes) runs at its real speed. So simulated wall =
(real wall - time the servers were up) + speed x (time the servers were up): overheads count at their
real size, GPU time at simulated size.

The efficiency scenarios (``base``, ``tail``, ``cap_bump``) run at ``--speed 1`` by default, the GPU side in
real time (each fresh range ~7 minutes): the client then handles requests, replies and follow-ups at the rate
the node sends them. Compressed (``--speed 10``), every millisecond the client spends between a reply and the
next request counts ten times over: on 2 cores at 2026-12-07 that read 0.767 (base) and 0.779 (tail) where real
time reads 0.804 and 0.896. The fault scenarios (``kill``, ``server_kill``) measure what is re-sent and
restarted, not efficiency, and run at ``--fault-speed`` (10).

    python bench/bench_node.py [--servers 7] [--slots 40] [--prompts 2000] [--partitions 10] [--speed 1]
                               [--fault-speed 10] [--scenarios base,tail,cap_bump,kill,server_kill]
                               [--tail-chunk-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import heapq

from headline import headline

from dflash_assets.generation.processes.ports import free_port_block
from dflash_simulators.simulated_replies import drawn_length
from dflash_simulators.thinking_tokenizer import write_thinking_tokenizer

DAGSTER = str(Path(sys.executable).with_name("dagster"))
EFFICIENCY_GOAL = 0.90


class Node:
    """One bench environment: DAGSTER_HOME, storage, config, prompts, simulator logs."""

    def __init__(
        self,
        base: Path,
        name: str,
        args: argparse.Namespace,
        cap: int,
        continue_truncated: bool = True,
        tail_chunk_tokens: int = 0,
    ) -> None:
        self.args, self.dir, self.continue_truncated = args, base / name, continue_truncated
        self.tail_chunk_tokens = tail_chunk_tokens
        # the simulated target's tokenizer (thinking markers, Qwen3 template): continuing cut rows needs it
        self.model_path = base / "simulated-qwen"
        if not (self.model_path / "tokenizer.json").exists():
            write_thinking_tokenizer(self.model_path, opens_think=False)
        self.home, self.data, self.logs = self.dir / "home", self.dir / "data", self.dir / "sim"
        for d in (self.home, self.data, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "dagster.yaml", self.home / "dagster.yaml")  # the project's instance settings
        self.prompts_file = self.dir / "prompts.jsonl"
        with open(self.prompts_file, "w") as f:
            for i in range(args.prompts):
                f.write(json.dumps({"id": f"p{i}", "prompt": f"bench prompt {i}"}) + "\n")
        self.starts_file, self.request_log = self.logs / "starts.txt", self.logs / "requests.jsonl"
        self.port_base = free_port_block(args.servers)
        self.set_cap(cap)
        self.env = {
            **os.environ,
            "DAGSTER_HOME": str(self.home),
            "DFLASH_CONFIG": str(self.config),
            # this checkout's package and simulators (bench/dflash_simulators) before any installed copy
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]),
        }

    @property
    def config(self) -> Path:
        return self.dir / "config.yaml"

    def set_cap(self, cap: int) -> None:
        a = self.args
        sim = [
            "--sim-startup-s",
            str(a.startup_s),
            "--sim-decode-tok-per-s",
            str(a.tok_per_s),
            "--sim-speed",
            str(a.speed),
            "--sim-prefill-tok-per-s",
            str(a.prefill_tok_per_s),
            "--sim-starts-file",
            str(self.starts_file),
            "--sim-request-log",
            str(self.request_log),
        ]
        config = {
            "resources": {
                "storage": {"root": str(self.data)},
                "inference": {
                    "mode": "sglang",
                    "max_running_requests": a.slots,
                    "startup_timeout_s": a.startup_s / a.speed + 120,
                    "sglang": {
                        "model_path": str(self.model_path),
                        "num_servers": a.servers,
                        "port_base": self.port_base,
                        "launch_module": "dflash_simulators.sglang_stub",
                        "extra_args": sim,
                    },
                    "client": {
                        "continue_truncated": self.continue_truncated,
                        "tail_chunk_tokens": self.tail_chunk_tokens,
                        "tail_prompts_per_slot": a.tail_prompts_per_slot,
                    },
                },
                "generation": {
                    "max_output_tokens": cap,
                    "temperature": 0.6,
                    "top_p": 0.95,
                    "top_k": 20,
                    "enable_thinking": True,
                },
            },
            "ops": {},
        }
        self.config.write_text(yaml.safe_dump(config))
        self.cap = cap

    def run(self, *cli: str, timeout: float = 1800) -> tuple[int, float]:
        started = time.time()
        proc = subprocess.run(
            [DAGSTER, *cli],
            env=self.env,
            cwd=self.dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        (self.dir / f"cli_{int(started)}.log").write_text(proc.stdout)
        return proc.returncode, time.time() - started

    def make_corpus(self) -> list[str]:
        config = {
            "ops": {
                "prompt_corpus": {
                    "config": {
                        "sources": [str(self.prompts_file)],
                        "partition_size": self.args.prompts // self.args.partitions,
                    }
                }
            }
        }
        rc, _ = self.run(
            "asset",
            "materialize",
            "-m",
            "dflash_assets.definitions",
            "--select",
            "prompt_corpus",
            "--config-json",
            json.dumps(config),
        )
        assert rc == 0, "prompt_corpus failed"
        return self.partition_keys()

    def partition_keys(self) -> list[str]:
        with self.instance() as instance:
            return sorted(instance.get_dynamic_partitions("prompt_index_ranges"))

    def range_cli(self, keys: list[str]) -> list[str]:
        return [
            "asset",
            "materialize",
            "-m",
            "dflash_assets.definitions",
            "--select",
            "completions",
            "--partition-range",
            f"{keys[0]}...{keys[-1]}",
        ]

    def instance(self):
        import dagster as dg

        os.environ["DAGSTER_HOME"] = str(self.home)
        return dg.DagsterInstance.get()

    def starts(self) -> list[float]:
        if not self.starts_file.exists():
            return []
        return [float(line.split()[0]) for line in self.starts_file.read_text().splitlines() if line.strip()]

    def events(self) -> list[dict]:
        if not self.request_log.exists():
            return []
        out = []
        for line in self.request_log.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line torn by kill -9
        return out

    def rows(self) -> dict[int, dict]:
        import polars as pl

        rows = {}
        for path in sorted((self.data / "completions").glob("*.parquet")):
            for row in pl.read_parquet(
                path, columns=["index", "finish_reason", "completion_tokens", "server"]
            ).iter_rows(named=True):
                assert row["index"] not in rows, f"row {row['index']} in two tables"
                rows[row["index"]] = row
        return rows

    def materializations(self, keys: list[str]) -> dict[str, tuple[float, dict]]:
        import dagster as dg

        out = {}
        with self.instance() as instance:
            for pk in keys:
                recs = instance.fetch_materializations(
                    dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=[pk]), limit=1
                ).records
                if recs:
                    meta = {k: getattr(v, "value", v) for k, v in recs[0].asset_materialization.metadata.items()}
                    out[pk] = (recs[0].timestamp, meta, recs[0].run_id)
        return out

    def run_end(self, run_id: str) -> float | None:
        with self.instance() as instance:
            record = instance.get_run_record_by_id(run_id)
            return record.end_time if record else None


def window(events: list[dict], since: float, until: float = float("inf")) -> list[dict]:
    return [e for e in events if since <= e["t"] <= until]


def sim_wall(wall_real: float, servers_up_real: float, speed: float) -> float:
    """Simulated wall: real overhead plus speed x the time servers were up (start-up + decoding)."""
    return (wall_real - servers_up_real) + speed * servers_up_real


def fifo_makespan(lengths: list[int], slots: int, tok_per_s: float) -> float:
    """Seconds a perfect first-come scheduler (no overhead) needs for ``lengths`` (tokens) in this order."""
    heap = [0.0] * slots
    for n in lengths:
        heapq.heappush(heap, heapq.heappop(heap) + n / tok_per_s)
    return max(heap)


def ideal_fifo(lengths: list[int], slots: int, tok_per_s: float) -> float:
    """Efficiency of a perfect first-come scheduler (no overhead) over ``lengths`` in this order."""
    return sum(lengths) / (slots * tok_per_s * fifo_makespan(lengths, slots, tok_per_s))


def wanted_lengths(prompts: int, cap: int) -> list[int]:
    """Output tokens of the bench's prompts at ``cap``: the lengths the simulated servers draw."""
    return [
        min(drawn_length([{"role": "user", "content": f"bench prompt {i}"}], 1970, 0.8), cap) for i in range(prompts)
    ]


def timed_run(node: Node, keys: list[str]) -> dict:
    before_starts, t0 = len(node.starts()), time.time()
    rc, wall = node.run(*node.range_cli(keys))
    events = window(node.events(), t0)
    starts = node.starts()[before_starts:]
    done = [e for e in events if e["ev"] == "done"]
    up = (max(e["t"] for e in done) - min(starts)) if done and starts else 0.0
    return {
        "rc": rc,
        "wall": wall,
        "t0": t0,
        "events": events,
        "starts": len(starts),
        "done": done,
        "servers_up_real": up,
        "tokens": sum(e["tokens"] for e in done),
    }


def scenario_base(base: Path, args, label: str = "base", tail_chunk_tokens: int = 0) -> Node:
    """A fresh range at cap 4,096; ``tail_chunk_tokens``: the run's end generated in chunks."""
    node = Node(base, label, args, cap=4096, tail_chunk_tokens=tail_chunk_tokens)
    keys = node.make_corpus()
    r = timed_run(node, keys)
    capacity = args.servers * args.slots
    wall_s = sim_wall(r["wall"], r["servers_up_real"], args.speed)
    gen_window = r["servers_up_real"] * args.speed - args.startup_s
    recv = [e for e in r["events"] if e["ev"] == "recv"]
    print(
        f"== {label}: fresh range, cap 4096"
        + (
            f", the last {round(args.tail_prompts_per_slot * capacity)} prompts in "
            f"chunks of {tail_chunk_tokens} tokens =="
            if tail_chunk_tokens
            else " =="
        )
    )
    print(f"{label}_exit_code: {r['rc']}")
    print(
        f"{label}_partitions: {len(keys)}  prompts: {args.prompts}  servers: {args.servers} x {args.slots} slots  "
        f"{args.tok_per_s} tok/s/slot  start-up {args.startup_s} s  speed x{args.speed}"
    )
    print(f"{label}_server_starts: {r['starts']} (goal {args.servers})")
    print(f"{label}_requests: {len(recv)}")
    if tail_chunk_tokens:
        follow_ups = [e for e in recv if e.get("continued_from")]
        print(
            f"{label}_chunk_follow_ups: {len(follow_ups)}  prefix_tokens_re_sent: "
            f"{sum(e['continued_from'] for e in follow_ups)} "
            f"({sum(e['continued_from'] for e in follow_ups) / max(1, r['tokens']):.2f} per generated token)"
        )
        prefills = [e for e in r["events"] if e["ev"] == "prefill" and e.get("continued_from")]
        charged = sum(e["prefill_tokens"] for e in prefills)
        print(
            f"{label}_follow_up_prefill_tokens: charged {charged}, from the prefix cache "
            f"{sum(e['cached_tokens'] for e in prefills)}  (charged = "
            f"{charged / (args.servers * args.prefill_tok_per_s):.1f} simulated s of every server's decode, at "
            f"{args.prefill_tok_per_s:g} tok/s)"
        )
        rows = node.rows()
        wanted = wanted_lengths(args.prompts, 4096)
        same = sum(
            rows[i]["completion_tokens"] == wanted[i] and (rows[i]["finish_reason"] == "length") == (wanted[i] == 4096)
            for i in range(args.prompts)
            if i in rows
        )
        print(f"{label}_rows_as_one_request_at_4096_makes: {same}/{args.prompts} (completion_tokens and finish_reason)")
    print(f"{label}_generated_tokens: {r['tokens']}")
    print(
        f"{label}_wall_real_s: {r['wall']:.1f}  dagster_and_client_overhead_real_s: "
        f"{r['wall'] - r['servers_up_real']:.1f}"
    )
    print(f"{label}_wall_simulated_s: {wall_s:.1f}")
    eff = r["tokens"] / (capacity * args.tok_per_s * (wall_s - args.startup_s))
    print(f"{label}_efficiency: {eff:.3f} (goal >= {EFFICIENCY_GOAL})")
    what = f"simulated node, {args.servers} x {args.slots} slots, {args.prompts} prompts, time x{args.speed:g}"
    headline(
        f"{what}: server starts of one range run ({label})",
        r["starts"],
        f"= {args.servers}",
        r["starts"] == args.servers,
    )
    headline(
        f"{what}: efficiency, fresh range"
        + (f", last prompts in {tail_chunk_tokens}-token chunks" if tail_chunk_tokens else ""),
        eff,
        f">= {EFFICIENCY_GOAL}",
        eff >= EFFICIENCY_GOAL,
    )
    print(
        f"{label}_efficiency_generation_window: {r['tokens'] / (capacity * args.tok_per_s * gen_window):.3f} "
        f"(servers ready -> last row, simulated)"
    )
    if not tail_chunk_tokens:
        lengths = wanted_lengths(args.prompts, 4096)
        bound = ideal_fifo(lengths, capacity, args.tok_per_s)
        print(
            f"ideal_fifo_efficiency: {bound:.3f} (same lengths, perfect first-come scheduler without chunks, zero "
            "overhead: the bound without knowing lengths in advance)"
        )
        print(f"{label} efficiency / first-come bound ratio: {eff / bound:.3f}")
        headline(
            f"{what}: perfect first-come scheduler's efficiency on the same lengths",
            bound,
            "none (context: the bound without chunks)",
        )
    mats = node.materializations(keys)
    run_ids = {m[2] for m in mats.values()}
    print(f"{label}_runs: {len(run_ids)}  partitions_materialized: {len(mats)}/{len(keys)}")
    end = node.run_end(next(iter(run_ids))) if len(run_ids) == 1 else None
    if end:
        rel = [(pk, (ts - end) * 1.0) for pk, (ts, _, _) in sorted(mats.items())]
        print(f"{label}_materialization_vs_run_end_real_s: " + ", ".join(f"{pk}:{d:+.1f}" for pk, d in rel))
        print(f"{label}_partitions_committed_before_run_end: {sum(d < -0.5 for _, d in rel)}/{len(rel)}")
    if tail_chunk_tokens:
        print(
            f"{label}_rows_chunked: {sum(m[1].get('tail_chunked', 0) for m in mats.values())}  "
            f"chunk_requests: {sum(m[1].get('tail_chunk_requests', 0) for m in mats.values())} (metadata)"
        )
    versions = {pk: m[1].get("settings") is not None for pk, m in mats.items()}
    assert all(versions.values())
    return node


def clone(node: Node, name: str, continue_truncated: bool) -> Node:
    """A second node in the same state (instance, tables, journals) as ``node``, nothing running."""
    twin = Node(node.dir.parent, name, node.args, node.cap, continue_truncated)
    for sub in ("home", "data"):
        shutil.rmtree(twin.dir / sub)
        shutil.copytree(node.dir / sub, twin.dir / sub)
    twin.port_base = free_port_block(node.args.servers)
    twin.set_cap(node.cap)
    return twin


def bump(node: Node, args, label: str) -> dict:
    """Raise ``node``'s cap to 8,192 over its range and print the figures under ``label``."""
    keys = node.partition_keys()
    before = node.rows()
    length_rows = sum(r["finish_reason"] == "length" for r in before.values())
    node.set_cap(8192)
    r = timed_run(node, keys)
    capacity = args.servers * args.slots
    requests = len([e for e in r["events"] if e["ev"] == "recv"])
    continued = sum(1 for e in r["events"] if e["ev"] == "recv" and e.get("continued_from"))
    longest = max((e["tokens"] for e in r["done"]), default=0) / args.tok_per_s
    ideal = max(longest, r["tokens"] / (capacity * args.tok_per_s)) + args.startup_s
    wall_s = sim_wall(r["wall"], r["servers_up_real"], args.speed)
    after = node.rows()
    wanted = wanted_lengths(args.prompts, 8192)
    same = sum(
        after[i]["completion_tokens"] == wanted[i] and (after[i]["finish_reason"] == "length") == (wanted[i] == 8192)
        for i in range(args.prompts)
        if i in after
    )
    print(f"{label}_exit_code: {r['rc']}")
    print(
        f"{label}_requests: {requests}  rows_that_had_length: {length_rows}  equal: {requests == length_rows}  "
        f"continued_from_their_4096_tokens: {continued}"
    )
    print(f"{label}_server_starts: {r['starts']} (goal {args.servers})")
    print(f"{label}_generated_tokens: {r['tokens']}")
    print(f"{label}_rows_as_one_request_at_8192_makes: {same}/{args.prompts} (completion_tokens and finish_reason)")
    print(f"{label}_rows_still_length_at_8192: {sum(x['finish_reason'] == 'length' for x in after.values())}")
    print(
        f"{label}_wall_simulated_s: {wall_s:.1f}  ideal (max(longest {longest:.1f}, tokens/capacity "
        f"{r['tokens'] / (capacity * args.tok_per_s):.1f}) + start-up {args.startup_s}): {ideal:.1f}"
    )
    return {"wall": wall_s, "ideal": ideal, "tokens": r["tokens"], "requests": requests}


def scenario_cap_bump(node: Node, args) -> None:
    capacity = args.servers * args.slots
    whole_node = clone(node, "cap_bump_whole", continue_truncated=False) if args.cap_bump_whole else None
    print("== cap_bump: cap 4096 -> 8192, same range, cut rows continued from their 4,096 tokens ==")
    cont = bump(node, args, "cap_bump")
    print(f"cap_bump_wall_over_ideal: {cont['wall'] / cont['ideal']:.3f} (goal <= 1.2)")
    headline(
        f"simulated node, time x{args.speed:g}: cap 4,096 -> 8,192 with cut rows continued, wall / ideal",
        cont["wall"] / cont["ideal"],
        "<= 1.2",
        cont["wall"] / cont["ideal"] <= 1.2,
    )
    rest = [n - 4096 for n in wanted_lengths(args.prompts, 8192) if n > 4096]
    whole = [n for n in wanted_lengths(args.prompts, 8192) if n > 4096]
    fifo_rest = (fifo_makespan(rest, capacity, args.tok_per_s) + args.startup_s) / cont["ideal"]
    print(
        f"cap_bump_fifo_bound_over_ideal: {fifo_rest:.3f} (perfect first-come scheduler, zero overhead, "
        f"{len(rest)} continuations on {capacity} slots)"
    )
    if whole_node is None:
        return
    print("== cap_bump_whole: the same raise on a copy of the state before it, continue_truncated: false ==")
    regen = bump(whole_node, args, "cap_bump_whole")
    fifo_whole = fifo_makespan(whole, capacity, args.tok_per_s) + args.startup_s
    print(
        f"cap_bump_whole_wall_over_its_ideal: {regen['wall'] / regen['ideal']:.3f}  "
        f"(its first-come bound {fifo_whole / regen['ideal']:.3f})"
    )
    print(
        f"cap_bump continued / whole: wall {cont['wall'] / regen['wall']:.3f}, generated tokens "
        f"{cont['tokens'] / max(1, regen['tokens']):.3f} (one after the other, from copies of the same state)"
    )
    headline(
        "simulated node: cap raise wall, cut rows continued / regenerated whole",
        cont["wall"] / regen["wall"],
        "none (context: what continuing saves)",
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _stub_pids(node: Node) -> list[int]:
    return (
        [int(line.split("pid=")[1].split()[0]) for line in node.starts_file.read_text().splitlines() if "pid=" in line]
        if node.starts_file.exists()
        else []
    )


def scenario_kill(base: Path, args) -> None:
    node = Node(base, "kill", args, cap=4096)
    keys = node.make_corpus()
    t0 = time.time()
    with open(node.dir / "killed_cli.log", "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [DAGSTER, *node.range_cli(keys)],
            env=node.env,
            cwd=node.dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    target = args.prompts // 2
    while proc.poll() is None and len([e for e in node.events() if e["ev"] == "done"]) < target:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    kill_t = time.time()
    proc.wait()
    time.sleep(2.0)
    events = window(node.events(), t0, kill_t)
    recv_before = Counter(e["key"] for e in events if e["ev"] == "recv")
    done_before = Counter(e["key"] for e in events if e["ev"] == "done")
    in_flight = sum(recv_before.values()) - sum(done_before.values())
    left = [p for p in _stub_pids(node) if _alive(p)]
    # rows durable at the kill: the tables written and the journals
    finished = set(node.rows())
    for journal in (node.data / "completions").glob("*.journal.jsonl"):
        for line in journal.read_text().splitlines():
            try:
                finished.add(json.loads(line)["index"])
            except (ValueError, KeyError):
                pass
    print("== kill: kill -9 of the materialize process group mid-range, then the same command ==")
    sent_not_durable = sum(1 for k in recv_before if int(k.rsplit(" ", 1)[1]) not in finished)
    print(
        f"kill_rows_durable_at_kill: {len(finished)}  requests_in_flight_at_kill: {sent_not_durable} sent and not "
        f"durable ({in_flight} still decoding on the servers, {sent_not_durable - in_flight} answered but not yet "
        "in the journal)"
    )
    print(f"kill_servers_left_running_after_kill: {len(left)}")
    starts_before = len(node.starts())
    t1 = time.time()
    with open(node.dir / "resume_cli.log", "w") as log:
        resume = subprocess.Popen(
            [DAGSTER, *node.range_cli(keys)],
            env=node.env,
            cwd=node.dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    first_start = None
    deadline = t1 + args.resume_wait_s
    while resume.poll() is None:
        if first_start is None and len(node.starts()) > starts_before:
            first_start = time.time() - t1
        if first_start is None and time.time() > deadline:
            break
        time.sleep(0.2)
    if resume.poll() is None and first_start is None:
        os.killpg(resume.pid, signal.SIGKILL)
        resume.wait()
        print(
            f"kill_resume_started: no server start within {args.resume_wait_s:.0f} s: blocked "
            f"(see {node.dir / 'resume_cli.log'}; pool slot of the killed run?)"
        )
        return
    resume.wait()
    if first_start is None and len(node.starts()) > starts_before:
        first_start = node.starts()[starts_before] - t1
    after = window(node.events(), t1)
    recv_after = Counter(e["key"] for e in after if e["ev"] == "recv")
    index_of = lambda key: int(key.rsplit(" ", 1)[1])  # noqa: E731
    resent_finished = [k for k in recv_after if index_of(k) in finished]
    resent = [k for k in recv_after if k in recv_before]
    rows = node.rows()
    print(f"kill_resume_exit_code: {resume.returncode}")
    print(
        f"kill_resume_first_server_start_s: {first_start:.1f} (goal < 60)"
        if first_start is not None
        else "kill_resume_first_server_start_s: none"
    )
    print(f"kill_rows: {len(rows)}/{args.prompts}  each_prompt_once: {sorted(rows) == list(range(args.prompts))}")
    print(f"kill_finished_rows_resent: {len(resent_finished)} (goal 0)")
    headline(
        "simulated node: kill -9 mid-range, same command again: seconds to its first server start",
        round(first_start, 1) if first_start is not None else "none",
        "< 60",
        first_start is not None and first_start < 60,
    )
    headline(
        "simulated node: kill -9 mid-range, same command again: finished rows sent again",
        len(resent_finished),
        "0",
        not resent_finished,
    )
    print(
        f"kill_requests_resent: {len(resent)}  <= in_flight_at_kill {sent_not_durable}: "
        f"{len(resent) <= sent_not_durable}"
    )
    print(f"kill_resume_duplicate_requests: {sum(v - 1 for v in recv_after.values() if v > 1)}")
    time.sleep(1.0)
    print(f"kill_servers_left_running_at_end: {len([p for p in _stub_pids(node) if _alive(p)])}")


def scenario_server_kill(base: Path, args) -> None:
    node = Node(base, "server_kill", args, cap=4096)
    keys = node.make_corpus()
    t0 = time.time()
    with open(node.dir / "cli.log", "w") as log:
        proc = subprocess.Popen(
            [DAGSTER, *node.range_cli(keys)],
            env=node.env,
            cwd=node.dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    while proc.poll() is None and len([e for e in node.events() if e["ev"] == "done"]) < args.prompts // 3:
        time.sleep(0.2)
    victim = _stub_pids(node)[0]
    os.kill(victim, signal.SIGKILL)
    proc.wait()
    events = window(node.events(), t0)
    recv = Counter(e["key"] for e in events if e["ev"] == "recv")
    rows = node.rows()
    mats = node.materializations(keys)
    faults = sorted({f for _, m, _ in mats.values() for f in (m.get("server_faults") or [])})
    print("== server_kill: kill -9 of one server mid-run ==")
    print(f"server_kill_exit_code: {proc.returncode}")
    print(
        f"server_kill_rows: {len(rows)}/{args.prompts}  each_prompt_once: {sorted(rows) == list(range(args.prompts))}"
    )
    print(f"server_kill_server_starts: {len(node.starts())} ({args.servers} + restarts)")
    print(f"server_kill_requests_resent: {sum(v - 1 for v in recv.values())}")
    print(f"server_kill_faults_in_metadata: {faults}")
    print(f"server_kill_servers_left_running: {len([p for p in _stub_pids(node) if _alive(p)])}")
    once = proc.returncode == 0 and sorted(rows) == list(range(args.prompts))
    headline(
        "simulated node: kill -9 of one server mid-run: run succeeds with every prompt's row once",
        "yes" if once else "no",
        "yes",
        once,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=7)
    parser.add_argument("--slots", type=int, default=40)
    parser.add_argument("--tok-per-s", type=float, default=87.5)
    parser.add_argument(
        "--prefill-tok-per-s",
        type=float,
        default=9000.0,
        help="prefill rate of one server (uncached prompt tokens; decoding waits meanwhile)",
    )
    parser.add_argument("--startup-s", type=float, default=180.0)
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--partitions", type=int, default=10)
    parser.add_argument(
        "--speed", type=float, default=1.0, help="simulated seconds per real second (base, tail, cap_bump)"
    )
    parser.add_argument(
        "--fault-speed", type=float, default=10.0, help="simulated seconds per real second (kill, server_kill)"
    )
    parser.add_argument("--resume-wait-s", type=float, default=90.0)
    parser.add_argument("--scenarios", default="base,tail,cap_bump,kill,server_kill")
    parser.add_argument(
        "--tail-chunk-tokens", type=int, default=512, help="scenario tail: inference.client.tail_chunk_tokens"
    )
    parser.add_argument(
        "--tail-prompts-per-slot", type=float, default=4.0, help="scenario tail: inference.client.tail_prompts_per_slot"
    )
    parser.add_argument("--keep", action="store_true", help="keep the bench directory")
    parser.add_argument(
        "--no-cap-bump-whole",
        dest="cap_bump_whole",
        action="store_false",
        help="skip the side-by-side cap raise that regenerates cut rows whole",
    )
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench_node_"))
    print(f"bench dir: {base}  (cpu cores: {os.cpu_count()})")
    chosen = args.scenarios.split(",")
    try:
        node = None
        if "base" in chosen or "cap_bump" in chosen:
            node = scenario_base(base, args)
        if "tail" in chosen:
            scenario_base(base, args, "tail", args.tail_chunk_tokens)
        if "cap_bump" in chosen and node is not None:
            scenario_cap_bump(node, args)
        faults = argparse.Namespace(**{**vars(args), "speed": args.fault_speed})
        if "kill" in chosen:
            scenario_kill(base, faults)
        if "server_kill" in chosen:
            scenario_server_kill(base, faults)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
