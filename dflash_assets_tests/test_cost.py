"""What the run costs: per-stage cost metadata, the cost table, the forecast and its report.

The node test runs the real completions asset against the GPU-node simulator (stub SGLang servers in their
own processes, time-compressed), as test_node_scale does: a pilot of 1 partition of 10, the forecast from
it, then the other 9 in one range run; the measured whole must fall inside the forecast's intervals, and
the table's device-seconds must equal servers x the generating wall the servers' own request log shows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
import yaml

from dflash_assets.app.cost_report import (
    REPORT,
    build_report,
    configured_bytes_per_token,
    format_comparison,
    keep_forecast,
    write_cost_report,
)
from dflash_assets.app.cost_table import format_cost_table, stage_costs
from dflash_assets.common import cost
from dflash_assets.common.config import ConfigError
from dflash_assets.stages.forecast import collect_forecast, format_forecast, mean_interval, rows_done, t975
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets_tests.test_node_scale import range_materialize, sglang_sim, write_corpus
from dflash_assets_tests.test_tokenized import tiny_target  # noqa: F401  (fixture)

PROMPTS, PARTITIONS, SERVERS, SLOTS = 400, 10, 2, 4


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_SERVER_REGISTRY", str(tmp_path / "registry"))


def stub_events(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]


def test_forecast_from_one_partition_of_ten_holds_the_measured_whole(tmp_path, registry, monkeypatch, capsys):
    root = tmp_path / "data"

    def servers() -> InferenceServerResource:  # 10x: each request ~0.14 s real, start-up 6 s real
        return sglang_sim(tmp_path, SERVERS, SLOTS, "--sim-speed", "10")

    with dg.instance_for_test() as instance:
        keys = write_corpus(instance, root, [f"prompt {i}" for i in range(PROMPTS)], PROMPTS // PARTITIONS)
        assert len(keys) == PARTITIONS
        assert range_materialize(instance, root, keys[:1], servers()).success  # the pilot
        store = StorageResource(root=str(root)).open()
        assert keep_forecast(instance, store, servers()) is None  # as `run` does before it generates
        forecast = store.read_json(*REPORT)["forecast"]
        assert forecast["from_partitions"] == keys[:1] and forecast["prompts_left"] == PROMPTS - PROMPTS // 10
        assert forecast == collect_forecast(instance, PROMPTS, servers(), store) | {"made_at": forecast["made_at"]}
        pilot_bytes = (root / "completions" / f"{keys[0]}.parquet").stat().st_size
        assert forecast["storage_bytes"]["completions"]["point"] == pytest.approx(pilot_bytes * PARTITIONS)

        pilot_end = max(e["t"] for e in stub_events(tmp_path))
        assert range_materialize(instance, root, keys[1:], servers()).success  # the other 9, one run
        costs = stage_costs(instance)
        report = write_cost_report(store, None, costs, rows_done(instance))

        # every partition's cost is labelled simulated, never GPU
        assert {m["cost_device"] for m in _latest(instance, keys).values()} == {cost.SIMULATED_GPU}
        assert costs["completions"]["device"] == cost.SIMULATED_GPU
        # generated tokens: the tables themselves, read independently
        tables = pl.concat([pl.read_parquet(root / "completions" / f"{pk}.parquet") for pk in keys])
        assert costs["completions"]["tokens_out"] == int(tables["completion_tokens"].sum())

        # device-seconds of the range run = servers x its generating wall by the servers' own clock
        run_events = [e for e in stub_events(tmp_path) if e["t"] > pilot_end and e["key"].startswith("prompt")]
        stub_wall = max(e["t"] for e in run_events if e["ev"] == "done") - min(e["t"] for e in run_events)
        range_device_s = sum(float(m["cost_device_s"]) for m in _latest(instance, keys[1:]).values())
        assert range_device_s == pytest.approx(SERVERS * stub_wall, rel=0.05)

        # the forecast made from the pilot holds the measured whole, and is narrow enough to mean something
        assert report["complete"] and report["forecast"]["from_partitions"] == keys[:1]
        rows = {r["figure"]: r for r in report["forecast_vs_actual"]}
        assert set(rows) == {"device_s", "tokens_out", "generating_s"}
        for name, r in rows.items():
            assert r["within"], f"{name}: {r['actual']} outside [{r['forecast_low']}, {r['forecast_high']}]"
            assert r["forecast_high"] - r["forecast_low"] < 0.6 * r["forecast_point"], f"{name}: interval too wide"
        assert rows["tokens_out"]["actual"] == costs["completions"]["tokens_out"]
        assert (root / "cost" / "forecast_vs_actual.png").read_bytes()[:4] == b"\x89PNG"
        assert "inside" in format_comparison(report) and "OUTSIDE" not in format_comparison(report)

        # the UI: truncation_report shows the forecast, on the servers that measured, beside the cap advice
        from dflash_assets.assets.truncation import truncation_report
        from dflash_assets.stages.resources.generation import GenerationResource

        report_run = dg.materialize(
            [truncation_report],
            instance=instance,
            resources={"storage": StorageResource(root=str(root)), "generation": GenerationResource()},
        )
        shown = report_run.asset_materializations_for_node("truncation_report")[0].metadata["cost_forecast"].value
        assert f"{PROMPTS:,} prompts ({PROMPTS:,} done, 0 left)" in shown and "on 2 device(s), 8 slots" in shown

        # hidden-state storage before any extraction: the storage plan's bytes per token of the configured target
        target = tmp_path / "target"
        target.mkdir()
        (target / "config.json").write_text(json.dumps({"hidden_size": 5120, "num_hidden_layers": 64}))
        assert configured_bytes_per_token(str(target)) == 51_205
        with_target = collect_forecast(instance, PROMPTS, servers(), store, bytes_per_token=51_205)
        per_row = with_target["generation"]["tokens_per_prompt"]["point"] + tables["prompt_tokens"].sum() / PROMPTS
        assert with_target["storage_bytes"]["hidden_states"]["point"] == pytest.approx(PROMPTS * per_row * 51_205)

        # status prints the same table and forecast from the config file
        config = {
            "resources": {
                "storage": {"root": str(root)},
                "inference": {
                    "mode": "sglang",
                    "model_path": "simulated",
                    "num_servers": 7,
                    "max_running_requests": 4,
                    "launch_module": "dflash_simulators.sglang_stub",
                },
                "cost": {"device_hour_usd": 3.0},
                "target_model": {"model_path": str(target)},  # Qwen3.6-27B's shape: 5 layers x 5120 x 2 + 5 bytes
            }
        }
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
        monkeypatch.setenv("DFLASH_CONFIG", str(tmp_path / "c.yaml"))
        from dflash_assets.app.status import print_status

        print_status(instance, pilot=f"{keys[0]}...{keys[1]}")
        out = capsys.readouterr().out
        assert "== cost per stage == (price per device-hour: $3)" in out
        assert "simulated GPU-h" in out and " GPU-h" not in out.replace("simulated GPU-h", "")
        assert "from 2 measured partition(s)" in out and "on 7 device(s), 28 slots" in out
        assert "storage hidden_states" in out


def _latest(instance, keys: list[str]) -> dict[str, dict]:
    from dflash_assets.orchestration.history import latest_metadata_by_partition

    return latest_metadata_by_partition(instance, "completions", keys)


def test_mean_interval_row_and_partition_level_by_hand():
    # one partition, rows 1..5: mean 3, s^2 = 2.5, se = sqrt(2.5 / 5), t(4) = 2.776
    ys = [1.0, 2.0, 3.0, 4.0, 5.0]
    mean, half = mean_interval([(5, sum(ys), sum(y * y for y in ys))])
    assert mean == 3.0 and half == pytest.approx(2.776 * math.sqrt(0.5))
    # two partitions far apart, each with no spread inside: the between-partition se decides (df 1)
    mean, half = mean_interval([(10, 10.0, 10.0), (10, 30.0, 90.0)])
    assert mean == 2.0
    se_part = math.sqrt(((10 - 2 * 10) ** 2 + (30 - 2 * 10) ** 2) / (2 * 1)) / 10
    assert half == pytest.approx(12.706 * se_part)
    assert t975(1000) == 1.96 and t975(0) == math.inf


def test_table_prices_device_hours_and_labels_cpu_seconds():
    gpu = cost.cost_metadata(cost.GPU, 7, "7 servers x wall", 7 * 3600.0, 3600.0, 1000, 90_000)
    cpu = cost.CpuClock()
    with cpu:
        sum(i * i for i in range(200_000))
    costs = {
        "completions": _row(gpu),
        "tokenized_sequences": _row(cpu.metadata(5000)),
    }
    text = format_cost_table(costs, 2.5)
    line = next(x for x in text.splitlines() if x.startswith("completions"))
    assert "7.0000" in line and "GPU-h" in line and line.rstrip().endswith("17.50")  # 7 GPU-h x $2.5
    tok_line = next(x for x in text.splitlines() if x.startswith("tokenized_sequences"))
    assert "CPU-h" in tok_line and "GPU" not in tok_line
    assert "process CPU time" in text and 0 < cpu.cpu_s <= cpu.wall_s + 0.05
    assert format_cost_table(costs, None).splitlines()[3].split()[-1] == "-"  # no price: no money


def _row(meta: dict) -> dict:
    return {
        "device": meta["cost_device"],
        "basis": meta["cost_basis"],
        "device_s": meta["cost_device_s"],
        "wall_s": meta["cost_wall_s"],
        "tokens_in": meta["cost_tokens_in"],
        "tokens_out": meta["cost_tokens_out"],
        "tok_per_device_s": meta["cost_tok_per_device_s"],
        "materializations": 1,
    }


def test_devices_of_each_inference_mode():
    sim = InferenceServerResource(mode="sglang", num_servers=3, tp_size=2, launch_module=cost.SIMULATION_PACKAGE + ".x")
    assert cost.generation_devices(sim)[:2] == (cost.SIMULATED_GPU, 6)
    real = InferenceServerResource(mode="sglang", num_servers=7)
    assert cost.generation_devices(real)[:2] == (cost.GPU, 7)
    local = cost.generation_devices(InferenceServerResource())
    assert local[0] == cost.CPU and local[1] == cost.cpu_cores() and "cores x wall" in local[2]


def test_range_run_shares_add_up_to_devices_x_wall():
    meter = cost.GenerationMeter(cost.GPU, 7, "b")
    shares = [meter.share(t, 100.0)[0] for t in (103.0, 104.5, 110.0)]
    assert shares == [21.0, 10.5, 38.5] and sum(shares) == 7 * 10.0
    assert meter.share(120.0, None) == (0.0, 0.0)  # nothing generated: nothing charged


def test_unknown_cost_key_is_a_config_error(tmp_path, monkeypatch):
    from dflash_assets.common.config import build_resources
    from dflash_assets.stages.resources.cost import CostResource

    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"resources": {"cost": {"gpu_hour_usd": 3}}}))
    monkeypatch.setenv("DFLASH_CONFIG", str(tmp_path / "c.yaml"))
    with pytest.raises(ConfigError, match=r"resources.cost: unknown key 'gpu_hour_usd'.*device_hour_usd"):
        build_resources({"cost": CostResource})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"resources": {"cost": {"device_hour_usd": -1}}}))
    with pytest.raises(ConfigError, match=r"resources\.cost"):
        build_resources({"cost": CostResource})


def test_report_keeps_the_first_forecast_until_the_corpus_changes():
    f = {
        "prompts_total": 10,
        "prompts_left": 6,
        "completions_whole": {"device_s": {"point": 10.0, "low": 8.0, "high": 12.0}},
    }
    costs = {"completions": {"device_s": 11.0, "tokens_out": 5, "wall_s": 1.0}}
    # a forecast made when nothing is left (the end of a run) only restates the measurement: never kept
    assert build_report(None, {**f, "prompts_left": 0}, costs, prompts_done=10)["forecast"] is None
    first = build_report(None, f, costs, prompts_done=4)
    assert first["forecast_vs_actual"][0]["within"] is None  # a part is not the whole
    later = build_report(first, {**f, "completions_whole": {"device_s": {"point": 1, "low": 1, "high": 1}}}, costs, 10)
    assert (
        later["forecast"]["completions_whole"]["device_s"]["point"] == 10.0 and later["forecast_vs_actual"][0]["within"]
    )
    other = build_report(later, {**f, "prompts_total": 20}, costs, 10)
    assert other["forecast"]["prompts_total"] == 20 and other["previous_forecast"]["prompts_total"] == 10
    assert format_forecast(None).endswith("run one (a pilot) first") and REPORT == ("cost", "report.json")


def test_training_storage_and_cap_change_forecasts_scale_to_the_corpus(tmp_path):
    from dflash_assets.stages.forecast import cap_change_forecast, storage_forecast, training_forecast

    with dg.instance_for_test() as instance:
        assert training_forecast(instance, 1000, 0.1) is None  # no drafter trained yet
        drafter = {"steps": 60, "train_rows": 100, "steps_this_run": 60, "cost_wall_s": 30.0, "cost_devices": 2}
        instance.report_runless_asset_event(
            dg.AssetMaterialization("dflash_drafter", metadata={**drafter, "cost_device": "GPU"})
        )
        t = training_forecast(instance, 1000, 0.1)
        # 60 steps for 100 rows -> 600 for 1,000; 0.5 s per step; 2 trainer GPUs
        assert t["steps"] == {"point": 600.0, "low": 540.0, "high": 660.0}
        assert t["wall_s"]["point"] == 300.0 and t["device_s"]["point"] == 600.0
        # rows held out for evaluation were fed too: 60 steps for 80 + 20 rows is the same 600
        instance.report_runless_asset_event(
            dg.AssetMaterialization("dflash_drafter", metadata={**drafter, "train_rows": 80, "heldout_rows": 20})
        )
        assert training_forecast(instance, 1000, 0.1)["steps"]["point"] == 600.0
        # a fresh user's demo forecast 492 training steps under max_steps 400: a fixed schedule does not scale
        instance.report_runless_asset_event(
            dg.AssetMaterialization("dflash_drafter", metadata={**drafter, "max_steps": 400, "steps": 400})
        )
        fixed = training_forecast(instance, 1000, 0.1)
        assert fixed["steps"] == {"point": 400.0, "low": 400.0, "high": 400.0} and fixed["wall_s"]["point"] == 200.0
        instance.report_runless_asset_event(dg.AssetMaterialization("dflash_drafter", metadata=drafter))

        instance.add_dynamic_partitions("prompt_index_ranges", ["0000000-0000009"])
        instance.report_runless_asset_event(
            dg.AssetMaterialization(
                "hidden_states", partition="0000000-0000009", metadata={"bytes_per_token_expected": 51205}
            )
        )
        per_row = {"point": 3000.0, "low": 2700.0, "high": 3300.0}
        hidden = storage_forecast(instance, 902_087, per_row)["hidden_states"]
        assert hidden["point"] == pytest.approx(902_087 * 3000 * 51205)  # ~139 TB, docs' ~138 TB
        assert hidden["high"] / hidden["point"] == pytest.approx(1.1)

    report = {"rows": 100, "advice": {"candidates": [{"cap": 8192, "tokens_to_generate": 50_000.0}]}}
    (c,) = cap_change_forecast(report, 1000, 0.002)
    assert c == {"cap": 8192, "tokens_to_generate": 500_000.0, "device_s": 1000.0}
    assert cap_change_forecast(report, 1000, None) == []


def test_tokenized_and_hidden_states_record_their_cost(tmp_path, tiny_target):  # noqa: F811 (fixture imported)
    from dflash_assets.assets.hidden_states import hidden_states
    from dflash_assets.assets.tokenized import tokenized_sequences
    from dflash_assets_tests.test_tokenized import QUESTIONS, completion_row, run_stages, write_partition

    rows = [completion_row(i, " ".join(["word"] * (3 + 4 * i)) + ".") for i in QUESTIONS]
    pk = write_partition(tmp_path, QUESTIONS, rows)
    result, _, hidden = run_stages(tmp_path, pk, [tokenized_sequences, hidden_states], tiny_target)
    assert result.success
    tok = {k: v.value for k, v in result.asset_materializations_for_node("tokenized_sequences")[0].metadata.items()}
    stored = pl.read_parquet(tmp_path / "tokenized_sequences" / f"{pk}.parquet")
    assert tok["cost_device"] == cost.CPU and tok["cost_basis"] == cost.PROCESS_CPU
    assert tok["cost_tokens_in"] == int(stored["input_ids"].list.len().sum()) and tok["cost_tokens_out"] == 0
    assert tok["cost_device_s"] > 0 and tok["cost_wall_s"] > 0
    meta = {k: getattr(v, "value", v) for k, v in hidden.asset_materialization.metadata.items()}
    # on the CPU: the cores this process may use x the extraction's wall
    assert meta["cost_device"] == cost.CPU and meta["cost_devices"] == cost.cpu_cores()
    assert meta["cost_device_s"] == pytest.approx(cost.cpu_cores() * meta["wall_s"], abs=0.01)
    assert meta["cost_tokens_in"] == tok["cost_tokens_in"]


def test_training_records_processes_x_wall_and_a_reused_run_costs_nothing(tmp_path, monkeypatch):
    from dflash_assets.orchestration.partitions import prompt_ranges
    from dflash_assets.stages.forecast import training_forecast
    from dflash_assets_tests import test_drafter_identity as identity
    from dflash_assets_tests.tiny_target import make_feature_target, project_config_with_layers

    monkeypatch.setenv("DFLASH_CONFIG", str(project_config_with_layers(tmp_path / "config", [1, 3, 5])))
    target, _ = make_feature_target(tmp_path / "tiny")
    root = tmp_path / "data"
    for i, pk in enumerate(identity.KEYS):
        identity.write_partition(root, pk, seed=i)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, identity.KEYS)
        first = identity.materialize(instance, root, target)
        assert first["cost_device"] == cost.CPU and first["cost_devices"] == cost.cpu_cores()
        assert first["cost_device_s"] == pytest.approx(cost.cpu_cores() * first["cost_wall_s"], abs=0.01)
        assert first["cost_wall_s"] == pytest.approx(first["wall_s"], abs=0.06)  # wall_s: 0.1 s steps
        assert first["cost_tokens_in"] == first["train_tokens"] > 0
        # max_steps 6 fixes the schedule: 10x the rows is still 6 steps, at the measured seconds per step
        assert first["max_steps"] == 6 and first["total_steps"] == 6
        t = training_forecast(instance, 10 * first["train_rows"], 0.0)
        assert t["steps"]["point"] == pytest.approx(6.0)
        assert t["wall_s"]["point"] == pytest.approx(first["cost_wall_s"])
        again = identity.materialize(instance, root, target)
        assert again["outcome"] == "reused" and again["cost_device_s"] == 0.0


def test_evaluation_cost_engine_servers_or_the_target_device():
    engine = InferenceServerResource(mode="sglang", num_servers=2, launch_module=cost.SIMULATION_PACKAGE + ".stub")
    served = cost.evaluation_cost(object(), engine, "cpu", 10.0, {"generated_tokens": 500})
    assert (served["cost_device"], served["cost_device_s"], served["cost_tokens_out"]) == (
        cost.SIMULATED_GPU,
        20.0,
        500,
    )
    assert "while generating" not in served["cost_basis"]
    in_process = cost.evaluation_cost(None, engine, "cuda:0", 10.0)
    assert (in_process["cost_device"], in_process["cost_devices"], in_process["cost_device_s"]) == (cost.GPU, 1, 10.0)


def test_forecast_storage_lines_keep_the_stage_apart_from_its_figure():
    """The input that showed it (bench_main_job, 2026-12-03): ``storage tokenized_sequences34.47 KB``."""
    iv = {"point": 34_470, "low": 33_590, "high": 35_340}
    f = {
        "generation": {
            "tokens_to_generate": {"point": 0, "low": 0, "high": 0},
            "wall_s": {"point": 0, "low": 0, "high": 0},
            "devices": 1,
            "slots": 8,
            "startup_s": 0,
            "drain_s": 0,
        },
        "completions_whole": {"device_s": iv, "tokens_out": iv},
        "device": "CPU",
        "prompts_total": 64,
        "prompts_done": 64,
        "prompts_left": 0,
        "from_partitions": ["0000000-0000015"],
        "rows_measured": 16,
        "storage_bytes": {"completions": iv, "tokenized_sequences": iv},
        "cap_changes": [],
    }
    lines = format_forecast(f).splitlines()
    assert "storage completions        34.47 KB [33.59 KB .. 35.34 KB]" in lines
    assert "storage tokenized_sequences 34.47 KB [33.59 KB .. 35.34 KB]" in lines
    # on a CPU the count is of cores (cost.generation_devices): a fresh user read "on 2 device(s)" as two devices
    assert any(line.startswith("generation wall (left)") and " on 1 CPU core(s), 8 slots" in line for line in lines)


def _measured_completions(instance, pk: str, rows: int) -> None:
    """A completions materialization of ``pk`` as the asset records it: ``rows`` rows of 10 tokens, 1 s each."""
    meta = {
        "rows": rows,
        "cost_rows": rows,
        "cost_tokens_in": 5 * rows,
        "cost_tokens_out": 10 * rows,
        "cost_tokens_out_sq": 100 * rows,
        "cost_slot_s": 1.0 * rows,
        "cost_slot_s_sq": 1.0 * rows,
        "cost_wall_s": 1.0 * rows,
        "cost_device_s": 1.0 * rows,
        "cost_startup_s": 0.0,
        "cost_device": "CPU",
        "cost_devices": 1,
        "run_slots_capacity": 1,
    }
    instance.report_runless_asset_event(dg.AssetMaterialization("completions", partition=pk, metadata=meta))


def test_forecast_after_a_partition_size_change_counts_only_current_partitions(tmp_path):
    """Issue 40 finding 6: 64 prompts done in 4 partitions of 16, then ``partition_size: 32``: every partition
    must be generated again, yet the forecast (``status``, the truncation report) said ``64 done, 0 left``."""
    from dflash_assets.stages.forecast import corpus_prompts
    from dflash_assets_tests.test_completions_asset import write_corpus as build_corpus

    root = tmp_path / "data"
    prompts = [f"prompt {i}" for i in range(64)]
    with dg.instance_for_test() as instance:
        old_keys = build_corpus(instance, root, prompts, 16)
        assert len(old_keys) == 4
        for pk in old_keys:
            _measured_completions(instance, pk, 16)
        before = collect_forecast(instance, corpus_prompts(instance), None)
        assert (before["prompts_done"], before["prompts_left"]) == (64, 0)

        new_keys = build_corpus(instance, root, prompts, 32)  # every range cut again: no key in common
        assert len(new_keys) == 2 and not set(new_keys) & set(old_keys)
        assert corpus_prompts(instance) == 64 and rows_done(instance) == 0
        assert collect_forecast(instance, 64, None) is None  # no partition of this corpus is measured yet
        assert "no completions partition of the current corpus" in format_forecast(None)

        _measured_completions(instance, new_keys[0], 32)
        after = collect_forecast(instance, 64, None)
        assert (after["prompts_done"], after["prompts_left"]) == (32, 32)
        assert after["from_partitions"] == [new_keys[0]] and after["rows_measured"] == 32
        assert after["completions_whole"]["tokens_out"]["point"] == pytest.approx(64 * 10)
        assert "64 prompts (32 done, 32 left), from 1 measured partition(s)" in format_forecast(after)
