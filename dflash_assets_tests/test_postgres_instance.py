"""Issue 41, item 1: one Dagster instance for every node, on a real PostgreSQL server.

The instance is ``dflash_assets/configs/instance/dagster_cluster.yaml`` as shipped (URL from ``DFLASH_POSTGRES_URL``),
the server Debian's PostgreSQL started by :mod:`postgres_server`. What the project reads from the instance is
checked on it: dynamic partition keys and materialization metadata (``status``, the same figures the SQLite test
of issue 15 expects), pools, reaping a killed run and freeing its slot, and the check gate.
"""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.test_utils import create_run_for_test

from dflash_assets.generation.rows.records import rows_to_frame
from dflash_assets.orchestration.check_gate import BLOCKING_CHECKS, CHECK_NONEMPTY, failed_blocking_checks
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.orchestration.pools import INFERENCE_POOL, POOLS, ensure_pool_limits
from dflash_assets.orchestration.runs import PID_TAG, process_tags, reap_dead_runs
from dflash_assets.stages.completions.tables import completion_stats, partition_file
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.storage.store import Storage

try:
    from dflash_assets_tests import test_status_cap_change as cap_change
    from dflash_assets_tests.postgres_server import postgres_missing, running_postgres
    from dflash_assets_tests.system_parts import skip_or_fail
except ImportError:  # run from inside the tests folder
    import test_status_cap_change as cap_change  # type: ignore[no-redef]
    from postgres_server import postgres_missing, running_postgres  # type: ignore[no-redef]
    from system_parts import skip_or_fail  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_YAML = ROOT / "dflash_assets" / "configs" / "instance" / "dagster_cluster.yaml"


@pytest.fixture(scope="module")
def postgres_url():
    skip_or_fail(postgres_missing())
    with running_postgres() as url:
        yield url


@pytest.fixture()
def cluster_home(tmp_path, postgres_url, monkeypatch):
    """A DAGSTER_HOME holding the shipped cluster dagster.yaml, its URL in the environment; a fresh database
    schema per test (Dagster's tables are dropped first)."""
    import sqlalchemy as sa

    engine = sa.create_engine(postgres_url)
    with engine.begin() as connection:
        connection.execute(sa.text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    engine.dispose()
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(CLUSTER_YAML, home / "dagster.yaml")
    monkeypatch.setenv("DFLASH_POSTGRES_URL", postgres_url)
    return home


def test_the_shipped_cluster_config_keeps_its_url_in_the_environment():
    text = CLUSTER_YAML.read_text()
    assert "env: DFLASH_POSTGRES_URL" in text and "postgresql+psycopg2://" in text  # the driver the docs measured
    assert "@" not in text.split("storage:")[1].split("telemetry:")[0]  # no credentials in the file


def test_status_read_from_postgres_agrees_with_the_stored_files(cluster_home, tmp_path):
    """The same three partitions as the SQLite test of issue 15, materialized into the Postgres instance; a
    separate ``status`` process (another node's shell) reads them back and counts as the files say."""
    store_root = tmp_path / "data"
    settings = GenerationResource(
        **__import__("yaml").safe_load(cap_change.config_copy(tmp_path, cap_change.CAP, store_root).read_text())[
            "resources"
        ]["generation"]
    ).settings()
    store = Storage(str(store_root))

    @dg.asset(name="completions", partitions_def=prompt_ranges)
    def completions_standin(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        frame = rows_to_frame(cap_change.rows_for(context.partition_key, settings))
        store.write_parquet(frame, *partition_file(context.partition_key))
        return dg.MaterializeResult(
            metadata={**completion_stats(frame), "requested": 10, "wall_s": 2.0, "output_tok_per_s": 30.0}
        )

    with dg.DagsterInstance.from_config(str(cluster_home)) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        instance.add_dynamic_partitions(prompt_ranges.name, cap_change.KEYS)
        for pk in cap_change.KEYS:
            assert dg.materialize([completions_standin], instance=instance, partition_key=pk).success
    errors = sum(t is None for rows in cap_change.LAYOUT.values() for t, _ in rows)
    length_rows = sum(r == "length" for rows in cap_change.LAYOUT.values() for _, r in rows)
    same = cap_change.status_output(tmp_path, cluster_home, store_root, cap_change.CAP)
    assert cap_change.regenerate_line(same) == (errors, 1, {"error": errors})
    assert cap_change.remaining(same) == errors and f"{30 - errors} / 30 rows valid under cap 10" in same
    raised = cap_change.status_output(tmp_path, cluster_home, store_root, 14)
    assert cap_change.remaining(raised) == length_rows + errors


def test_pools_and_reaping_a_killed_run_hold_on_postgres(cluster_home):
    """Pools are registered at dagster.yaml's default limit; a STARTED run whose process was killed holds an
    inference slot until the next run reaps it: marked failed, slot freed, a live run untouched."""
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead_tags = {**process_tags(dead.pid), PID_TAG: str(dead.pid)}
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait(10)
    with dg.DagsterInstance.from_config(str(cluster_home)) as instance:
        assert sorted(ensure_pool_limits(instance)) == sorted(POOLS)
        assert ensure_pool_limits(instance) == []  # registered once
        storage = instance.event_log_storage
        assert {p: storage.get_concurrency_info(p).slot_count for p in POOLS} == dict.fromkeys(POOLS, 1)
        killed = create_run_for_test(instance, status=dg.DagsterRunStatus.STARTED, tags=dead_tags)
        live = create_run_for_test(instance, status=dg.DagsterRunStatus.STARTED, tags=process_tags())
        claim = storage.claim_concurrency_slot(INFERENCE_POOL, killed.run_id, "completions")
        assert claim.is_claimed
        assert not storage.claim_concurrency_slot(INFERENCE_POOL, live.run_id, "completions").is_claimed
        assert reap_dead_runs(instance, by="test") == [killed.run_id]
        assert instance.get_run_by_id(killed.run_id).status == dg.DagsterRunStatus.FAILURE
        assert instance.get_run_by_id(live.run_id).status == dg.DagsterRunStatus.STARTED
        assert storage.get_concurrency_info(INFERENCE_POOL).claimed_slots == []
        storage.free_concurrency_slots_for_run(live.run_id)


def test_the_check_gate_reads_failed_blocking_checks_from_postgres(cluster_home):
    keys = ["0000000-0000009", "0000010-0000019"]

    @dg.asset(name="tokenized_sequences", partitions_def=prompt_ranges)
    def tokenized_standin(context: dg.AssetExecutionContext) -> None:
        return None

    def blocking_check(name: str) -> dg.AssetChecksDefinition:
        @dg.asset_check(asset=tokenized_standin, name=name, blocking=True)
        def check(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
            # the second partition fails the non-empty check; every other evaluation passes
            return dg.AssetCheckResult(passed=not (name == CHECK_NONEMPTY and context.partition_key == keys[1]))

        return check

    checks = [blocking_check(name) for name in BLOCKING_CHECKS["tokenized_sequences"]]

    with dg.DagsterInstance.from_config(str(cluster_home)) as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, keys)
        for pk in keys:
            dg.materialize([tokenized_standin, *checks], instance=instance, partition_key=pk, raise_on_error=False)
        records = {
            pk: instance.fetch_materializations(
                dg.AssetRecordsFilter(dg.AssetKey("tokenized_sequences"), asset_partitions=[pk]), limit=1
            ).records[0]
            for pk in keys
        }
        held = failed_blocking_checks(instance, "tokenized_sequences", records)
    assert set(held) == {keys[1]} and held[keys[1]].failed == (CHECK_NONEMPTY,)
