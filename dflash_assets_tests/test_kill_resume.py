"""Kill and resume from the shell: kill -9 of a real ``dagster asset materialize`` holding the
``dflash_inference`` pool slot, then the same command again with no clean-up: it must start at once
(the killed run is marked failed and its slot freed by the new run's executor, dflash_assets/orchestration/runs.py).

The asset is a stand-in (dflash_assets_tests/kill_defs.py) that hangs like a long generation; the CLI,
executor, instance (SQLite under a temp DAGSTER_HOME with the project's pool settings) and processes are
real. Also: live runs, runs of another machine (one host name, one run storage) and runs without process
tags are never reaped.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.test_utils import create_run_for_test

from dflash_assets.generation.processes.proc_info import proc_stat
from dflash_assets.orchestration.pools import INFERENCE_POOL
from dflash_assets.orchestration.runs import (
    BOOT_TAG,
    HOST_TAG,
    MACHINE_TAG,
    PID_NS_TAG,
    PID_TAG,
    START_TAG,
    MonitoredRunLauncher,
    mark_run_failed,
    process_tags,
    reap_dead_runs,
    run_process_alive,
    stop_orphaned_step_workers,
)

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = yaml.safe_load((ROOT / "dagster.yaml").read_text())["concurrency"]
DAGSTER = str(Path(sys.executable).parent / "dagster")


def _materialize_cmd(partition: str) -> list[str]:
    return [
        DAGSTER,
        "asset",
        "materialize",
        "--select",
        "slow_completions",
        "--partition",
        partition,
        "-m",
        "dflash_assets_tests.kill_defs",
    ]


@pytest.fixture()
def home(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "home" / "dagster.yaml").write_text(
        yaml.safe_dump({"concurrency": CONCURRENCY, "telemetry": {"enabled": False}})
    )
    env = {
        **os.environ,
        "DAGSTER_HOME": str(tmp_path / "home"),
        "KILL_TEST_DIR": str(tmp_path / "work"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return tmp_path, env


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def _started(work: Path) -> list[int]:
    return sorted(int(p.read_text()) for p in work.glob("started-*"))


@pytest.mark.parametrize("kill", ["process group", "orchestrator alone"])
def test_same_command_after_kill_9_starts_at_once(home, kill):
    tmp, env = home
    work = tmp / "work"
    (work / "hang").touch()
    with open(tmp / "run1.log", "w") as log:  # the child keeps its own copy of the descriptor
        first = subprocess.Popen(
            _materialize_cmd("p0"), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        [step_pid] = _wait(lambda: _started(work), 120, "the first run's step to start")
        with dg.DagsterInstance.from_config(str(tmp / "home")) as instance:
            [run] = instance.get_runs()
            assert run.status == dg.DagsterRunStatus.STARTED
            assert run.tags[PID_TAG] == str(first.pid) and run_process_alive(run) is True
            info = instance.event_log_storage.get_concurrency_info(INFERENCE_POOL)
            assert [s.run_id for s in info.claimed_slots] == [run.run_id]
            assert reap_dead_runs(instance, by="test") == []  # alive: never reaped
            if kill == "process group":
                os.killpg(first.pid, signal.SIGKILL)
            else:
                os.kill(first.pid, signal.SIGKILL)  # its step subprocess lives on, holding the slot
            first.wait(30)
            assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED  # what Dagster leaves
            if kill == "orchestrator alone":
                assert proc_stat(step_pid) is not None and proc_stat(step_pid).state != "Z"

        # the same command, no clean-up; the hang marker stays until the new step has started
        started = time.monotonic()
        with open(tmp / "run2.log", "w") as log:
            second = subprocess.Popen(
                _materialize_cmd("p0"), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            _wait(
                lambda: len(_started(work)) == 2, 60, "the second run's step to start (blocked by the dead run's slot?)"
            )
            start_s = time.monotonic() - started
            print(f"kill -9 of the {kill}: the same command's step started {start_s:.1f} s after it was run again")
            (work / "hang").unlink()
            assert second.wait(60) == 0, (tmp / "run2.log").read_text()[-3000:]
        finally:
            if second.poll() is None:
                os.killpg(second.pid, signal.SIGKILL)
        assert start_s < 60
        # the orphaned step process was stopped, not left generating beside the new run
        assert proc_stat(step_pid) is None or proc_stat(step_pid).state == "Z"
        with dg.DagsterInstance.from_config(str(tmp / "home")) as instance:
            runs = {r.run_id: r for r in instance.get_runs()}
            old, new = runs[run.run_id], next(r for rid, r in runs.items() if rid != run.run_id)
            assert old.status == dg.DagsterRunStatus.FAILURE and new.status == dg.DagsterRunStatus.SUCCESS
            failure = instance.all_logs(old.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)[-1]
            assert f"pid {first.pid}" in failure.message and f"freed by run {new.run_id}" in failure.message
            assert instance.event_log_storage.get_concurrency_info(INFERENCE_POOL).claimed_slots == []
            assert instance.get_latest_materialization_event(dg.AssetKey("slow_completions")).run_id == new.run_id
        assert f"run {old.run_id}: the process running it" in (tmp / "run2.log").read_text()
    finally:
        for proc in (first,):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def test_only_verifiably_dead_runs_are_reaped(tmp_path):
    """Dead pid, recycled pid (other start time) and an earlier boot of this machine are reaped; a live
    process, another machine (whatever its host name), another pid namespace, a run without tags, a
    pid-only tag, and a run of an earlier boot that logged after this boot are not (issue 27: the host name
    alone identified a machine, and a different boot id read as "rebooted")."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = process_tags()
    other_boot = "00000000-0000-0000-0000-000000000000"
    rebooted_is_provable = me[MACHINE_TAG].startswith("etc:")  # a home: id may be shared by other machines
    cases = {
        "live": me,
        "other machine, same host name": {
            **me,
            MACHINE_TAG: "etc:" + "0" * 32,
            BOOT_TAG: other_boot,
            PID_TAG: str(dead.pid),
        },
        "other machine, same boot (containers)": {**me, MACHINE_TAG: "etc:" + "1" * 32, PID_TAG: str(dead.pid)},
        "other pid namespace": {**me, PID_NS_TAG: "pid:[1]", PID_TAG: str(dead.pid)},
        "untagged": {},
        "pid only, live": {PID_TAG: me[PID_TAG], HOST_TAG: me[HOST_TAG]},
        "pid only, dead": {PID_TAG: str(dead.pid), HOST_TAG: me[HOST_TAG]},  # tags of `run` before issue 27
        "dead pid": {**me, PID_TAG: str(dead.pid)},
        "dead pid, renamed host": {**me, HOST_TAG: "renamed", PID_TAG: str(dead.pid)},
        "recycled pid": {**me, START_TAG: str(int(me[START_TAG]) - 1)},
        "earlier boot": {**me, BOOT_TAG: other_boot},
        "earlier boot, logged since": {**me, BOOT_TAG: other_boot},
    }
    dead_ones = {"dead pid", "dead pid, renamed host", "recycled pid"}
    dead_ones |= {"earlier boot"} if rebooted_is_provable else set()
    with dg.instance_for_test(temp_dir=str(tmp_path), overrides={"concurrency": CONCURRENCY}) as instance:
        ids = {
            name: create_run_for_test(instance, status=dg.DagsterRunStatus.STARTED, tags=tags).run_id
            for name, tags in cases.items()
        }
        logged = instance.get_run_by_id(ids["earlier boot, logged since"])
        instance.report_engine_event("still running elsewhere", logged)
        launcher = MonitoredRunLauncher()
        launcher.register_instance(instance)
        health = {
            name: launcher.check_run_worker_health(instance.get_run_by_id(rid)).status.value
            for name, rid in ids.items()
        }
        reaped = reap_dead_runs(instance, by="test")
        assert sorted(reaped) == sorted(ids[n] for n in dead_ones)
        status = {name: instance.get_run_by_id(rid).status for name, rid in ids.items()}
    assert {n for n, s in status.items() if s == dg.DagsterRunStatus.FAILURE} == dead_ones
    assert {n for n, s in health.items() if s == "FAILED"} == dead_ones


def _shared_storage_home(home: Path, storage: Path) -> Path:
    home.mkdir()
    (home / "dagster.yaml").write_text(
        yaml.safe_dump(
            {
                "concurrency": CONCURRENCY,
                "telemetry": {"enabled": False},
                "storage": {"sqlite": {"base_dir": str(storage)}},
            }
        )
    )
    return home


def test_two_instances_sharing_one_run_storage_under_one_host_name_never_reap_a_live_run(tmp_path):
    """Issue 27 acceptance: node A and node B have one host name and one run storage (two DAGSTER_HOMEs
    pointing at one database). A's live run, holding a pool slot, records A's pid, which does not exist
    on B. B's reaper (next run's executor), its daemon health check and its orphan step-worker sweep
    leave the run and its slot alone; B's own dead run on the same storage is still reaped."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = process_tags()  # node B: this process
    node_a = {
        **me,
        MACHINE_TAG: "etc:" + "a" * 32,
        BOOT_TAG: "aaaaaaaa-0000-0000-0000-000000000000",
        PID_NS_TAG: "pid:[4026531836]",
        PID_TAG: str(dead.pid),
        START_TAG: "12345",
    }
    assert node_a[HOST_TAG] == me[HOST_TAG]  # one host name: what the old reaper trusted
    storage = tmp_path / "shared_storage"
    home_a, home_b = _shared_storage_home(tmp_path / "a", storage), _shared_storage_home(tmp_path / "b", storage)
    with dg.DagsterInstance.from_config(str(home_a)) as a:
        live = create_run_for_test(a, status=dg.DagsterRunStatus.STARTED, tags=node_a)
        a.event_log_storage.set_concurrency_slots(INFERENCE_POOL, 1)
        assert a.event_log_storage.claim_concurrency_slot(INFERENCE_POOL, live.run_id, "completions").is_claimed
        a.report_engine_event("generating", live)
    with dg.DagsterInstance.from_config(str(home_b)) as b:
        mine = create_run_for_test(b, status=dg.DagsterRunStatus.STARTED, tags={**me, PID_TAG: str(dead.pid)})
        assert {r.run_id for r in b.get_runs()} == {live.run_id, mine.run_id}  # one storage
        launcher = MonitoredRunLauncher()
        launcher.register_instance(b)
        assert launcher.check_run_worker_health(b.get_run_by_id(live.run_id)).status.value == "RUNNING"
        assert reap_dead_runs(b, by="node B") == [mine.run_id]
        assert stop_orphaned_step_workers(b) == {}
        assert b.get_run_by_id(live.run_id).status == dg.DagsterRunStatus.STARTED
        claimed = b.event_log_storage.get_concurrency_info(INFERENCE_POOL).claimed_slots
        assert [s.run_id for s in claimed] == [live.run_id]
        with pytest.raises(ValueError, match="not STARTED"):
            mark_run_failed(b, mine.run_id)
        # the operator's way out once node A is known to be lost (README): mark it failed by hand
        assert "marked failed" in mark_run_failed(b, live.run_id)
        assert b.get_run_by_id(live.run_id).status == dg.DagsterRunStatus.FAILURE
        assert b.event_log_storage.get_concurrency_info(INFERENCE_POOL).claimed_slots == []


def test_a_home_machine_id_never_proves_a_reboot(tmp_path, monkeypatch):
    """Without /etc/machine-id the id lives in DAGSTER_HOME, which machines may share: a different boot
    id with that id may be another machine, so it proves nothing; separate homes give separate ids."""
    from dflash_assets.generation.processes import machine

    monkeypatch.setattr(machine, "MACHINE_ID_FILE", str(tmp_path / "no-machine-id"))
    (tmp_path / "h1").mkdir()
    (tmp_path / "h2").mkdir()
    one, two = machine.machine_id(tmp_path / "h1"), machine.machine_id(tmp_path / "h2")
    assert one.startswith("home:") and one != two and machine.machine_id(tmp_path / "h1") == one
    here = machine.Identity(one, "boot-1", "pid:[1]")
    assert machine.same_machine(machine.Identity(one, "boot-0", "pid:[1]"), here) is None
    assert machine.same_machine(machine.Identity(one, "boot-1", "pid:[1]"), here) == "same"
    etc = machine.Identity("etc:" + "e" * 32, "boot-1", "pid:[1]")
    assert machine.same_machine(etc._replace(boot="boot-0"), etc) == "rebooted"
    assert machine.same_machine(etc._replace(pid_ns="pid:[2]"), etc) is None
    assert machine.same_machine(etc._replace(machine=None), etc) is None


def test_ui_launched_run_worker_killed_then_same_launch_starts(home):
    """A run launched through the run queue (what the UI and backfills do) and executed by a run worker
    of the code server that ``dagster-daemon`` starts; kill -9 of the run worker alone. Dagster marks the
    run failed and frees its slot (dagster.yaml ``run_monitoring``); the orphaned step process is stopped
    by the next run before its step starts, so the two never generate side by side."""
    tmp, env = home
    work = tmp / "work"
    full = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    (tmp / "home" / "dagster.yaml").write_text(
        yaml.safe_dump(
            {k: full[k] for k in ("concurrency", "run_launcher", "run_monitoring")} | {"telemetry": {"enabled": False}}
        )
    )
    (work / "hang").touch()
    launch = [
        DAGSTER,
        "job",
        "launch",
        "-m",
        "dflash_assets_tests.kill_defs",
        "-j",
        "__ASSET_JOB",
        "--tags",
        '{"dagster/partition": "p1"}',
    ]

    def submit() -> None:
        out = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]

    with dg.DagsterInstance.from_config(str(tmp / "home")) as instance:  # create the SQLite storages once, so the
        instance.get_runs()  # daemon and the first launch do not both create them ("table ... already exists")
        instance.event_log_storage.get_concurrency_keys()
        instance.all_instigator_state()
    with open(tmp / "daemon.log", "w") as log:  # the child keeps its own copy of the descriptor
        daemon = subprocess.Popen(
            [str(Path(DAGSTER).parent / "dagster-daemon"), "run", "-m", "dflash_assets_tests.kill_defs"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        submit()
        [step_pid] = _wait(lambda: _started(work), 180, "the queued run's step to start")
        with dg.DagsterInstance.from_config(str(tmp / "home")) as instance:
            [run] = instance.get_runs()
            worker = int(run.tags[PID_TAG])
            assert worker != step_pid and run_process_alive(run) is True
            os.kill(worker, signal.SIGKILL)
            killed = time.monotonic()
            submit()
            queued = time.monotonic()  # what a click in the UI does at once: the run is in the queue
            second = _wait(lambda: [p for p in _started(work) if p != step_pid], 120, "the second run's step to start")
            start_s = time.monotonic() - queued
            print(
                f"after kill -9 of the run worker: launched (queued) in {queued - killed:.1f} s, its step started "
                f"{start_s:.1f} s later"
            )
            orphan_gone_first = proc_stat(step_pid) is None or proc_stat(step_pid).state == "Z"
            (work / "hang").unlink()
            new_id = next(r.run_id for r in instance.get_runs() if r.run_id != run.run_id)
            _wait(
                lambda: (
                    instance.get_run_by_id(new_id).status in (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE)
                ),
                120,
                "the second run to end",
            )
            assert instance.get_run_by_id(new_id).status == dg.DagsterRunStatus.SUCCESS
            assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
            materializations = instance.fetch_materializations(dg.AssetKey("slow_completions"), limit=10).records
            assert [m.run_id for m in materializations] == [new_id]  # the orphan never finished its step
        assert second and start_s < 60, f"{start_s:.1f} s; daemon log: {(tmp / 'daemon.log').read_text()[-3000:]}"
        assert orphan_gone_first, "the killed run's step process was still running when the next run's step started"
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
