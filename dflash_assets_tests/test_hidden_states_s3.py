"""Offline features on S3 (moto server): shards written on one machine are downloaded, never recomputed,
on a fresh one (target forwards counted), and verified by size and SHA-256 from index.json."""

from __future__ import annotations

import hashlib
from pathlib import Path

import dagster as dg
import polars as pl

from dflash_assets.assets.drafter import dflash_drafter
from dflash_assets.assets.hidden_states import hidden_states
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.drafter.run import EXPORT_DIR
from dflash_assets.stages.prompts import CORPUS_FILE
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets.stages.tokenized import tokenized_file
from dflash_assets_tests.checked_events import report_checked

try:
    from dflash_assets_tests.s3_fixtures import moto_server, s3_env, s3_target
    from dflash_assets_tests.tiny_target import LAYER_IDS, VOCAB, make_rows, make_target, project_config_with_layers
except ImportError:
    from s3_fixtures import moto_server, s3_env, s3_target  # type: ignore[no-redef]  # noqa: F401
    from tiny_target import LAYER_IDS, VOCAB, make_rows, make_target, project_config_with_layers  # type: ignore[no-redef]

PK = "0000000-0000011"


class Counter:
    """Counts forward passes of every target model TargetModelResource loads."""

    def __init__(self) -> None:
        self.forwards = 0

    def install(self, monkeypatch) -> None:
        original = TargetModelResource.load_model

        def load_model(resource):
            model = original(resource)
            model.model.register_forward_pre_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))
            return model

        monkeypatch.setattr(TargetModelResource, "load_model", load_model)


def machine(target, scratch: Path) -> StorageResource:
    """One "machine": the shared bucket, its own empty local scratch disk."""
    return StorageResource(
        root=target.root,
        scratch_dir=str(scratch),
        endpoint_url=target.endpoint_url,
        region="us-east-1",
        aws_access_key_id=dg.EnvVar("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=dg.EnvVar("AWS_SECRET_ACCESS_KEY"),
        retry_attempts=2,
        retry_backoff_s=0.1,
    )


def test_fresh_machine_downloads_shards_instead_of_recomputing(s3_target, tmp_path, monkeypatch):
    # the project config names the layers: hidden_states (below, also by run config) and the drafter resolve the same
    monkeypatch.setenv("DFLASH_CONFIG", str(project_config_with_layers(tmp_path / "config", LAYER_IDS)))
    _, target_dir = make_target(tmp_path)
    target = TargetModelResource(model_path=str(target_dir), dtype="float32", device="cpu")
    counter = Counter()
    counter.install(monkeypatch)
    a = machine(s3_target, tmp_path / "machine-a")
    store = a.process_config_and_initialize().open()
    # rows name their prompt (prompt_hash), and the corpus has those prompts at their indexes: all are extracted
    rows = [{**r, "prompt_hash": f"h{r['index']}"} for r in make_rows(12, first_index=0)]
    store.write_parquet(
        pl.DataFrame({"index": list(range(12)), "content_hash": [f"h{i}" for i in range(12)]}), *CORPUS_FILE
    )
    store.write_parquet(pl.DataFrame(rows), *tokenized_file(PK))
    hs_config = {"ops": {"hidden_states": {"config": {"target_layer_ids": LAYER_IDS, "rows_per_shard": 5}}}}
    with dg.instance_for_test() as instance:  # stands for the shared (Postgres) instance
        instance.add_dynamic_partitions(prompt_ranges.name, [PK])
        report_checked(  # its blocking checks passed: the drafter trains on what follows from it
            instance, "tokenized_sequences", PK, {"rows": 12, "total_tokens": sum(len(r["input_ids"]) for r in rows)}
        )

        def run_hidden_states(storage):
            result = dg.materialize(
                [hidden_states],
                instance=instance,
                partition_key=PK,
                run_config=hs_config,
                resources={"storage": storage, "target_model": target},
            )
            return result.asset_materializations_for_node("hidden_states")[0].metadata

        first = run_hidden_states(a)
        assert counter.forwards > 0 and first["shards_written"].value == 3
        index = store.read_json("hidden_states", PK, "index.json")
        remote = {
            s["name"]: hashlib.sha256(store.read_bytes("hidden_states", PK, s["name"])).hexdigest()
            for s in index["shards"]
        }
        assert {s["name"]: s["sha256"] for s in index["shards"]} == remote  # index hashes = the stored files

        # machine B, empty scratch: hidden_states again -> downloaded and kept, zero target forwards
        counter.forwards = 0
        b_dir = tmp_path / "machine-b"
        second = run_hidden_states(machine(s3_target, b_dir))
        assert counter.forwards == 0
        assert (
            second["shards_downloaded"].value == 3
            and second["shards_kept"].value == 3
            and second["shards_written"].value == 0
        )
        local = sorted(b_dir.rglob("shard-*.safetensors"))
        assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in local} == remote

        # machine C, empty scratch: the drafter trains offline from downloaded shards, never runs the target
        c_dir = tmp_path / "machine-c"
        drafter_config = {
            "ops": {
                "dflash_drafter": {
                    "config": {
                        "features": "offline",
                        "num_hidden_layers": 1,
                        "block_size": 4,
                        "mask_token_id": VOCAB - 1,
                        "max_steps": 2,
                        "max_anchors": 4,
                        "eval_fraction": 0.0,
                        "checkpoint_every": 0,
                        "intermediate_size": 32,
                    }
                }
            }
        }
        result = dg.materialize(
            [dflash_drafter],
            instance=instance,
            run_config=drafter_config,
            resources={"storage": machine(s3_target, c_dir), "target_model": target},
        )
        meta = result.asset_materializations_for_node("dflash_drafter")[0].metadata
        assert meta["features"].value == "offline" and meta["target_forwards"].value == 0
        assert counter.forwards == 0
        assert sorted(p.name for p in c_dir.rglob("shard-*.safetensors")) == sorted(remote)
        assert store.exists(*EXPORT_DIR, "model.safetensors")

        # a stored shard altered in place (same size): a fresh machine refuses it instead of training on it
        name = index["shards"][0]["name"]
        data = bytearray(store.read_bytes("hidden_states", PK, name))
        data[-1] ^= 0xFF
        store.write_bytes(bytes(data), "hidden_states", PK, name)
        bad = dg.materialize(
            [dflash_drafter],
            instance=instance,
            run_config=drafter_config,
            raise_on_error=False,
            resources={"storage": machine(s3_target, tmp_path / "machine-d"), "target_model": target},
        )
        assert not bad.success
        text = "\n".join(e.step_failure_data.error.message for e in bad.all_events if e.is_step_failure)
        assert f"hidden_states/{PK}/{name}" in text and "sha256" in text
        assert not list((tmp_path / "machine-d").rglob(name))  # the bad copy was deleted

        # online on a fresh machine: tokenized rows downloaded, features computed, no shard fetched
        online_config = {
            "ops": {
                "dflash_drafter": {
                    "config": {**drafter_config["ops"]["dflash_drafter"]["config"], "features": "online"}
                }
            }
        }
        e_dir = tmp_path / "machine-e"
        result = dg.materialize(
            [dflash_drafter],
            instance=instance,
            run_config=online_config,
            resources={"storage": machine(s3_target, e_dir), "target_model": target},
        )
        meta = result.asset_materializations_for_node("dflash_drafter")[0].metadata
        assert meta["features"].value == "online" and meta["target_forwards"].value == 2  # one per step
        assert not list(e_dir.rglob("shard-*.safetensors")) and list(e_dir.rglob(f"{PK}.parquet"))
