"""Acceptance 7 of issue 15: after a cap change in the config (a copy of the bundled config, pointed at
by DFLASH_CONFIG), ``python -m dflash_assets status`` shows exactly the rows the change will regenerate,
and counts them as remaining.

Three completions partitions of 10 rows made at cap 10 (stop rows of 3..9 tokens, ``length`` rows at 10,
one error row), written as real tables with the real completions metadata (``completion_stats``); the
expected counts come from how the rows were built, not from the product's rules.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml

from dflash_assets.data.ranges import partition_keys
from dflash_assets.generation.rows.records import rows_to_frame
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.completions.tables import completion_stats, partition_file
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.storage.store import Storage

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "dflash_assets" / "configs" / "local_demo.yaml"
CAP = 10
KEYS = partition_keys(30, 10)
# per partition: (tokens, finish_reason) of its 10 rows; None tokens = error row
LAYOUT = {
    KEYS[0]: [
        (3, "stop"),
        (4, "stop"),
        (10, "length"),
        (9, "stop"),
        (8, "stop"),
        (5, "stop"),
        (10, "length"),
        (6, "stop"),
        (7, "stop"),
        (3, "stop"),
    ],
    KEYS[1]: [
        (3, "stop"),
        (4, "stop"),
        (5, "stop"),
        (6, "stop"),
        (3, "stop"),
        (4, "stop"),
        (5, "stop"),
        (6, "stop"),
        (7, "stop"),
        (None, None),
    ],
    KEYS[2]: [
        (10, "length"),
        (9, "stop"),
        (3, "stop"),
        (4, "stop"),
        (5, "stop"),
        (6, "stop"),
        (7, "stop"),
        (3, "stop"),
        (4, "stop"),
        (5, "stop"),
    ],
}


def config_copy(tmp: Path, cap: int, store_root: Path) -> Path:
    data = yaml.safe_load(BUNDLED.read_text())
    data["resources"]["generation"]["max_output_tokens"] = cap
    data["resources"]["storage"] = {"root": str(store_root)}
    # the rows here are made with the model's own template (no template in their fingerprint), as status judges
    data["resources"].get("target_model", {}).pop("chat_template", None)
    path = tmp / f"config_cap{cap}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def rows_for(pk: str, settings) -> list[dict]:
    first = int(pk.split("-")[0])
    rows = []
    for offset, (tokens, reason) in enumerate(LAYOUT[pk]):
        index = first + offset
        rows.append(
            {
                "index": index,
                "prompt_id": f"p{index}",
                "source": "test",
                "reasoning_content": None,
                "content": None if tokens is None else "answer",
                "finish_reason": reason,
                "prompt_tokens": 5,
                "completion_tokens": tokens,
                "output_token_ids": None,
                "truncated_in_reasoning": False,
                "empty_answer": False,
                "max_output_tokens": settings.max_output_tokens,
                "settings_fingerprint": settings.sampling_fingerprint(),
                "settings": "{}",
                "latency_s": 0.1,
                "server": "s0",
                "attempts": 1,
                "error": "HTTP 500" if tokens is None else None,
            }
        )
    return rows


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("status_cap")
    home, store_root = tmp / "home", tmp / "data"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    base_settings = GenerationResource(
        **yaml.safe_load(config_copy(tmp, CAP, store_root).read_text())["resources"]["generation"]
    ).settings()
    store = Storage(str(store_root))

    @dg.asset(name="completions", partitions_def=prompt_ranges)
    def completions_standin(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        frame = rows_to_frame(rows_for(context.partition_key, base_settings))
        store.write_parquet(frame, *partition_file(context.partition_key))
        return dg.MaterializeResult(
            metadata={**completion_stats(frame), "requested": 10, "wall_s": 2.0, "output_tok_per_s": 30.0}
        )

    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, KEYS)
        for pk in KEYS:
            assert dg.materialize([completions_standin], instance=instance, partition_key=pk).success
    return tmp, home, store_root


def status_output(tmp: Path, home: Path, store_root: Path, cap: int) -> str:
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "DFLASH_CONFIG": str(config_copy(tmp, cap, store_root)),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-m", "dflash_assets", "status"], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "note: could not load" not in out.stdout, out.stdout
    return out.stdout


def regenerate_line(text: str) -> tuple[int, int, dict[str, int]] | None:
    m = re.search(r"to regenerate under the current settings: (\d+) rows in (\d+) partitions \(([^)]*)\)", text)
    if not m:
        return None
    reasons = dict((k, int(v)) for k, v in (part.split(": ") for part in m.group(3).split(", ")))
    return int(m.group(1)), int(m.group(2)), reasons


def remaining(text: str) -> int:
    return int(re.search(r"completions remaining: (\d+) prompts", text).group(1))


def test_status_shows_the_rows_a_cap_raise_regenerates(project):
    tmp, home, store_root = project
    length_rows = sum(r == "length" for rows in LAYOUT.values() for _, r in rows)  # 3
    errors = sum(t is None for rows in LAYOUT.values() for t, _ in rows)  # 1
    same = status_output(tmp, home, store_root, CAP)
    assert regenerate_line(same) == (errors, 1, {"error": errors})  # only the error row, whatever the cap
    assert remaining(same) == errors and "29 / 30 rows valid under cap 10" in same

    raised = status_output(tmp, home, store_root, 14)
    touched = [pk for pk, rows in LAYOUT.items() if any(r == "length" or t is None for t, r in rows)]
    assert regenerate_line(raised) == (length_rows + errors, len(touched), {"cap raised": length_rows, "error": errors})
    assert remaining(raised) == length_rows + errors
    assert f"{30 - length_rows - errors} / 30 rows valid under cap 14" in raised


def test_status_shows_the_rows_a_cap_lowering_regenerates(project):
    tmp, home, store_root = project
    longer = sum(t is not None and t > 7 for rows in LAYOUT.values() for t, _ in rows)  # 8, 9, 10 tokens
    lowered = status_output(tmp, home, store_root, 7)
    assert regenerate_line(lowered) == (longer + 1, 3, {"cap lowered": longer, "error": 1})
    assert remaining(lowered) == longer + 1
    # a run cuts those rows to the lower cap from their own tokens: no request, nothing to generate
    assert f"up to {longer} of them cut to the lower cap from their own tokens, no request" in lowered


def test_status_counts_rows_to_be_continued_at_what_their_continuation_makes(project, tmp_path):
    """With servers that continue cut rows (SGLang, continue_truncated), a cap raise's rows count at
    E[min(L, new cap) - cap | L > cap] under the truncation report's length fit, not at a whole
    regeneration; the expected value here is a Monte Carlo of that log-normal, not the product's
    integral."""
    import numpy as np

    from dflash_assets.app.status import collect_status

    tmp, home, store_root = project
    store = Storage(str(store_root))
    raised = GenerationResource(
        **yaml.safe_load(config_copy(tmp, 14, store_root).read_text())["resources"]["generation"]
    ).settings()
    mu, sigma = 2.0, 0.6
    report = {"cap": CAP, "truncation_rate": 0.1, "advice": {"fit": {"family": "lognormal", "mu": mu, "sigma": sigma}}}
    length_rows = sum(r == "length" for rows in LAYOUT.values() for _, r in rows)  # 3
    ok_tokens = [t for rows in LAYOUT.values() for t, _ in rows if t is not None]
    mean_tokens = sum(ok_tokens) / 30  # the error row (whole regeneration) counts at the mean row
    lengths = np.random.default_rng(0).lognormal(mu, sigma, 4_000_000)
    per_row = float(np.mean(np.minimum(lengths[lengths > CAP], 14) - CAP))
    with dg.DagsterInstance.from_config(str(home)) as instance:
        whole = collect_status(instance, settings=raised, store=store, continues=True)["completions"]
        # no report yet: a continued row counts at its current length (no fit to go by)
        assert whole["regenerate"]["continued"] == length_rows
        assert whole["tokens_remaining_est"] == pytest.approx(mean_tokens + length_rows * CAP)
        store.write_json(report, "truncation_report", "report.json")
        try:
            cont = collect_status(instance, settings=raised, store=store, continues=True)["completions"]
            assert cont["regenerate"]["rows"] == length_rows + 1 and cont["regenerate"]["continued"] == length_rows
            assert cont["tokens_remaining_est"] == pytest.approx(mean_tokens + length_rows * per_row, rel=0.01)
            off = collect_status(instance, settings=raised, store=store, continues=False)["completions"]
            assert off["regenerate"]["continued"] == 0
        finally:
            (store_root / "truncation_report" / "report.json").unlink()
