"""bench/run_all writes bench/RESULTS.md from the benches' HEADLINE lines: a row per figure with its goal,
the date, commit and machine; a failed bench is marked; ``--only`` keeps the other benches' rows; the file
is replaced atomically (no temp file left)."""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def fake_bench(folder: Path, name: str, body: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(body))


def run_all(benches: Path, results: Path, *only: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "bench" / "run_all"), "--benches", str(benches), "--results", str(results)]
    if only:
        cmd += ["--only", *only]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def table(results: Path) -> list[list[str]]:
    lines = [ln for ln in results.read_text().splitlines() if ln.startswith("| ") and not ln.startswith("| bench |")]
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines]


def test_rows_from_headline_lines_and_only_keeps_the_rest(tmp_path):
    benches, results = tmp_path / "benches", tmp_path / "RESULTS.md"
    benches.mkdir()
    fake_bench(
        benches,
        "bench_a",
        """
        print("free text the table ignores: ratio 0.5 (goal >= 9)")
        print('HEADLINE {"figure": "a / baseline", "value": 0.95, "goal": ">= 0.9", "met": true}')
        print('HEADLINE {"figure": "context", "value": 12, "goal": "none", "met": null}')
    """,
    )
    fake_bench(
        benches,
        "bench_b",
        """
        import sys
        print('HEADLINE {"figure": "b / baseline", "value": 0.5, "goal": ">= 0.9", "met": false}')
        sys.exit(3)
    """,
    )
    fake_bench(benches, "bench_c", "print('nothing machine-readable')\n")
    fake_bench(
        benches,
        "bench_d",
        """
        import sys
        print('HEADLINE {"figure": "d / baseline", "value": 0.8, "goal": ">= 0.9", "met": false}')
        sys.exit(1)  # the goal missed: said by the row itself, no extra exit row
    """,
    )
    proc = run_all(benches, results)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # bench_b failed
    rows = table(results)
    assert [r[:5] for r in rows] == [
        ["bench_a", "a / baseline", "0.95", ">= 0.9", "yes"],
        ["bench_a", "context", "12", "none", "-"],
        ["bench_b", "exit 3: see bench/results/bench_b.log", "-", "exit 0", "**no**"],
        ["bench_b", "b / baseline", "0.5", ">= 0.9", "**no**"],
        ["bench_c", "no HEADLINE printed: see bench/results/bench_c.log", "-", "-", "-"],
        ["bench_d", "d / baseline", "0.8", ">= 0.9", "**no**"],
    ]
    text = results.read_text()
    machine = rows[0][7].strip("`")
    assert f"- `{machine}`: " in text and "torch " in text and " cores, " in text
    assert all(len(r) == 8 and r[5].count("-") == 2 for r in rows)  # date YYYY-MM-DD
    assert list(tmp_path.glob("**/*.tmp")) == []

    fake_bench(
        benches,
        "bench_b",
        """
        print('HEADLINE {"figure": "b / baseline", "value": 0.93, "goal": ">= 0.9", "met": true}')
    """,
    )
    assert run_all(benches, results, "bench_b").returncode == 0
    rows_after = table(results)
    assert [r for r in rows_after if r[0] != "bench_b"] == [r for r in rows if r[0] != "bench_b"]
    assert [r[:5] for r in rows_after if r[0] == "bench_b"] == [["bench_b", "b / baseline", "0.93", ">= 0.9", "yes"]]


def test_every_bench_prints_a_headline():
    """Each bench script calls headline(), so run_all never has to scrape free text."""
    for script in sorted((ROOT / "bench").glob("bench_*.py")):
        assert "headline(" in script.read_text(), script.name


def test_stopping_run_all_stops_the_bench_it_runs(tmp_path):
    """A bench runs in a session of its own (so a server it leaves behind dies with it); SIGTERM to run_all
    must take that session down too, not leave the bench running on."""
    import os
    import signal
    import time

    benches = tmp_path / "benches"
    benches.mkdir()
    pid_file = tmp_path / "bench.pid"
    fake_bench(
        benches,
        "bench_slow",
        f"""
        import os, time
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(300)
    """,
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "bench" / "run_all"),
            "--benches",
            str(benches),
            "--results",
            str(tmp_path / "RESULTS.md"),
        ]
    )
    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    bench_pid = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    time.sleep(0.5)
    try:
        os.kill(bench_pid, 0)
        with open(f"/proc/{bench_pid}/stat") as stat:
            alive = stat.read().split(") ")[-1].split()[0] not in ("Z", "X")
    except (ProcessLookupError, FileNotFoundError):
        alive = False
    assert not alive


def test_range_plan_bench_builds_its_node(tmp_path):
    """bench_range_plan builds a bench_node Node from arguments of its own; when bench_node's config writer
    learned to read prefill_tok_per_s, the range-plan bench crashed at start (AttributeError)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_range_plan
        from bench_node import Node

        node = Node(tmp_path, "plan", bench_range_plan.plan_node_args(2), 8192)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert "inference" in node.config.read_text()


def test_drafter_seeds_bench_gives_the_assets_every_resource(tmp_path):
    """bench_drafter_seeds crashed at start once drafter_evaluation took the inference resource (engine mode):
    its resources must cover what both assets require."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_drafter_seeds
    finally:
        sys.path.remove(str(ROOT / "bench"))
    from dflash_assets.assets.drafter import dflash_drafter
    from dflash_assets.assets.evaluation import drafter_evaluation

    provided = set(bench_drafter_seeds.bench_resources(str(tmp_path), {}))
    required = (dflash_drafter.required_resource_keys | drafter_evaluation.required_resource_keys) - {"io_manager"}
    assert required <= provided  # io_manager: Dagster's default, provided by materialize


def test_drafter_vs_ngram_bench_reads_the_main_jobs_ngram_figure(tmp_path):
    """bench_drafter_vs_ngram takes n-gram lookup's held-out figure from the main job's report (vLLM is not
    started) and stops with a message naming the report when the job measured none (engine: none)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_drafter_vs_ngram
    finally:
        sys.path.remove(str(ROOT / "bench"))
    report = tmp_path / "drafter_evaluation" / "report.json"
    with pytest.raises(SystemExit, match=r"report\.json not found"):
        bench_drafter_vs_ngram.ngram_figure(tmp_path)
    report.parent.mkdir()
    report.write_text(json.dumps({"tokens_per_forward": {"heldout": {"drafter": 1.5, "ngram": None}}}))
    with pytest.raises(SystemExit, match="engine: vllm"):
        bench_drafter_vs_ngram.ngram_figure(tmp_path)
    ngram = {"tokens_per_forward": 417 / 240, "tokens_per_forward_stderr": 0.18, "target_forwards": 240}
    report.write_text(json.dumps({"tokens_per_forward": {"heldout": {"ngram": ngram}}}))
    assert bench_drafter_vs_ngram.ngram_figure(tmp_path)["tokens_per_forward"] == pytest.approx(1.7375)


def test_prefix_affinity_bench_counts_prefill_by_hand():
    """bench_prefix_affinity's paged prefix cache and its two routings on rows small enough to count by hand
    (pages of 4 tokens): a hit is whole pages of a prefix; a full cache evicts the oldest sequence; with two
    servers, round robin sends each conversation's second turn to the server without its first, affinity to the
    one with it."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_prefix_affinity as bench
    finally:
        sys.path.remove(str(ROOT / "bench"))
    cache = bench.PagedPrefixCache(capacity=1000, page_size=4)
    assert cache.prefill(list(range(10))) == 10
    assert cache.prefill([*range(10), 99]) == 3  # 2 whole pages (8 tokens) cached: 11 - 8
    assert cache.prefill([5, *range(1, 10)]) == 10  # same tokens later on: not a prefix, no hit
    small = bench.PagedPrefixCache(capacity=8, page_size=4)  # room for 2 pages
    small.prefill(list(range(8)))
    small.prefill(list(range(100, 108)))  # evicts the first sequence
    assert small.prefill(list(range(8))) == 8

    a1, b1 = list(range(1, 9)), list(range(101, 109))
    rows = [("A", a1), ("A", a1 + list(range(9, 17))), ("B", b1), ("B", b1 + list(range(109, 117)))]
    assert bench.prefilled(rows, 2, affinity=False, capacity=1000, page_size=4) == 8 + 16 + 8 + 16
    assert bench.prefilled(rows, 2, affinity=True, capacity=1000, page_size=4) == 8 + 8 + 8 + 8


def test_bench_args_reach_the_one_bench_named(tmp_path):
    """A bench of hours (the learning curve) runs a part of its grid: --bench-args go to the one bench in --only."""
    benches, results = tmp_path / "benches", tmp_path / "RESULTS.md"
    benches.mkdir()
    fake_bench(
        benches,
        "bench_a",
        """
        import json, sys
        print("HEADLINE " + json.dumps({"figure": "args " + " ".join(sys.argv[1:]), "value": 1, "goal": "-"}))
        """,
    )
    cmd = [sys.executable, str(ROOT / "bench" / "run_all"), "--benches", str(benches), "--results", str(results)]
    done = subprocess.run([*cmd, "--only", "bench_a", "--bench-args=--levers 'n 4' --sizes 1"], capture_output=True)
    assert done.returncode == 0, done.stderr
    assert table(results)[0][1] == "args --levers n 4 --sizes 1"
    refused = subprocess.run([*cmd, "--bench-args=--sizes 1"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--bench-args needs exactly one bench in --only" in refused.stderr


def test_runs_list_every_run_that_still_has_a_row_and_no_other(tmp_path):
    """Each row's run (its load average) stays under Runs however many runs came after it; a run whose rows were all
    measured again goes. (Seen: only the last ten runs were kept, and the H200 gpu_check rows lost their run.)"""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("run_all_module", str(ROOT / "bench" / "run_all"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)

    def line(minute: int, commit: str, benches: str) -> str:
        stamp = f"2026-12-0{1 + minute // 60} {minute % 60:02d}:00:00 UTC"
        return f"- run {stamp}, commit {commit}, machine `m-1`: {benches}; load"

    def row(bench: str, commit: str) -> dict:
        return {"bench": bench, "figure": "f", "value": 1, "goal": "-", "met": "-", "date": "d", "commit": commit,
                "machine": "m-1"}  # fmt: skip

    runs = [line(0, "c0", "bench_a, bench_b"), *(line(i, f"c{i}", "bench_b") for i in range(1, 12))]
    rows = [row("bench_a", "c0"), row("bench_b", "c11")]  # bench_b's eleven later runs each replaced its row
    results = tmp_path / "RESULTS.md"
    module.write_results(results, rows, {"m-1": "here"}, runs)
    assert module.read_results(results)[2] == [runs[0], runs[-1]]
    # runs at one commit: the latest of a bench claims its rows
    same = [line(0, "c", "bench_a"), line(1, "c", "bench_b"), line(2, "c", "bench_a")]
    assert module._runs_with_rows(same, [row("bench_a", "c"), row("bench_b", "c")]) == same[1:]
    # end to end: run_all's own lines, a second apart at least, the one of the bench run again replaced
    benches = tmp_path / "benches"
    benches.mkdir()
    for name in ("bench_a", "bench_b"):
        fake_bench(benches, name, 'print(\'HEADLINE {"figure": "x", "value": 1, "goal": "-", "met": null}\')')
    for name in ("bench_a", "bench_b", "bench_a"):
        time.sleep(1.1)
        assert run_all(benches, results, name).returncode == 0
    listed = [ln.split("`: ")[1].split(";")[0] for ln in results.read_text().splitlines() if ln.startswith("- run ")]
    assert listed == ["bench_b", "bench_a"]


def test_each_runs_cpu_steal_is_recorded_beside_its_load_average(tmp_path):
    """A load average that reads idle hid a hypervisor taking 40% of the CPUs (vmstat's ``st``) mid-session: every
    stage of the main job ran ~25% slower. The run line says how much CPU time each bench lost to steal, from
    /proc/stat's counters before and after it."""
    import importlib.machinery
    import importlib.util
    import re

    loader = importlib.machinery.SourceFileLoader("run_all_steal", str(ROOT / "bench" / "run_all"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    assert module.steal_share((10, 1000), (60, 1200)) == pytest.approx(0.25)  # 50 of 200 jiffies
    assert module.steal_share(None, (60, 1200)) is None and module.steal_share((1, 5), (1, 5)) is None
    fields = Path("/proc/stat").read_text().splitlines()[0].split()
    steal, total = module.cpu_steal_counters()
    assert fields[0] == "cpu" and steal == int(fields[8]) and steal <= total
    benches, results = tmp_path / "benches", tmp_path / "RESULTS.md"
    benches.mkdir()
    fake_bench(benches, "bench_a", 'print(\'HEADLINE {"figure": "x", "value": 1, "goal": "-", "met": null}\')')
    assert run_all(benches, results, "bench_a").returncode == 0
    (run_line,) = [ln for ln in results.read_text().splitlines() if ln.startswith("- run ")]
    assert re.search(r"; CPU steal \(time the hypervisor gave other guests\) bench_a \d+%$", run_line), run_line
