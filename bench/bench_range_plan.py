"""How long a range run over many partitions takes to send its first request, and the memory it holds.

The user's run is one range of 903 partitions. Before its first request the ``completions`` asset
plans every partition: its prompts from the corpus, which stored rows the current settings still
accept, the text of the cut rows a cap raise continues. This bench builds a synthetic state of
``--partitions`` x ``--partition-size`` prompts (~``--prompt-bytes`` each) whose completions tables hold
rows made at cap 4,096 (~``--text-bytes`` of reasoning text each, ~18% cut, the user's lengths), raises
the cap to 8,192, and runs the real thing against one simulated SGLang server with no start-up time:

    dagster asset materialize --select completions --partition-range FIRST...LAST

It prints the time from launch to the server's first generation request and the CLI's peak resident
memory (VmHWM) up to then, once for the whole range and once for its first partition alone (the fixed
cost: Dagster start-up, server launch, tokenizer). Beside them, the plain way a competent engineer
plans the same work in a script (polars: the corpus read once, each table's validity columns, the cut
rows' text), timed and measured the same way in its own process.

``--code DIR`` runs the CLI from another checkout (e.g. a ``git worktree`` of an older commit), to
measure a change side by side on the same state.

    python bench/bench_range_plan.py [--partitions 100] [--partition-size 1000] [--code DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np
import polars as pl
from bench_node import Node
from headline import headline

from dflash_assets.data.ranges import partition_keys
from dflash_assets.data.shapes import CORPUS_SCHEMA
from dflash_assets.generation.rows.records import rows_to_frame
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.storage.store import Storage

OLD_CAP, NEW_CAP = 4096, 8192

BASELINE = r"""
import resource, sys, time
import polars as pl
corpus_path, tables, fingerprint, cap = sys.argv[1], sys.argv[2:-2], sys.argv[-2], int(sys.argv[-1])
t0 = time.perf_counter()
corpus = pl.read_parquet(corpus_path)  # once, whole: what every partition's prompts come from
todo, cut_text = 0, 0
for path in tables:
    state = pl.read_parquet(path, columns=["index", "error", "settings_fingerprint", "completion_tokens",
                                           "finish_reason", "max_output_tokens"])
    invalid = state.filter(pl.col("error").is_not_null() | (pl.col("settings_fingerprint") != fingerprint)
                           | (pl.col("completion_tokens") > cap)
                           | ((pl.col("finish_reason") == "length") & (pl.col("max_output_tokens") != cap)))
    todo += invalid.height
    cut = invalid.filter(pl.col("finish_reason") == "length")["index"]
    text = pl.read_parquet(path).filter(pl.col("index").is_in(cut.implode()))  # their text, to continue from
    cut_text += text.height
print(f"{time.perf_counter() - t0:.3f} {todo} {cut_text} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}")
"""


def words(rng: np.random.Generator, n_words: int) -> np.ndarray:
    return np.array(
        ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 10))) for _ in range(n_words)]
    )


def build_state(node: Node, args: argparse.Namespace) -> tuple[list[str], list[Path], str]:
    """Corpus (a row group per partition, as prompt_corpus writes it) and one completions table per
    partition at cap 4,096, valid under the node's sampling settings; the partitions registered."""
    rng = np.random.default_rng(0)
    vocab = words(rng, 5000)
    n = args.partitions * args.partition_size
    per_word = 6.5  # bytes per random word and its space
    store = Storage(str(node.data))
    prompt_words = max(1, int(args.prompt_bytes / per_word))
    corpus = pl.DataFrame(
        [
            {
                "index": i,
                "prompt_id": f"p{i}",
                "source": "bench",
                "content_hash": f"{i:032x}",
                "file": "bench.jsonl",
                "line": i,
                "messages": [{"role": "user", "content": " ".join(rng.choice(vocab, prompt_words))}],
            }
            for i in range(n)
        ],
        schema=CORPUS_SCHEMA,
    )
    store.write_parquet(corpus, "prompt_corpus", "corpus.parquet", row_group_size=args.partition_size)
    keys = partition_keys(n, args.partition_size)
    generation = json.loads(json.dumps(node_generation(node)))
    settings = GenerationResource(**{**generation, "max_output_tokens": OLD_CAP}).settings()
    lengths = np.minimum(np.exp(rng.normal(np.log(1970), 0.8, n)).astype(int) + 1, OLD_CAP)
    text_words = max(1, int(args.text_bytes / per_word))
    tables = []
    for k, pk in enumerate(keys):
        rows = []
        for i in range(k * args.partition_size, (k + 1) * args.partition_size):
            tokens = int(lengths[i])
            reasoning = " ".join(rng.choice(vocab, max(1, int(text_words * tokens / 2400))))
            cut = tokens == OLD_CAP
            rows.append(
                {
                    "index": i,
                    "prompt_id": f"p{i}",
                    "source": "bench",
                    "reasoning_content": reasoning,
                    "content": None if cut else "The answer.",
                    "finish_reason": "length" if cut else "stop",
                    "prompt_tokens": 300,
                    "completion_tokens": tokens,
                    "output_token_ids": None,
                    "truncated_in_reasoning": cut,
                    "empty_answer": cut,
                    "max_output_tokens": OLD_CAP,
                    "settings_fingerprint": settings.sampling_fingerprint(),
                    "settings": settings.settings_json,
                    "latency_s": tokens / 87.5,
                    "server": "bench",
                    "attempts": 1,
                    "error": None,
                    "continued_from_tokens": 0,
                }
            )
        tables.append(Path(store.write_parquet(rows_to_frame(rows), "completions", f"{pk}.parquet")))
    with node.instance() as instance:
        instance.add_dynamic_partitions("prompt_index_ranges", keys)
    fingerprint = GenerationResource(**{**generation, "max_output_tokens": NEW_CAP}).settings().sampling_fingerprint()
    return keys, tables, fingerprint


def node_generation(node: Node) -> dict:
    import yaml

    return yaml.safe_load(node.config.read_text())["resources"]["generation"]


def peak_rss_kb(pid: int) -> int:
    """Peak resident set (VmHWM, KiB) of ``pid`` and its live children (the run may fork)."""
    peak = 0
    try:
        pids = [pid] + [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]))
        except OSError:
            pass
    return peak


def time_to_first_request(node: Node, keys: list[str], code: Path, timeout: float = 1800) -> tuple[float, int, int]:
    """Seconds from launching the range CLI to the server's first generation request, the CLI's peak
    RSS (KiB) up to then, and how many requests the run was asked to send (from its run log)."""
    seen = len(node.events())
    env = {**node.env, "PYTHONPATH": str(code) + os.pathsep + node.env.get("PYTHONPATH", "")}
    log_path = node.dir / f"plan_{len(keys)}.log"
    started = time.monotonic()
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "dagster", *node.range_cli(keys)],
            env=env,
            cwd=code,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    peak = 0
    try:
        while time.monotonic() - started < timeout:
            peak = max(peak, peak_rss_kb(proc.pid))
            if len(node.events()) > seen:
                return time.monotonic() - started, peak, requested(log_path)
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended (rc {proc.returncode}) before a request: see {log_path}")
            time.sleep(0.05)
        raise RuntimeError(f"no request within {timeout} s: see {log_path}")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def requested(log_path: Path) -> int:
    """Requests the run's planning lines announce ('<pk>: N prompts, M to request ...')."""
    import re

    return sum(int(m.group(1)) for m in re.finditer(r": \d+ prompts, (\d+) to request", log_path.read_text()))


def baseline(corpus: Path, tables: list[Path], fingerprint: str) -> tuple[float, int, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", BASELINE, str(corpus), *map(str, tables), fingerprint, str(NEW_CAP)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return float(out[0]), int(out[1]), int(out[2]), int(out[3])


def plan_node_args(partitions: int) -> argparse.Namespace:
    """bench_node's arguments for a Node that only plans (one server, no start-up): every field its config
    writer reads, which follows bench_node's own command line."""
    return argparse.Namespace(
        servers=1,
        slots=40,
        startup_s=0.0,
        tok_per_s=87.5,
        speed=1.0,
        prefill_tok_per_s=9000.0,
        tail_prompts_per_slot=4.0,
        prompts=0,
        partitions=partitions,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--partitions", type=int, default=100)
    parser.add_argument("--partition-size", type=int, default=1000)
    parser.add_argument("--prompt-bytes", type=int, default=1700, help="mean prompt text per row")
    parser.add_argument("--text-bytes", type=int, default=6000, help="reasoning text of a 2,400-token row")
    parser.add_argument(
        "--code",
        type=Path,
        action="append",
        help="checkout whose pipeline runs (default: this one); repeat to run several on the same state",
    )
    parser.add_argument("--keep", action="store_true", help="keep the bench directory")
    args = parser.parse_args()
    node_args = plan_node_args(args.partitions)
    base = Path(tempfile.mkdtemp(prefix="bench_range_plan_"))
    node = Node(base, "plan", node_args, NEW_CAP)
    t0 = time.monotonic()
    keys, tables, fingerprint = build_state(node, args)
    corpus = node.data / "prompt_corpus" / "corpus.parquet"
    print(
        f"state: {len(keys)} partitions x {args.partition_size} prompts, corpus {corpus.stat().st_size / 1e6:.0f} MB, "
        f"tables {sum(t.stat().st_size for t in tables) / 1e6:.0f} MB (built in {time.monotonic() - t0:.0f} s)"
    )
    base_s, base_todo, base_cut, base_rss = baseline(corpus, tables, fingerprint)
    print(
        f"baseline_s (plain polars plan of the same state): {base_s:.1f}  peak_rss_mb: {base_rss / 1024:.0f}  "
        f"requests: {base_todo}  cut rows read: {base_cut}"
    )
    for code in args.code or [ROOT]:
        print(f"== code: {code} ==")
        one_s, one_rss, _ = time_to_first_request(node, keys[:1], code)
        all_s, all_rss, todo = time_to_first_request(node, keys, code)
        print(f"first_request_s, 1 partition: {one_s:.1f}  peak_rss_mb: {one_rss / 1024:.0f}")
        print(
            f"first_request_s, {len(keys)} partitions: {all_s:.1f}  peak_rss_mb: {all_rss / 1024:.0f}  "
            f"requests planned: {todo} (baseline {base_todo})"
        )
        print(
            f"planning_s ({len(keys)} partitions - 1): {all_s - one_s:.1f}  planning / baseline: "
            f"{(all_s - one_s) / base_s:.2f} (no goal)"
        )
        print(
            f"planning extrapolated to 903 partitions: {(all_s - one_s) / (len(keys) - 1) * 902:.0f} s "
            f"(goal < 180 s, one server start-up; linear only if a partition's cost does not grow with the corpus)"
        )
        at_903 = (all_s - one_s) / (len(keys) - 1) * 902
        headline(
            f"range run over {len(keys)} partitions (a cap raise on stored rows): seconds from launch to the "
            f"first request (peak RSS {all_rss / 1024:.0f} MB)",
            round(all_s, 1),
            "none (context: measured; the goal is on the figure at 903)",
        )
        headline(
            "planning of a range run extrapolated linearly to 903 partitions, seconds",
            round(at_903),
            "< 180 (one server start-up)",
            at_903 < 180,
        )
    if not args.keep:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"kept: {base}")


if __name__ == "__main__":
    main()
