"""The status command against a real Dagster instance holding done, failed, in-progress and missing partitions.

Stand-in assets carry the real stage keys and the real ``prompt_index_ranges`` partitions, so the
instance records look like the pipeline's; running the real completions would need a model server.
"""

import threading
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from dflash_assets.app.status import collect_status, print_status
from dflash_assets.app.status_lines import format_status
from dflash_assets.data.ranges import partition_keys
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.orchestration.pools import INFERENCE_POOL, ensure_pool_limits

PROJECT_CONCURRENCY = yaml.safe_load((Path(__file__).resolve().parent.parent / "dagster.yaml").read_text())[
    "concurrency"
]

KEYS = partition_keys(60, 10)  # 6 partitions of 10 prompts
P0, P1, P2, P3, P4, P5 = KEYS
# completions metadata per partition: (rows, completion_tokens_total, wall_s)
COMPLETIONS_META = {P0: (10, 1000, 2.0), P1: (10, 1200, 3.0), P2: (10, 800, 1.0)}
FAIL = {P3}
RELEASE = threading.Event()
IN_RUN = threading.Event()
HOLD = {P4}


@dg.asset(partitions_def=prompt_ranges, name="completions", pool=INFERENCE_POOL)
def completions_standin(context: dg.AssetExecutionContext):
    pk = context.partition_key
    if pk in FAIL:
        raise RuntimeError(f"{pk}: every request failed")
    if pk in HOLD:
        IN_RUN.set()
        assert RELEASE.wait(60), "test never released the in-progress run"
    rows, tokens, wall = COMPLETIONS_META.get(pk, (10, 5, 99.0))
    return dg.MaterializeResult(metadata={"rows": rows, "completion_tokens_total": tokens, "wall_s": wall})


@dg.asset(partitions_def=prompt_ranges, name="tokenized_sequences")
def tokenized_standin(context: dg.AssetExecutionContext):
    if context.partition_key in FAIL | {P2}:
        raise RuntimeError("blocking check failed")
    return dg.MaterializeResult(metadata={"rows": 10})


@dg.asset(partitions_def=prompt_ranges, name="hidden_states")
def hidden_standin(context: dg.AssetExecutionContext):
    return dg.MaterializeResult(metadata={"rows": 10})


def _materialize(instance, assets, pk):
    assets = assets if isinstance(assets, list) else [assets]
    return dg.materialize(assets, instance=instance, partition_key=pk, raise_on_error=False)


@pytest.fixture()
def instance(tmp_path):
    # the project's pools settings (granularity op, default limit 1): in-process steps claim pool slots too
    with dg.instance_for_test(temp_dir=str(tmp_path), overrides={"concurrency": PROJECT_CONCURRENCY}) as inst:
        yield inst


def test_status_counts_rate_and_eta(instance):
    instance.add_dynamic_partitions(prompt_ranges.name, KEYS)
    assert ensure_pool_limits(instance) == ["dflash_inference", "dflash_gpu"]
    assert ensure_pool_limits(instance) == []  # already registered
    # P0 materialized twice: the status must use the latest metadata (rows 10, 1000 tokens), not the first
    old = dict(COMPLETIONS_META)
    COMPLETIONS_META[P0] = (10, 5, 50.0)
    assert _materialize(instance, completions_standin, P0).success
    COMPLETIONS_META.update(old)
    # one run per partition holding that partition's stages, like the partition_stages job
    assert _materialize(instance, [completions_standin, tokenized_standin, hidden_standin], P0).success
    assert _materialize(instance, [completions_standin, tokenized_standin], P1).success
    assert not _materialize(instance, [completions_standin, tokenized_standin], P2).success  # tokenized fails
    assert not _materialize(instance, [completions_standin], P3).success

    # P4: a run in flight while the status is read
    RELEASE.clear()
    IN_RUN.clear()
    holder = threading.Thread(target=_materialize, args=(instance, completions_standin, P4))
    holder.start()
    try:
        assert IN_RUN.wait(60)
        time.sleep(0.2)
        status = collect_status(instance)
        text = format_status(status)
        raw = {
            stage: instance.get_status_by_partition(dg.AssetKey(stage), KEYS, prompt_ranges) or {}
            for stage in ("completions", "tokenized_sequences", "hidden_states")
        }
    finally:
        RELEASE.set()
        holder.join(60)

    assert status["partitions"] == 6 and status["prompts"] == 60
    comp = status["stages"]["completions"]
    assert (comp["done"], comp["failed"], comp["in_progress"], comp["missing"]) == (3, 1, 1, 1)
    assert comp["done_keys"] == [P0, P1, P2] and comp["failed_keys"] == [P3]
    assert comp["in_progress_keys"] == [P4] and comp["missing_keys"] == [P5]
    tok = status["stages"]["tokenized_sequences"]
    assert (tok["done"], tok["failed"], tok["in_progress"], tok["missing"]) == (2, 1, 0, 3)
    hid = status["stages"]["hidden_states"]
    assert (hid["done"], hid["failed"], hid["in_progress"], hid["missing"]) == (1, 0, 0, 5)

    # the command's counts are the instance's partition statuses (what the UI shows), read at the same moment
    names = {
        dg.AssetPartitionStatus.MATERIALIZED: "done",
        dg.AssetPartitionStatus.FAILED: "failed",
        dg.AssetPartitionStatus.IN_PROGRESS: "in_progress",
    }
    for stage, by_pk in raw.items():
        for group in ("done", "failed", "in_progress", "missing"):
            expected = [pk for pk in KEYS if names.get(by_pk.get(pk), "missing") == group]
            assert status["stages"][stage][f"{group}_keys"] == expected, (stage, group)

    c = status["completions"]
    assert c["rows_done"] == 30 and c["tokens_done"] == 3000
    assert c["generation_s"] == pytest.approx(6.0)
    assert c["tokens_per_s"] == pytest.approx(500.0)  # 3000 tokens / 6 s
    assert c["rows_remaining"] == 30  # P3 failed, P4 in progress, P5 missing: 10 prompts each
    assert c["tokens_remaining_est"] == pytest.approx(3000.0)  # 30 rows * 100 tokens/row
    assert c["eta_s"] == pytest.approx(6.0)  # 3000 tokens / 500 tokens/s
    # the held completions step holds the inference pool's only slot
    assert status["pools"][INFERENCE_POOL] == {"limit": 1, "in_use": 1, "waiting": 0}
    assert "pool dflash_inference: limit 1, 1 in use, 0 waiting" in text

    lines = text.splitlines()
    assert lines[0] == "partitions: 6 (prompt_index_ranges, 60 prompts)"
    assert lines[3].split() == ["completions", "3", "1", "1", "1"]
    assert f"failed: {P3}" in text
    assert "500.0 output tok/s, 5.00 req/s" in text and "ETA 6s" in text  # 30 requests (rows) in 6 s
    assert c["rows_total"] == 60 and c["requests"] == 30 and c["requests_per_s"] == pytest.approx(5.0)

    # after the held run finishes, P4 is done and its rows are no longer remaining
    after = collect_status(instance)
    assert after["stages"]["completions"]["done_keys"] == [P0, P1, P2, P4]
    assert after["completions"]["rows_remaining"] == 20
    assert after["pools"][INFERENCE_POOL]["in_use"] == 0


def test_status_of_an_empty_instance(instance, capsys):
    status = collect_status(instance)
    assert status["partitions"] == 0 and status["stages"]["completions"]["missing"] == 0
    assert status["completions"]["eta_s"] == 0.0
    instance.add_dynamic_partitions(prompt_ranges.name, KEYS[:2])
    status = collect_status(instance)
    assert status["stages"]["hidden_states"]["missing"] == 2
    assert status["completions"]["rows_remaining"] == 20
    assert status["completions"]["tokens_per_s"] is None and status["completions"]["eta_s"] is None
    assert print_status(instance) == 0
    out = capsys.readouterr().out
    assert "ETA unknown" in out and "tokens unknown" in out


def test_status_shows_a_range_run_in_progress(instance):
    """A single-run range of 3 partitions that committed its first one (with the run_* progress metadata
    the completions asset records) and is still going: status names the run and its progress."""
    keys = partition_keys(30, 10)
    gate, committed = threading.Event(), threading.Event()
    run_meta = {
        "run_rows_done": 10,
        "run_rows_total": 30,
        "run_req_per_s": 2.5,
        "run_output_tok_per_s": 250.0,
        "run_slots_in_flight": 8,
        "run_slots_capacity": 8,
        "run_eta_s": 8.0,
        "run_partition_range": f"{keys[0]}...{keys[-1]}",
    }

    @dg.asset(
        partitions_def=prompt_ranges,
        name="completions",
        backfill_policy=dg.BackfillPolicy.single_run(),
        output_required=False,
    )
    def range_standin(context: dg.AssetExecutionContext):
        for i, pk in enumerate(context.partition_keys):
            yield dg.AssetMaterialization(
                "completions",
                partition=pk,
                metadata={
                    "rows": 10,
                    "completion_tokens_total": 1000,
                    "wall_s": 4.0,
                    **run_meta,
                    "run_rows_done": 10 * (i + 1),
                },
            )
            if i == 0:
                committed.set()
                assert gate.wait(60), "test never released the range run"

    from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

    instance.add_dynamic_partitions(prompt_ranges.name, keys)
    job = dg.define_asset_job("range_job", selection=[range_standin], executor_def=dg.in_process_executor)
    job_def = dg.Definitions(assets=[range_standin], jobs=[job]).resolve_job_def("range_job")
    holder = threading.Thread(
        target=lambda: job_def.execute_in_process(
            instance=instance, tags={ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]}
        )
    )
    holder.start()
    try:
        assert committed.wait(60)
        status = collect_status(instance)
        text = format_status(status)
    finally:
        gate.set()
        holder.join(60)
    [run] = status["runs_in_progress"]
    assert (run["rows_done"], run["rows_total"], run["slots_in_flight"], run["slots_capacity"]) == (10, 30, 8, 8)
    assert run["range"] == f"{keys[0]}...{keys[-1]}" and run["eta_s"] == 8.0
    assert (
        f"in progress ({keys[0]}...{keys[-1]}): 10 / 30 rows, 2.5 req/s, 250.0 output tok/s, slots 8 / 8, ETA 8s"
        in text
    )
    assert collect_status(instance)["runs_in_progress"] == []  # the run ended


def test_generation_time_leaves_out_partitions_whose_rows_were_cut_without_a_request():
    """New-user trial: after a cap lowering cut every row locally, `status` read 'generation 0.0 s
    (24788.6 output tok/s)': the cut partitions' table tokens counted as generated in no time."""
    from types import SimpleNamespace

    from dflash_assets.app.status import generation_time

    records = {
        "a": SimpleNamespace(run_id="r1", timestamp=100.0),
        "b": SimpleNamespace(run_id="r2", timestamp=200.0),
        "old": SimpleNamespace(run_id="r0", timestamp=50.0),
    }
    meta = {
        "a": {"wall_s": 20.0, "output_tok_per_s": 50.0, "output_tokens_generated": 1000, "requested": 8},
        "b": {
            "wall_s": 0.0,
            "output_tok_per_s": 0.0,
            "output_tokens_generated": 0,
            "requested": 0,
            "completion_tokens_total": 160,
            "cut_to_lowered_cap": 8,
        },
        "old": {"wall_s": 10.0, "output_tok_per_s": 30.0, "requested": 4},
    }  # metadata from before the field
    assert generation_time(records, meta) == (30.0, 1300.0, 12)
