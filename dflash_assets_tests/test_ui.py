"""The Dagster UI in headless Chromium, and the inference pool's one-run-at-a-time limit.

Starts ``dagster dev`` on 127.0.0.1 (free port) over a temporary DAGSTER_HOME holding the project's
dagster.yaml, with the code location ``ui_helpers.py`` (real ``prompt_corpus``, fast stand-ins of the
partitioned stages with the real keys, partitions, op tags and pools), then drives the UI.
Screenshots go to ``test-artifacts/ui/`` at the repo root.
"""

import contextlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

try:
    from dflash_assets_tests.system_parts import skip_or_fail
except ImportError:  # run from inside the tests folder
    from system_parts import skip_or_fail  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts" / "ui"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LOCATION = "dflash_assets_ui_test"
STARTUP_TIMEOUT_S = 120


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_dagster_home(tmp: Path) -> Path:
    """A DAGSTER_HOME with the project's dagster.yaml (queue polled every second, for speed), a
    workspace.yaml loading ``ui_helpers.py``, and the UI's first-visit dialog marked as seen."""
    home = tmp / "dagster_home"
    home.mkdir(parents=True)
    config = yaml.safe_load((REPO / "dagster.yaml").read_text())
    config["run_coordinator"] = {
        "module": "dagster._core.run_coordinator",
        "class": "QueuedRunCoordinator",
        "config": {"dequeue_interval_seconds": 1},
    }
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    workspace = {
        "load_from": [
            {
                "python_file": {
                    "relative_path": str(Path(__file__).with_name("ui_helpers.py")),
                    "working_directory": str(REPO),
                    "location_name": LOCATION,
                }
            }
        ]
    }
    (home / "workspace.yaml").write_text(yaml.safe_dump(workspace))
    (home / ".nux").mkdir()
    (home / ".nux" / "nux.yaml").write_text("seen: 1\n")  # no "join the community" dialog over the page
    return home


def materialize_corpus(home: Path, partition_size: int) -> list[str]:
    """Materialize the real prompt_corpus (HumanEval, 164 prompts) into ``home`` and make sure the pools
    are registered (what prompt_corpus itself should do); returns the partition keys."""
    import dagster as dg

    from dflash_assets.assets.prompts import prompt_corpus
    from dflash_assets.orchestration.partitions import prompt_ranges
    from dflash_assets.orchestration.pools import ensure_pool_limits
    from dflash_assets.stages.resources.storage import StorageResource

    with dg.DagsterInstance.from_config(str(home)) as instance:
        result = dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources={"storage": StorageResource(root=str(home / "dflash_data"))},
            run_config={"ops": {"prompt_corpus": {"config": {"partition_size": partition_size}}}},
        )
        assert result.success
        ensure_pool_limits(
            instance
        )  # a no-op once prompt_corpus registers them (test_prompt_corpus_registers_the_pools)
        return list(instance.get_dynamic_partitions(prompt_ranges.name))


@contextlib.contextmanager
def dagster_dev(home: Path, port: int, log_path: Path, stage_seconds: float = 1.0):
    """Run ``dagster dev`` (webserver, daemon, code server) until the code location is loaded; yields the base URL.

    Raises:
        RuntimeError: the UI did not answer with a loaded code location within STARTUP_TIMEOUT_S.
    """
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "DFLASH_UI_STAGE_SECONDS": str(stage_seconds),
        "DAGSTER_DISABLE_TELEMETRY": "1",
    }
    dagster = str(Path(sys.executable).with_name("dagster"))
    with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [dagster, "dev", "-h", "127.0.0.1", "-p", str(port), "-w", str(home / "workspace.yaml")],
            cwd=str(home),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_default_interrupts,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dagster dev exited with {proc.returncode}; see {log_path}")
            try:
                data = graphql(url, LOCATION_QUERY)
                entries = data["workspaceOrError"]["locationEntries"]
                if any(e["name"] == LOCATION and e["loadStatus"] == "LOADED" for e in entries):
                    break
            except (httpx.HTTPError, KeyError, TypeError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"dagster dev did not load {LOCATION} within {STARTUP_TIMEOUT_S}s; see {log_path}")
            time.sleep(1)
        yield url
    finally:
        # dagster dev stops its webserver, daemon and code servers on SIGINT; anything left of its
        # process group (which only it and its children are in) is killed after 30 s
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _default_interrupts() -> None:
    # a shell's background job inherits SIGINT ignored, and dagster dev maps SIGTERM to the SIGINT
    # handler, so it would ignore both; restore the defaults in the child before exec
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


LOCATION_QUERY = """
query { workspaceOrError { ... on Workspace { locationEntries { name loadStatus } } } }
"""


def graphql(url: str, query: str, variables: dict | None = None) -> dict:
    """POST a query to the webserver's GraphQL endpoint (the API the UI itself uses); returns ``data``."""
    r = httpx.post(f"{url}/graphql", json={"query": query, "variables": variables or {}}, timeout=30)
    r.raise_for_status()
    body = r.json()
    if body.get("errors"):
        raise RuntimeError(body["errors"])
    return body["data"]


RUNS_QUERY = """
query {
  runsOrError {
    ... on Runs { results { runId status creationTime startTime endTime tags { key value } assetSelection { path } } }
  }
}
"""
PARTITION_TAG = "dagster/partition"


def completions_runs(url: str) -> list[dict]:
    """Runs that materialize ``completions``: ``{run_id, partition, status, created, start, end}``, oldest first."""
    runs = graphql(url, RUNS_QUERY)["runsOrError"]["results"]
    out = []
    for r in runs:
        if ["completions"] not in [a["path"] for a in r["assetSelection"] or []]:
            continue
        tags = {t["key"]: t["value"] for t in r["tags"]}
        out.append(
            {
                "run_id": r["runId"],
                "partition": tags.get(PARTITION_TAG),
                "status": r["status"],
                "created": r["creationTime"],
                "start": r["startTime"],
                "end": r["endTime"],
            }
        )
    return sorted(out, key=lambda r: r["created"])


def chromium_or_skip() -> str:
    """Path of the system Chromium; skips the test where it is missing, except in CI (``$CI`` set), where it fails."""
    if not Path(CHROMIUM).exists():
        skip_or_fail(f"{CHROMIUM} is missing: apt-get install -y chromium")
    return CHROMIUM


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def test_standins_mirror_the_real_assets():
    """The UI test's stand-ins carry the real stages' keys, partitions, groups, op tags and pools."""
    import dagster as dg
    import ui_helpers

    from dflash_assets.assets import completions, hidden_states, tokenized

    pairs = [
        (ui_helpers.completions, completions.completions),
        (ui_helpers.tokenized_sequences, tokenized.tokenized_sequences),
        (ui_helpers.hidden_states, hidden_states.hidden_states),
    ]
    for standin, real in pairs:
        assert standin.key == real.key
        assert standin.partitions_def == real.partitions_def
        assert standin.op.tags == real.op.tags, real.key
        assert standin.op.pool == real.op.pool, f"{real.key}: pool {real.op.pool!r}, stand-in {standin.op.pool!r}"
        assert {k: standin.group_names_by_key[k] for k in standin.keys} == {
            k: real.group_names_by_key[k] for k in real.keys
        }
        assert standin.asset_deps[standin.key] == real.asset_deps[real.key]
    assert ui_helpers.completions.op.pool == ui_helpers.INFERENCE_POOL
    assert dg.AssetKey("prompt_corpus") in ui_helpers.defs.resolve_asset_graph().get_all_asset_keys()


def step_intervals(home: Path, run_ids: list[str], step_key: str = "completions") -> dict[str, tuple[float, float]]:
    """``{run_id: (start, end)}`` of one step in each run, from the STEP_START / STEP_SUCCESS events (Unix seconds)."""
    import dagster as dg

    out = {}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        for run_id in run_ids:
            times = {}
            for entry in instance.all_logs(
                run_id, of_type={dg.DagsterEventType.STEP_START, dg.DagsterEventType.STEP_SUCCESS}
            ):
                if entry.step_key == step_key:
                    times[entry.dagster_event.event_type] = entry.timestamp
            out[run_id] = (times[dg.DagsterEventType.STEP_START], times[dg.DagsterEventType.STEP_SUCCESS])
    return out


def test_prompt_corpus_registers_the_pools(tmp_path):
    """Materializing the real prompt_corpus registers the pools at dagster.yaml's default limit, so runs
    queued together for a pool's first use are held by the queue (see pools.ensure_pool_limits)."""
    import dagster as dg

    from dflash_assets.assets.prompts import prompt_corpus
    from dflash_assets.orchestration.pools import POOLS, pool_usage
    from dflash_assets.stages.resources.storage import StorageResource

    project_concurrency = yaml.safe_load((REPO / "dagster.yaml").read_text())["concurrency"]
    with dg.instance_for_test(temp_dir=str(tmp_path), overrides={"concurrency": project_concurrency}) as instance:
        assert not set(POOLS) & instance.event_log_storage.get_concurrency_keys()
        result = dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources={"storage": StorageResource(root=str(tmp_path / "data"))},
            run_config={"ops": {"prompt_corpus": {"config": {"max_prompts": 3}}}},
        )
        assert result.success
        assert set(POOLS) <= instance.event_log_storage.get_concurrency_keys(), (
            "prompt_corpus must call dflash_assets.orchestration.pools.ensure_pool_limits(context.instance)"
        )
        assert {pool: u["limit"] for pool, u in pool_usage(instance).items()} == {pool: 1 for pool in POOLS}


def test_ui_launches_partitions_one_at_a_time_under_the_inference_pool(tmp_path):
    """Asset graph and partitions view render; a partition launched from the UI succeeds; 3 partitions
    launched together from the UI (a backfill) run one at a time under the dflash_inference pool (limit 1)."""
    chromium = chromium_or_skip()
    from playwright.sync_api import expect, sync_playwright

    from dflash_assets.app.status import collect_status

    started = time.monotonic()
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    home = make_dagster_home(tmp_path)
    keys = materialize_corpus(home, partition_size=40)  # HumanEval's 164 prompts -> 5 partitions
    assert keys == ["0000000-0000039", "0000040-0000079", "0000080-0000119", "0000120-0000159", "0000160-0000163"]
    single, batch = keys[0], keys[1:4]
    timings = {"corpus_s": round(time.monotonic() - started, 1)}

    with dagster_dev(home, free_port(), tmp_path / "dagster_dev.log") as url, sync_playwright() as pw:
        timings["dagster_dev_up_s"] = round(time.monotonic() - started, 1)
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(30_000)
        try:
            # 1. the asset graph: every stage downstream of the corpus
            page.goto(f"{url}/assets/prompt_corpus?view=lineage&lineageScope=downstream")
            page.get_by_role("button", name="All", exact=True).click()
            for name in ("prompt_corpus", "completions", "truncation_report", "tokenized_sequences", "hidden_states"):
                expect(page.get_by_text(name, exact=True).first).to_be_visible()
            zoom_out = page.get_by_role("img", name="zoom_out")
            for _ in range(4 if zoom_out.count() else 0):  # so the whole graph fits the screenshot
                zoom_out.first.click()
            page.set_viewport_size({"width": 2200, "height": 1300})
            page.wait_for_timeout(300)
            shot(page, "01_asset_graph")
            page.set_viewport_size({"width": 1600, "height": 1000})

            # 2. the completions partitions view: the 5 registered ranges, all missing
            page.goto(f"{url}/assets/completions?view=partitions")
            expect(page.get_by_text("Missing (5)")).to_be_visible()
            for pk in keys:
                expect(page.get_by_text(pk, exact=True).first).to_be_visible()
            shot(page, "02_completions_partitions")

            # 3. launch 3 partitions at once; the dialog makes that a backfill of one run per partition
            page.get_by_role("button", name="Materialize…").first.click()
            dialog = page.get_by_role("dialog")
            # the picker's first click can land before the dialog takes clicks on a loaded machine (seen once in a
            # whole-suite run: no menu after 30 s); open it again while no menu item shows
            for attempt in range(3):
                dialog.get_by_role("img", name="expand_more").click()
                try:
                    expect(page.get_by_role("menuitem").filter(has_text=batch[0])).to_be_visible(timeout=10_000)
                    break
                except AssertionError:
                    if attempt == 2:
                        raise
            for pk in batch:
                page.get_by_role("menuitem").filter(has_text=pk).click()
            page.keyboard.press("Escape")  # closes the partition picker only
            expect(dialog.get_by_text("3 partitions", exact=True)).to_be_visible()
            shot(page, "03_launch_3_partitions")
            dialog.get_by_role("button", name="Launch backfill").click()
            expect(page.get_by_text("Created backfill")).to_be_visible()

            # 4. launch one more partition on its own and follow its run page to success
            page.get_by_text(single, exact=True).first.click()
            page.get_by_role("button", name="Materialize…").first.click()
            dialog = page.get_by_role("dialog")
            expect(dialog.get_by_text("1 partition", exact=True)).to_be_visible()
            shot(page, "04_launch_1_partition")
            dialog.get_by_role("button", name="Launch 1 run").click()
            launched = page.get_by_text(re.compile(r"^Launched run [0-9a-f]{8}$"))
            expect(launched).to_be_visible()
            run_prefix = launched.inner_text().split()[-1]
            view = page.get_by_role("link", name="View", exact=True).or_(
                page.get_by_role("button", name="View", exact=True)
            )
            page.locator("div").filter(has=launched).filter(has=view).last.get_by_text("View", exact=True).click()
            expect(page).to_have_url(re.compile(r"/runs/[0-9a-f-]{36}"))
            single_run_id = page.url.rsplit("/runs/", 1)[1].split("?")[0]
            assert single_run_id.startswith(run_prefix)
            expect(page.get_by_text("Success", exact=True).first).to_be_visible(timeout=90_000)
            shot(page, "05_single_run_succeeded")

            # 5. wait for the backfill's runs; while one runs the queue holds the rest
            deadline = time.monotonic() + 100
            saw_queue = False
            while True:
                runs = completions_runs(url)
                statuses = [r["status"] for r in runs]
                if len(runs) == 4 and not saw_queue and "QUEUED" in statuses:
                    saw_queue = True
                    page.goto(f"{url}/runs")
                    page.get_by_text(re.compile(r"^Queued \(\d+\)$")).click()
                    expect(page.get_by_text("Queued", exact=True).first).to_be_visible()
                    shot(page, "06_runs_queued")
                if len(runs) == 4 and all(s in ("SUCCESS", "FAILURE", "CANCELED") for s in statuses):
                    break
                assert time.monotonic() < deadline, f"runs did not finish in time: {runs}"
                time.sleep(1)
            timings["all_runs_done_s"] = round(time.monotonic() - started, 1)
            page.goto(f"{url}/runs")
            expect(page.get_by_text("Success").first).to_be_visible()
            shot(page, "07_runs_done")
            page.goto(f"{url}/assets/completions?view=partitions")
            expect(page.get_by_text("Materialized (4)")).to_be_visible()
            shot(page, "08_completions_partitions_done")
        finally:
            browser.close()
    timings["dagster_dev_down_s"] = round(time.monotonic() - started, 1)

    assert statuses == ["SUCCESS"] * 4, runs
    assert sorted(r["partition"] for r in runs) == sorted([single, *batch])
    assert single_run_id in {r["run_id"] for r in runs}
    steps = step_intervals(home, [r["run_id"] for r in runs])
    by_start = sorted(runs, key=lambda r: r["start"])
    timeline = "\n".join(
        f"{r['partition']}: created {r['created']:.2f} run {r['start']:.2f}-{r['end']:.2f} "
        f"completions step {steps[r['run_id']][0]:.2f}-{steps[r['run_id']][1]:.2f}"
        for r in by_start
    )
    (ARTIFACTS / "timeline.txt").write_text(f"{timeline}\n{timings}\n")
    print(f"\n{timeline}\n{timings}")
    for prev, nxt in itertools.pairwise(by_start):
        # the inference work never overlaps (the pool's slot), and the queue held each run until the
        # previous one had released it: it started after the previous run ended
        assert steps[nxt["run_id"]][0] >= steps[prev["run_id"]][1], f"completions steps overlap: {prev} {nxt}"
        assert nxt["start"] >= prev["end"], f"runs overlap: {prev} and {nxt}"
    # the limit, not luck, kept them apart: some run was queued before the previous one ended
    assert saw_queue and any(nxt["created"] < prev["end"] for prev, nxt in itertools.pairwise(by_start)), by_start

    # the status command agrees with the UI
    import dagster as dg

    with dg.DagsterInstance.from_config(str(home)) as instance:
        status = collect_status(instance)
    comp = status["stages"]["completions"]
    assert (comp["done"], comp["missing"]) == (4, 1) and comp["missing_keys"] == [keys[4]]
    assert status["completions"]["rows_done"] == 160  # 4 partitions of 40 prompts
    assert status["pools"]["dflash_inference"] == {"limit": 1, "in_use": 0, "waiting": 0}
