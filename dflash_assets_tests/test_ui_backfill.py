"""A backfill of ``completions`` launched as the UI launches it is one run with one start per server.

``dagster-webserver`` and ``dagster-daemon`` (as a deployment runs them; ``dagster dev`` is the two
together) over a temporary DAGSTER_HOME holding the project's dagster.yaml, loading the real
``dflash_assets.definitions`` with a config file in ``sglang`` mode whose ``launch_module`` is the
GPU-server simulator (``dflash_simulators.sglang_stub``: its own processes on 127.0.0.1,
time-compressed). The backfill is created by the GraphQL mutation the UI's "Launch backfill" button
sends (``launchPartitionBackfill`` with ``assetSelection`` and ``partitionNames``, as in Dagster's
LaunchAssetChoosePartitionsDialog.tsx); the backfill daemon, run queue, run launcher, executor, asset,
client and journal are the real ones. Only the GPU servers are simulated.

Where Chromium is installed (always in CI) the backfill is launched by clicking through the UI in headless
Chromium (completions > Partitions > Materialize... > Launch backfill), and the test checks that the request
the page sent is that mutation with these parameters; elsewhere the test sends the same mutation itself.

The daemon is started just after the launch: the backfill daemon ticks every 30 s from its start, so its
first tick submits the run at once instead of up to 30 s later (the test's wall is two ticks, not three).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import yaml

from dflash_assets.generation.processes.ports import free_port, free_port_block
from dflash_assets.generation.processes.proc_info import proc_stat
from dflash_assets_tests.test_ui import (
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    LOCATION,
    LOCATION_QUERY,
    _default_interrupts,
    graphql,
)

REPO = Path(__file__).resolve().parent.parent
STUB = "dflash_simulators.sglang_stub"
NUM_SERVERS, SLOTS = 2, 3
PARTITION_SIZE, NUM_PROMPTS = 4, 16  # 4 partitions
# 60 simulated s of start-up and ~1.4 s per request, 50x faster than real
SIM = ["--sim-startup-s", "60", "--sim-median-tokens", "120", "--sim-sigma", "0.5", "--sim-speed", "50"]

LAUNCH_BACKFILL = """
mutation LaunchPartitionBackfill($backfillParams: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $backfillParams) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message stack }
    ... on PartitionKeysNotFoundError { message }
    ... on UnauthorizedError { message }
  }
}
"""
BACKFILL_QUERY = """
query Backfill($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    __typename
    ... on PartitionBackfill { status numPartitions runs { runId status } }
  }
}
"""
PARTITION_STATS = """
query {
  assetNodes(assetKeys: [{path: ["completions"]}]) { partitionStats { numMaterialized numPartitions numFailed } }
}
"""
BACKFILL_DONE = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}


def make_home(tmp: Path) -> tuple[Path, Path]:
    """DAGSTER_HOME with the project's dagster.yaml (queue polled every second) and a workspace loading
    the real definitions; the config file puts the inference resource in sglang mode on the simulator.
    Returns (home, config file)."""
    home, data, sim = tmp / "home", tmp / "data", tmp / "sim"
    for d in (home, data, sim):
        d.mkdir()
    instance_config = yaml.safe_load((REPO / "dagster.yaml").read_text())
    instance_config["run_coordinator"] = {
        "module": "dagster._core.run_coordinator",
        "class": "QueuedRunCoordinator",
        "config": {"dequeue_interval_seconds": 1},
    }
    (home / "dagster.yaml").write_text(yaml.safe_dump(instance_config))
    (home / "workspace.yaml").write_text(
        yaml.safe_dump(
            {
                "load_from": [
                    {
                        "python_module": {
                            "module_name": "dflash_assets.definitions",
                            "working_directory": str(REPO),
                            "location_name": LOCATION,
                        }
                    }
                ]
            }
        )
    )
    (home / ".nux").mkdir()
    (home / ".nux" / "nux.yaml").write_text("seen: 1\n")
    config = {
        "resources": {
            "storage": {"root": str(data)},
            "inference": {
                "mode": "sglang",
                "model_path": "simulated",
                "num_servers": NUM_SERVERS,
                "max_running_requests": SLOTS,
                "port_base": free_port_block(NUM_SERVERS),
                "launch_module": STUB,
                "startup_timeout_s": 60.0,
                "backoff_base_s": 0.05,
                "extra_args": [
                    *SIM,
                    "--sim-starts-file",
                    str(sim / "starts.txt"),
                    "--sim-request-log",
                    str(sim / "requests.jsonl"),
                ],
            },
            "generation": {"max_output_tokens": 4096, "temperature": 0.6},
        }
    }
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    return home, tmp / "config.yaml"


def make_corpus(home: Path, tmp: Path) -> list[str]:
    """The real prompt_corpus over a JSONL of NUM_PROMPTS prompts, in-process on the same instance
    (which also creates its SQLite storages before the daemon and webserver open them)."""
    from dflash_assets.assets.prompts import prompt_corpus
    from dflash_assets.orchestration.partitions import prompt_ranges
    from dflash_assets.stages.resources.storage import StorageResource

    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"prompt {i}"}) + "\n" for i in range(NUM_PROMPTS)))
    with dg.DagsterInstance.from_config(str(home)) as instance:
        result = dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources={"storage": StorageResource(root=str(tmp / "data"))},
            run_config={
                "ops": {"prompt_corpus": {"config": {"sources": [str(prompts)], "partition_size": PARTITION_SIZE}}}
            },
        )
        assert result.success
        instance.all_instigator_state()  # the schedule storage too
        return sorted(instance.get_dynamic_partitions(prompt_ranges.name))


@contextlib.contextmanager
def service(cmd: list[str], home: Path, log_path: Path):
    """Run a Dagster service (webserver or daemon, with the code server it starts) in its own process
    group until the block ends; then SIGTERM to the group, SIGKILL after 30 s."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=str(home),
            env={**os.environ, "DAGSTER_DISABLE_TELEMETRY": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_default_interrupts,
        )
        try:
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left (code server)
            proc.wait(10)


def wait_loaded(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = 120) -> None:
    """Until the webserver answers with the code location loaded. Raises RuntimeError otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"dagster-webserver exited with {proc.returncode}; see {log_path}")
        try:
            entries = graphql(url, LOCATION_QUERY)["workspaceOrError"]["locationEntries"]
            if any(e["name"] == LOCATION and e["loadStatus"] == "LOADED" for e in entries):
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"dagster-webserver did not load {LOCATION} within {timeout_s:.0f} s; see {log_path}")
        time.sleep(0.5)


def ui_backfill_params(keys: list[str]) -> dict:
    """What the UI's partition dialog sends for a backfill of an asset (hidden asset job) over ``keys``."""
    return {
        "assetSelection": [{"path": ["completions"]}],
        "partitionNames": keys,
        "fromFailure": False,
        "tags": [{"key": "dagster/from_ui", "value": "true"}],
    }


def launch_by_graphql(url: str, keys: list[str]) -> str:
    """The UI's launchPartitionBackfill mutation over ``keys``; returns the backfill id."""
    launched = graphql(url, LAUNCH_BACKFILL, {"backfillParams": ui_backfill_params(keys)})["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched
    return launched["backfillId"]


def launch_in_browser(url: str, keys: list[str]) -> str:
    """Launch the backfill from the completions partitions page in headless Chromium; returns its id,
    after checking that the page sent launchPartitionBackfill with :func:`ui_backfill_params`."""
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    sent, answers = [], []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.set_default_timeout(30_000)
            page.on(
                "request",
                lambda r: (
                    sent.append(r.post_data_json)
                    if "/graphql" in r.url and r.method == "POST" and "launchPartitionBackfill" in (r.post_data or "")
                    else None
                ),
            )
            page.on(
                "response",
                lambda r: (
                    answers.append(r)
                    if "/graphql" in r.url and "launchPartitionBackfill" in (r.request.post_data or "")
                    else None
                ),
            )
            page.goto(f"{url}/assets/completions?view=partitions")
            expect(page.get_by_text(f"Missing ({len(keys)})")).to_be_visible()
            page.get_by_role("button", name="Materialize…").first.click()
            dialog = page.get_by_role("dialog")
            expect(dialog.get_by_text("Partition selection")).to_be_visible()
            dialog.get_by_role("button", name="All", exact=True).click()  # every partition
            expect(dialog.get_by_text(f"{len(keys)} partitions", exact=True)).to_be_visible()
            # the asset's single-run backfill policy, as the dialog states it (the daemon starts after the launch)
            expect(dialog.get_by_text("Backfills all partitions in a single run.")).to_be_visible()
            page.screenshot(path=str(ARTIFACTS / "backfill_01_launch_single_run_policy.png"))
            dialog.get_by_role("button", name="Launch backfill").click()
            expect(page.get_by_text("Created backfill")).to_be_visible()
            page.screenshot(path=str(ARTIFACTS / "backfill_02_created.png"))
            body = answers[-1].json()
        finally:
            browser.close()
    [request] = sent
    params = request["variables"]["backfillParams"]
    expected = ui_backfill_params(keys)
    assert {k: params.get(k) for k in expected} == expected, params  # what launch_by_graphql sends
    assert set(params) <= set(expected) | {"runConfigData", "title", "description"}, params
    return body["data"]["launchPartitionBackfill"]["backfillId"]


def server_starts(tmp: Path) -> list[str]:
    path = tmp / "sim" / "starts.txt"
    return path.read_text().splitlines() if path.exists() else []


def alive_servers(tmp: Path) -> list[int]:
    """Pids of simulated servers (one per start) that still run."""
    pids = [int(line.split("pid=")[1].split()[0]) for line in server_starts(tmp)]
    return [pid for pid in pids if (stat := proc_stat(pid)) is not None and stat.state != "Z"]


def received(tmp: Path) -> list[str]:
    """Corpus prompts the simulated servers received (start-up probes excluded)."""
    path = tmp / "sim" / "requests.jsonl"
    events = map(json.loads, path.read_text().splitlines()) if path.exists() else []
    return [e["key"] for e in events if e["ev"] == "recv" and e["key"].startswith("prompt")]


def test_ui_backfill_of_a_range_is_one_run_with_one_server_start(tmp_path, monkeypatch):
    started = time.monotonic()
    home, config = make_home(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("DFLASH_CONFIG", str(config))
    monkeypatch.setenv("DFLASH_SERVER_REGISTRY", str(tmp_path / "registry"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    keys = make_corpus(home, tmp_path)
    assert len(keys) == NUM_PROMPTS // PARTITION_SIZE
    figures = {"corpus_s": round(time.monotonic() - started, 1)}

    bin_dir = Path(sys.executable).parent
    port, workspace = free_port(), str(home / "workspace.yaml")
    url = f"http://127.0.0.1:{port}"
    web_log, daemon_log = tmp_path / "webserver.log", tmp_path / "daemon.log"
    try:
        with service(
            [str(bin_dir / "dagster-webserver"), "-h", "127.0.0.1", "-p", str(port), "-w", workspace], home, web_log
        ) as web:
            wait_loaded(url, web, web_log)
            figures["webserver_up_s"] = round(time.monotonic() - started, 1)
            browser = Path(CHROMIUM).exists()
            backfill_id = launch_in_browser(url, keys) if browser else launch_by_graphql(url, keys)
            figures["launched_by"] = "browser" if browser else "graphql"
            figures["launched_s"] = round(time.monotonic() - started, 1)
            launched_at, launched_wall = time.monotonic(), time.time()
            with service([str(bin_dir / "dagster-daemon"), "run", "-w", workspace], home, daemon_log):
                deadline = time.monotonic() + 150
                while True:
                    backfill = graphql(url, BACKFILL_QUERY, {"id": backfill_id})["partitionBackfillOrError"]
                    if backfill["status"] in BACKFILL_DONE:
                        break
                    assert time.monotonic() < deadline, f"backfill not done: {backfill}; see {daemon_log}"
                    time.sleep(1)
                figures["backfill_done_s"] = round(time.monotonic() - launched_at, 1)
                # checked before the services stop: the run itself stopped its servers
                alive = alive_servers(tmp_path)
            stats = graphql(url, PARTITION_STATS)["assetNodes"][0]["partitionStats"]
    finally:
        for pid in alive_servers(tmp_path):  # what a failure left running; `alive` above is what the run left
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    figures["total_s"] = round(time.monotonic() - started, 1)

    with dg.DagsterInstance.from_config(str(home)) as instance:
        runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
        run_lines = [
            f"{r.run_id[:8]} {r.status.value} {r.tags.get('dagster/asset_partition_range_start')}..."
            f"{r.tags.get('dagster/asset_partition_range_end')}"
            for r in runs
        ]
        assert len(runs) == 1, run_lines  # one run for the range, not one per partition
        [run] = runs
        assert run.status == dg.DagsterRunStatus.SUCCESS, run_lines
        assert (run.tags["dagster/asset_partition_range_start"], run.tags["dagster/asset_partition_range_end"]) == (
            keys[0],
            keys[-1],
        )
        assert backfill["status"] == "COMPLETED_SUCCESS" and [r["runId"] for r in backfill["runs"]] == [run.run_id]
        record = instance.get_run_record_by_id(run.run_id)
        figures.update(
            run_created_after_launch_s=round(record.create_timestamp.timestamp() - launched_wall, 1),
            run_wall_s=round(record.end_time - record.start_time, 1),
        )
        print(
            f"\nbackfill {backfill_id}: {backfill['status']}, runs: {run_lines}, server starts: "
            f"{len(server_starts(tmp_path))}, requests: {len(received(tmp_path))}, {figures}"
        )
        for pk in keys:
            records = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=[pk]), limit=10
            ).records
            assert [r.run_id for r in records] == [run.run_id], f"{pk}: {len(records)} materializations"
            meta = records[0].asset_materialization.metadata
            assert meta["rows"].value == PARTITION_SIZE and meta["run_partitions"].value == len(keys)
            assert "dagster/data_version" in records[0].asset_materialization.tags
    assert stats == {"numMaterialized": len(keys), "numPartitions": len(keys), "numFailed": 0}  # as the UI shows it

    assert len(server_starts(tmp_path)) == NUM_SERVERS, server_starts(tmp_path)  # not NUM_SERVERS x partitions
    assert sorted(received(tmp_path)) == sorted(f"prompt {i}" for i in range(NUM_PROMPTS))  # each prompt once
    assert alive == [], f"server processes left running after the run: {alive}"
