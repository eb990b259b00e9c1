"""The main job's terminal output (issue 16: 176 of 357 printed lines were Dagster DEBUG events).

A real in-process run through the main job's own ``_materialize`` (the prompt_corpus stage on a small
file) in a fresh process: by default no DEBUG line reaches the terminal, the asset's INFO progress line
does, and the DEBUG events are still in the run storage; ``verbose`` prints them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
from dflash_assets.app import main_job as pipeline
pipeline.CONSOLE_LOG_LEVEL["level"] = sys.argv[2]
cfg = {"ops": {"prompt_corpus": {"config": {"sources": [sys.argv[1]], "partition_size": 2}}}}
result = pipeline._materialize(["prompt_corpus"], cfg)
print("RUN_ID", result.run_id, result.success)
"""


def run_corpus(tmp_path: Path, level: str) -> tuple[str, str, str]:
    home = tmp_path / f"home-{level}"
    home.mkdir()
    src = tmp_path / "p.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(3)) + "\n")
    env = {**os.environ, "DAGSTER_HOME": str(home), "DFLASH_STORAGE_ROOT": str(tmp_path / f"data-{level}")}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(src), level], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    run_id = next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("RUN_ID"))
    return out, str(home), run_id


def test_main_job_prints_no_debug_events_but_stores_them(tmp_path, monkeypatch):
    out, home, run_id = run_corpus(tmp_path, "INFO")
    assert " - DEBUG - " not in out
    assert "STEP_START" not in out
    assert "3 prompts from 1 files" in out  # the asset's own INFO line
    monkeypatch.setenv("DAGSTER_HOME", home)
    with dg.DagsterInstance.get() as instance:
        events = instance.all_logs(run_id)
    types = {e.dagster_event.event_type_value for e in events if e.dagster_event}
    assert {"STEP_START", "ASSET_MATERIALIZATION", "STEP_SUCCESS"} <= types  # DEBUG events kept in run storage


def test_verbose_prints_the_debug_events(tmp_path):
    out, _, _ = run_corpus(tmp_path, "DEBUG")
    assert " - DEBUG - " in out and "STEP_START" in out


def test_cli_has_a_verbose_flag():
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_assets", "run", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert "--verbose" in proc.stdout


def test_a_run_into_a_home_without_an_instance_file_prints_no_dagster_boilerplate(tmp_path):
    """Issue 51: into a DAGSTER_HOME without a dagster.yaml, Dagster printed its missing-file notice on every
    instance it opened and its telemetry banner; the run now writes the project's instance file there, once,
    and says so in one line."""
    home, empty = tmp_path / "home", tmp_path / "empty.jsonl"
    empty.write_text("")
    config = tmp_path / "c.yaml"
    config.write_text(f"ops:\n  prompt_corpus: {{config: {{sources: [{empty}]}}}}\n")
    env = {**os.environ, "DAGSTER_HOME": str(home), "DFLASH_STORAGE_ROOT": str(tmp_path / "data")}
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_assets", "run", "--config", str(config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "the file is empty" in out  # the run got as far as the corpus
    for boilerplate in ("No dagster instance configuration", "Telemetry", "Welcome to Dagster"):
        assert boilerplate not in out
    assert (home / "dagster.yaml").read_text() == (ROOT / "dagster.yaml").read_text()
    assert out.count("had no dagster.yaml") == 1
