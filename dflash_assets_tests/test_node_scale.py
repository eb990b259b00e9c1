"""Node-scale generation against the GPU-node simulator (``dflash_simulators.sglang_stub``, real
processes speaking HTTP on 127.0.0.x): a partition range is one run with one server start, each
partition is committed (table + its own materialization and data version) before the run ends, a
server killed or hung mid-run loses and duplicates no row, and external mode balances two "nodes".

The simulator stands in only for what cannot run here (GPU servers' start-up, slots and decode time);
the asset, client, journal and Dagster are the real ones. Time-compressed so each test takes seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import dagster as dg
import httpx
import polars as pl
import pytest
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from dflash_assets.assets.completions import completions
from dflash_assets.generation.processes.ports import free_port, free_port_block
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets_tests.test_completions_asset import write_corpus

STUB = "dflash_simulators.sglang_stub"
# 60 simulated s of start-up, median 120 tokens at 87.5 tok/s per slot, 50x faster than real
SIM = ["--sim-startup-s", "60", "--sim-median-tokens", "120", "--sim-sigma", "0.5", "--sim-speed", "50"]


def sim_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        *SIM,
        "--sim-starts-file",
        str(tmp_path / "starts.txt"),
        "--sim-request-log",
        str(tmp_path / "requests.jsonl"),
        *extra,
    ]


def requests_log(tmp_path: Path, ev: str = "recv", port: int | None = None) -> Counter:
    """Corpus prompts the simulated servers received (``recv``) or finished (``done``); probes excluded."""
    path = tmp_path / "requests.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return Counter(
        e["key"]
        for e in map(json.loads, lines)
        if e["ev"] == ev and e["key"].startswith("prompt") and (port is None or e["port"] == port)
    )


def starts(tmp_path: Path) -> list[str]:
    path = tmp_path / "starts.txt"
    return path.read_text().splitlines() if path.exists() else []


def range_materialize(instance, root: Path, keys: list[str], inference, cap: int = 4096, raise_on_error: bool = True):
    return dg.materialize(
        [completions],
        instance=instance,
        raise_on_error=raise_on_error,
        tags={ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]},
        resources={
            "storage": StorageResource(root=str(root)),
            "inference": inference,
            "target_model": TargetModelResource(),
            "generation": GenerationResource(max_output_tokens=cap, temperature=0.6),
        },
    )


def sglang_sim(tmp_path: Path, num_servers: int, slots: int, *extra: str, **fields) -> InferenceServerResource:
    return InferenceServerResource(
        mode="sglang",
        model_path=fields.pop("model_path", "simulated"),
        num_servers=num_servers,
        max_running_requests=slots,
        port_base=free_port_block(num_servers),
        launch_module=STUB,
        extra_args=sim_args(tmp_path, *extra),
        startup_timeout_s=60.0,
        backoff_base_s=0.05,
        **fields,
    )


def latest(instance, pk: str):
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=[pk]), limit=10
    ).records
    return records


def table(root: Path, pk: str) -> pl.DataFrame:
    return pl.read_parquet(root / "completions" / f"{pk}.parquet")


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_SERVER_REGISTRY", str(tmp_path / "registry"))


def test_range_is_one_run_one_start_each_partition_committed_with_own_data_version(tmp_path, registry):
    root = tmp_path / "data"
    prompts = [f"prompt {i}" for i in range(24)]
    with dg.instance_for_test() as instance:
        keys = write_corpus(instance, root, prompts, partition_size=6)
        assert len(keys) == 4
        result = range_materialize(instance, root, keys, sglang_sim(tmp_path, 2, 3))
        assert result.success
        run = instance.get_run_record_by_id(result.run_id)
        assert len(starts(tmp_path)) == 2  # one start per server for the four partitions

        for pk in keys:
            records = latest(instance, pk)
            assert len(records) == 1, f"{pk}: {len(records)} materializations (one expected, none at the end)"
            record = records[0]
            assert record.run_id == result.run_id
            assert record.timestamp < run.end_time  # committed while the run went on
            frame = table(root, pk)
            assert frame.height == 6 and frame["index"].n_unique() == 6
            expected = hashlib.sha256((root / "completions" / f"{pk}.parquet").read_bytes()).hexdigest()[:20]
            version = instance.get_latest_data_version_record(dg.AssetKey("completions"), partition_key=pk)
            assert version.asset_materialization.tags["dagster/data_version"] == expected
            meta = {k: getattr(v, "value", v) for k, v in record.asset_materialization.metadata.items()}
            assert meta["rows"] == 6 and meta["requested"] == 6 and meta["run_rows_total"] == 24
            assert meta["run_slots_capacity"] == 6
        # commits come in partition order as each one's last row lands, not all at the end
        stamps = [latest(instance, pk)[0].timestamp for pk in keys]
        assert stamps == sorted(stamps)
        versions = {latest(instance, pk)[0].asset_materialization.tags["dagster/data_version"] for pk in keys}
        assert len(versions) == 4
        assert sum(requests_log(tmp_path).values()) == 24

        # the same range again: nothing to request, no server start, no new materialization
        again = range_materialize(instance, root, keys, sglang_sim(tmp_path, 2, 3))
        assert again.success
        assert len(starts(tmp_path)) == 2
        assert all(len(latest(instance, pk)) == 1 for pk in keys)

        # one partition alone still works (single-partition run of the same asset)
        (root / "completions" / f"{keys[1]}.parquet").unlink()
        single = dg.materialize(
            [completions],
            instance=instance,
            partition_key=keys[1],
            resources={
                "storage": StorageResource(root=str(root)),
                "inference": sglang_sim(tmp_path, 1, 3),
                "target_model": TargetModelResource(),
                "generation": GenerationResource(max_output_tokens=4096, temperature=0.6),
            },
        )
        assert single.success and len(latest(instance, keys[1])) == 2 and table(root, keys[1]).height == 6


def test_downstream_sees_the_partition_data_version(tmp_path, registry):
    """tokenized_sequences[pk] records completions[pk]'s own data version as its input version."""
    from dflash_assets.assets.tokenized import tokenized_sequences
    from dflash_assets.stages.resources.target_model import TargetModelResource

    root = tmp_path / "data"
    with dg.instance_for_test() as instance:
        keys = write_corpus(instance, root, [f"q {i}" for i in range(6)], partition_size=3)
        inference = sglang_sim(tmp_path, 1, 4, "--sim-median-tokens", "20")
        resources = {
            "storage": StorageResource(root=str(root)),
            "inference": inference,
            "generation": GenerationResource(max_output_tokens=64, temperature=0.6),
            "target_model": TargetModelResource(),
        }  # the local model's tokenizer
        assert range_materialize(instance, root, keys, inference, cap=64).success
        result = dg.materialize(
            [completions, tokenized_sequences],
            selection=["tokenized_sequences"],
            instance=instance,
            partition_key=keys[1],
            resources=resources,
            run_config={"ops": {"tokenized_sequences": {"config": {"truncated": "keep"}}}},
            raise_on_error=False,
        )
        # the simulator's text ("t t t ...") fails the degenerate-text check, which runs after the
        # materialization is recorded: the provenance under test is there either way
        assert result.asset_materializations_for_node("tokenized_sequences")
        record = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("tokenized_sequences"), asset_partitions=[keys[1]]), limit=1
        ).records[0]
        upstream = latest(instance, keys[1])[0].asset_materialization.tags["dagster/data_version"]
        other = latest(instance, keys[0])[0].asset_materialization.tags["dagster/data_version"]
        assert other != upstream
        # Dagster records a partitioned input's version as sha256 over the versions of the upstream
        # partitions it reads (data_version_cache.py): here the one partition, completions[pk]
        seen = record.asset_materialization.tags["dagster/input_data_version/completions"]
        assert seen == hashlib.sha256(upstream.encode()).hexdigest()
        assert seen != hashlib.sha256(other.encode()).hexdigest()


def _stub_pids(tmp_path: Path) -> list[int]:
    return [int(line.split("pid=")[1].split()[0]) for line in starts(tmp_path)]


def test_server_killed_mid_run_rows_rerouted_once_each_and_server_restarted(tmp_path, registry):
    root = tmp_path / "data"
    prompts = [f"prompt {i}" for i in range(120)]
    with dg.instance_for_test() as instance:
        keys = write_corpus(instance, root, prompts, partition_size=40)
        killed: list[int] = []

        def killer() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and sum(requests_log(tmp_path, "done").values()) < 5:
                time.sleep(0.05)
            pid = _stub_pids(tmp_path)[0]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        result = range_materialize(
            instance,
            root,
            keys,
            sglang_sim(tmp_path, 3, 3, "--sim-median-tokens", "600", "--sim-sigma", "0.3", "--sim-speed", "20"),
        )
        thread.join()
        assert result.success and killed
        frames = pl.concat([table(root, pk) for pk in keys])
        assert sorted(frames["index"].to_list()) == list(range(120))  # every row, none twice
        assert frames["error"].null_count() == 120
        assert len(starts(tmp_path)) == 4  # three starts and one restart
        faults = [
            f
            for pk in keys
            for f in dict(latest(instance, pk)[0].asset_materialization.metadata)
            .get("server_faults", dg.MetadataValue.json([]))
            .value
        ]
        assert any("process exited with code -9" in f for f in faults), faults
        done = requests_log(tmp_path, "done")
        assert all(n == 1 for n in done.values())  # no prompt generated to the end twice


def _start_stub(tmp_path: Path, host: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port(host)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            STUB,
            "--host",
            host,
            "--port",
            str(port),
            "--max-running-requests",
            "2",
            *sim_args(tmp_path, "--sim-startup-s", "0", *extra),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://{host}:{port}/health", timeout=1).status_code == 200:
                return proc, f"http://{host}:{port}/v1"
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"stub on {host}:{port} did not start")


@pytest.fixture
def stubs(tmp_path):
    procs = []

    def start(host: str, *extra: str) -> str:
        proc, url = _start_stub(tmp_path, host, *extra)
        procs.append(proc)
        return url

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def external(urls: list[str], **fields) -> InferenceServerResource:
    return InferenceServerResource(
        mode="external",
        base_urls=urls,
        served_model_name="simulated",
        external_backend="sglang",
        max_running_requests=2,
        backoff_base_s=0.05,
        startup_timeout_s=10.0,
        **fields,
    )


def test_hung_server_detected_its_rows_go_to_the_others(tmp_path, stubs, registry):
    root = tmp_path / "data"
    prompts = [f"prompt {i}" for i in range(30)]
    healthy = stubs("127.0.0.1")
    hung = stubs("127.0.0.1", "--sim-hang-after", "3")  # /health stays 200, requests stop finishing
    with dg.instance_for_test() as instance:
        keys = write_corpus(instance, root, prompts, partition_size=15)
        started = time.monotonic()
        result = range_materialize(
            instance, root, keys, external([healthy, hung], stall_timeout_s=2.0, server_retry_s=60.0)
        )
        assert result.success
        assert time.monotonic() - started < 60
        frames = pl.concat([table(root, pk) for pk in keys])
        assert sorted(frames["index"].to_list()) == list(range(30))
        assert frames["error"].null_count() == 30
        servers = Counter(frames["server"].to_list())
        finished_by_hung = sum(requests_log(tmp_path, "done", port=int(hung.rsplit(":", 1)[1].split("/")[0])).values())
        assert 1 <= finished_by_hung < 3  # the start-up probe was its first finished request
        assert servers[hung] == finished_by_hung  # what it finished before hanging; the rest from the healthy one
        assert servers[healthy] == 30 - finished_by_hung
        faults = [
            f
            for pk in keys
            for f in dict(latest(instance, pk)[0].asset_materialization.metadata)
            .get("server_faults", dg.MetadataValue.json([]))
            .value
        ]
        assert any(hung in f and "hung" in f for f in faults), faults


def test_external_two_nodes_balanced_by_in_flight_rows_record_server(tmp_path, stubs, registry):
    root = tmp_path / "data"
    node_a = [stubs("127.0.0.1"), stubs("127.0.0.1")]
    node_b = [stubs("127.0.0.2"), stubs("127.0.0.2")]
    prompts = [f"prompt {i}" for i in range(80)]
    with dg.instance_for_test() as instance:
        keys = write_corpus(instance, root, prompts, partition_size=40)
        result = range_materialize(instance, root, keys, external(node_a + node_b))
        assert result.success
        frames = pl.concat([table(root, pk) for pk in keys])
        assert sorted(frames["index"].to_list()) == list(range(80))
        servers = Counter(frames["server"].to_list())
        assert set(servers) == set(node_a + node_b)
        assert all(12 <= n <= 28 for n in servers.values()), servers  # 20 each when perfectly balanced
        received = requests_log(tmp_path)
        assert sum(received.values()) == 80 and all(n == 1 for n in received.values())


def test_sglang_mode_with_an_api_key_keeps_it_out_of_every_file(tmp_path, registry, monkeypatch):
    """The simulated servers print their arguments, key included, as SGLang prints its ServerArgs at
    start-up; after a run the key is in no file under the run's storage, logs or instance."""
    key = "sk-node-scale-THE-SECRET-42"
    root, home = tmp_path / "data", tmp_path / "home"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        keys = write_corpus(instance, root, [f"prompt {i}" for i in range(6)], partition_size=3)
        inference = sglang_sim(tmp_path, 2, 3, api_key=key)
        assert range_materialize(instance, root, keys, inference).success
    logs = sorted(tmp_path.rglob("sglang_*.log"))
    assert logs and all("server_args=" in p.read_text() and "'***'" in p.read_text() for p in logs)
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert leaks == []
