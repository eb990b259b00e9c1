"""truncation_report's peak memory on 100K completions rows with 6 KB of reasoning + answer text each
(100 partitions of 1,000 rows, ~600 MB of text): it reads only the columns it needs, so the peak
resident set of the process materializing it stays under 1 GB and grows by a fraction of the text
size; its numbers equal ones computed independently (plain Python over the values the rows were made from).

The report runs in a subprocess of its own (``python -m dflash_assets_tests.test_truncation_memory
ROOT CAP``) so that its peak RSS (VmHWM) is the report's alone.
"""

import json
import resource
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_assets.data.ranges import partition_keys

PARTITIONS, ROWS = 100, 1000
REASONING_CHARS, ANSWER_CHARS = 5000, 1000
CAP = 4096
ROOT_DIR = Path(__file__).resolve().parent.parent


def row_values(i: int) -> dict:
    """The report's inputs of global row ``i``: a rule, so the test can recompute them."""
    error = "timeout" if i % 97 == 0 else None
    length = error is None and i % 5 == 0
    return {
        "source": "code" if i % 2 else "chat",
        "finish_reason": None if error else ("length" if length else "stop"),
        "completion_tokens": None if error else (CAP if length else (i * 37) % CAP + 1),
        "error": error,
        "truncated_in_reasoning": bool(length and i % 10 == 0),
        "empty_answer": bool(error is None and i % 50 == 1),
    }


def write_partitions(root: Path) -> list[str]:
    """100 completions Parquet files of 1,000 rows, each row with 6 KB of incompressible-ish text."""
    rng = np.random.default_rng(0)
    keys = partition_keys(PARTITIONS * ROWS, ROWS)
    (root / "completions").mkdir(parents=True)
    for p, pk in enumerate(keys):
        values = [row_values(p * ROWS + r) for r in range(ROWS)]
        text = (
            rng.integers(33, 127, size=ROWS * (REASONING_CHARS + ANSWER_CHARS), dtype=np.uint8)
            .tobytes()
            .decode("ascii")
        )
        step = REASONING_CHARS + ANSWER_CHARS
        table = pa.table(
            {
                "index": pa.array(range(p * ROWS, (p + 1) * ROWS), pa.int64()),
                "prompt_id": [f"p{p * ROWS + r}" for r in range(ROWS)],
                "source": [v["source"] for v in values],
                "reasoning_content": [text[r * step : r * step + REASONING_CHARS] for r in range(ROWS)],
                "content": [text[r * step + REASONING_CHARS : (r + 1) * step] for r in range(ROWS)],
                "finish_reason": [v["finish_reason"] for v in values],
                "prompt_tokens": pa.array([20] * ROWS, pa.int64()),
                "completion_tokens": pa.array([v["completion_tokens"] for v in values], pa.int64()),
                "output_token_ids": pa.array([None] * ROWS, pa.list_(pa.int32())),
                "truncated_in_reasoning": [v["truncated_in_reasoning"] for v in values],
                "empty_answer": [v["empty_answer"] for v in values],
                "max_output_tokens": pa.array([CAP] * ROWS, pa.int64()),
                "error": pa.array([v["error"] for v in values], pa.string()),
            }
        )
        pq.write_table(table, root / "completions" / f"{pk}.parquet", compression="zstd")
    return keys


def expected_stats() -> dict:
    rows = [row_values(i) for i in range(PARTITIONS * ROWS)]
    ok = [r for r in rows if r["error"] is None]
    tokens = [r["completion_tokens"] for r in ok]
    per_source = {}
    for src in ("chat", "code"):
        mine = [r for r in ok if r["source"] == src]
        per_source[src] = sum(r["finish_reason"] == "length" for r in mine) / len(mine)
    return {
        "rows": len(rows),
        "errors": len(rows) - len(ok),
        "finish_reasons": dict(sorted(Counter(r["finish_reason"] for r in ok).items())),
        "truncation_rate": sum(r["finish_reason"] == "length" for r in ok) / len(ok),
        "truncated_in_reasoning": sum(r["truncated_in_reasoning"] for r in ok),
        "empty_answer": sum(r["empty_answer"] for r in ok),
        "per_source": per_source,
        "tokens_total": sum(tokens),
        "tokens_max": max(tokens),
    }


def test_report_peak_memory_on_100k_rows_of_6kb_text(tmp_path):
    root = tmp_path / "store"
    keys = write_partitions(root)
    text_bytes = PARTITIONS * ROWS * (REASONING_CHARS + ANSWER_CHARS)
    on_disk = sum(f.stat().st_size for f in (root / "completions").iterdir())
    out = subprocess.run(
        [sys.executable, "-m", "dflash_assets_tests.test_truncation_memory", str(root), str(CAP), ",".join(keys)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT_DIR,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"text {text_bytes / 1e6:.0f} MB, parquet {on_disk / 1e6:.0f} MB, peak RSS {measured['peak_rss_mb']:.0f} MB "
        f"(after imports {measured['rss_after_imports_mb']:.0f} MB)"
    )
    assert measured["peak_rss_mb"] < 1000
    # and the growth over the imports is a fraction of the text: reading every column peaked at 975 MB
    # here (766 MB over the imports; measured 2026-12-01, 2 cores), reading the report's columns at ~275 MB
    assert measured["peak_rss_mb"] - measured["rss_after_imports_mb"] < text_bytes / 4 / 1e6

    report = json.loads((root / "truncation_report" / "report.json").read_text())
    want = expected_stats()
    assert report["rows"] == want["rows"] and report["errors"] == want["errors"]
    assert report["finish_reasons"] == want["finish_reasons"]
    assert abs(report["truncation_rate"] - want["truncation_rate"]) < 1e-12
    assert (
        report["truncated_in_reasoning"] == want["truncated_in_reasoning"]
        and report["empty_answer"] == want["empty_answer"]
    )
    assert {k: v["rate"] for k, v in report["per_source"].items()} == want["per_source"]
    assert (
        report["completion_tokens"]["total"] == want["tokens_total"]
        and report["completion_tokens"]["max"] == want["tokens_max"]
    )
    assert report["partitions_included"] == keys and report["partitions_missing"] == []


def _peak_rss_mb() -> float:
    """This process's peak RSS (MB): VmHWM of /proc/self/status, which belongs to the address space made at
    exec. ``ru_maxrss`` is not used: Linux carries it over from the forking parent across exec, so in a full
    suite it reported the pytest process's 1.7 GB instead of the report's own peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: kilobytes on Linux, bytes on macOS


def _measure(root: str, cap: int, keys: list[str]) -> None:
    import dagster as dg

    from dflash_assets.assets.truncation import truncation_report
    from dflash_assets.orchestration.partitions import prompt_ranges
    from dflash_assets.stages.resources.generation import GenerationResource
    from dflash_assets.stages.resources.storage import StorageResource

    resources = {"storage": StorageResource(root=root), "generation": GenerationResource(max_output_tokens=cap)}
    with dg.instance_for_test() as warm:
        # one small report first, so that the baseline holds Dagster's own run machinery and the growth
        # below is what the data size costs
        warm.add_dynamic_partitions(prompt_ranges.name, keys[:1])
        assert dg.materialize([truncation_report], instance=warm, resources=resources).success
    after_imports = _peak_rss_mb()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, keys)
        result = dg.materialize([truncation_report], instance=instance, resources=resources)
        assert result.success
    peak = _peak_rss_mb()
    print(json.dumps({"peak_rss_mb": peak, "rss_after_imports_mb": after_imports}))


if __name__ == "__main__":
    _measure(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","))
