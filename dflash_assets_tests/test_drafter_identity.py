"""Issue 17 acceptance 1 and 2 at the asset level: the drafter's run id follows its training data by content.

A tiny synthetic target (config + embedding/LM head, see ``tiny_target.make_feature_target``) and
hand-written hidden-state partitions (shards + index.json in the hidden_states layout) stand in for the
upstream stages, so every case trains for seconds: first materialization trains; the same data again is
reused without a training step; an interrupted run resumes at its checkpoint; changed shard content trains
again (new weights); ``warm_start`` starts from the last export, whose loss the first step reproduces.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import dagster as dg
import pytest
import torch

from dflash_assets.assets.drafter import dflash_drafter
from dflash_assets.dflash.export.directory import export_drafter, load_exported
from dflash_assets.dflash.model.draft_model import load_target_head
from dflash_assets.dflash.shards.dataset import HiddenStateShards
from dflash_assets.dflash.shards.format import INDEX_NAME
from dflash_assets.dflash.training.batches import StepPlan, build_batch
from dflash_assets.dflash.training.held_out import batch_loss
from dflash_assets.dflash.training.train import train
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.drafter.identity import STATE_FILE, file_sha256
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets_tests.tiny_target import (
    HIDDEN,
    N_FEATS,
    VOCAB,
    make_feature_target,
    tiny_train_config,
    write_rows_shard,
)

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _project_layers(tmp_path, monkeypatch):
    """The partitions below store layers [1, 3, 5]: the project config says so (the drafter resolves them there)."""
    from dflash_assets_tests.tiny_target import project_config_with_layers

    monkeypatch.setenv("DFLASH_CONFIG", str(project_config_with_layers(tmp_path / "config", [1, 3, 5])))


KEYS = ["0-9", "10-19"]
CONFIG = {
    "num_hidden_layers": 1,
    "block_size": 4,
    "mask_token_id": VOCAB - 1,
    "max_steps": 6,
    "checkpoint_every": 3,
    "batch_size": 2,
    "max_anchors": 6,
    "intermediate_size": 64,
    "eval_fraction": 0.0,
    "lr": 0.01,
    "seed": 3,
}


def write_partition(root: Path, pk: str, seed: int) -> None:
    """One hidden-state partition: a shard of 5 random rows and a complete index.json naming its content hash."""
    g = torch.Generator().manual_seed(seed)
    d = root / "hidden_states" / pk
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in range(5):
        t = 24 + 3 * r
        mask = torch.zeros(t, dtype=torch.int8)
        mask[8:] = 1
        rows.append(
            {
                "input_ids": torch.randint(0, VOCAB - 1, (t,), generator=g),
                "loss_mask": mask,
                "hidden_states": torch.randn(t, N_FEATS * HIDDEN, generator=g),
            }
        )
    shard = write_rows_shard(
        d / "shard-00000.safetensors", rows, list(range(5)), metadata={"target_layer_ids": "[1, 3, 5]"}
    )
    sha = hashlib.sha256(shard.read_bytes()).hexdigest()
    (d / INDEX_NAME).write_text(
        json.dumps(
            {
                "complete": True,
                "target_layer_ids": [1, 3, 5],
                "shards": [{"name": shard.name, "bytes": shard.stat().st_size, "rows_sha256": sha}],
            }
        )
    )


def materialize(instance, root: Path, target: Path, **overrides) -> dict:
    resources = {
        "storage": StorageResource(root=str(root)),
        "target_model": TargetModelResource(model_path=str(target)),
    }
    result = dg.materialize(
        [dflash_drafter],
        instance=instance,
        resources=resources,
        run_config={"ops": {"dflash_drafter": {"config": {**CONFIG, **overrides}}}},
    )
    assert result.success
    mat = result.asset_materializations_for_node("dflash_drafter")[-1]
    meta = {k: getattr(v, "value", v) for k, v in mat.metadata.items()}
    meta["data_version"] = mat.tags.get("dagster/data_version")
    return meta


def test_drafter_trains_reuses_resumes_and_retrains_when_its_data_changes(tmp_path):
    target, _ = make_feature_target(tmp_path / "tiny")
    root = tmp_path / "data"
    for i, pk in enumerate(KEYS):
        write_partition(root, pk, seed=i)
    export = root / "dflash_drafter" / "export" / "model.safetensors"
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, KEYS)
        first = materialize(instance, root, target)
        assert (first["outcome"], first["steps_this_run"], first["steps"]) == ("trained", 6, 6)
        assert first["outcome_text"] == f"trained 6 steps on {first['train_tokens']} tokens"
        run_dir = root / "dflash_drafter" / "runs" / first["run_id"]
        log_before = (run_dir / "train_log.jsonl").read_text()
        sha_first = file_sha256(str(export))

        again = materialize(instance, root, target)  # nothing changed
        assert (again["outcome"], again["steps_this_run"], again["run_id"]) == ("reused", 0, first["run_id"])
        assert again["outcome_text"].startswith("reused because nothing changed")
        assert (run_dir / "train_log.jsonl").read_text() == log_before  # no training step was logged
        assert file_sha256(str(export)) == sha_first and again["data_version"] == first["data_version"]

        # an interrupted run: the last checkpoint is step 3, the export not yet written -> resume at step 3
        (run_dir / "checkpoints" / "step_00000006.pt").unlink()
        (run_dir / "checkpoints" / "latest.json").write_text(json.dumps({"file": "step_00000003.pt", "step": 3}))
        state_path = root / "dflash_drafter" / STATE_FILE
        state_path.write_text(json.dumps(dict(json.loads(state_path.read_text()), complete=False)))
        resumed = materialize(instance, root, target)
        assert (resumed["outcome"], resumed["resumed_from_step"], resumed["steps_this_run"]) == ("resumed", 3, 3)
        assert resumed["outcome_text"].startswith("resumed at step 3 of the same run")
        assert file_sha256(str(export)) == sha_first  # same seed, same data: the same weights as uninterrupted

        write_partition(root, KEYS[1], seed=7)  # new content in one partition (e.g. a cap raise regenerated rows)
        changed = materialize(instance, root, target)
        assert (changed["outcome"], changed["steps_this_run"]) == ("trained", 6)
        assert changed["run_id"] != first["run_id"] and changed["data_fingerprint"] != first["data_fingerprint"]
        assert changed["warm_start_from"] is None
        assert file_sha256(str(export)) != sha_first and changed["data_version"] != first["data_version"]

        sha_changed = file_sha256(str(export))
        write_partition(root, KEYS[0], seed=8)
        warm = materialize(instance, root, target, warm_start=True)
        assert warm["outcome"] == "trained" and warm["warm_start_from"] == sha_changed
        warm_again = materialize(instance, root, target, warm_start=True)  # its own export must not restart it
        assert (warm_again["outcome"], warm_again["run_id"]) == ("reused", warm["run_id"])


def test_warm_start_first_step_loss_equals_the_first_exports_loss_on_that_batch(tmp_path):
    """Acceptance 2: the second training starts from the first export (not from a random init)."""
    target, shards = make_feature_target(tmp_path / "a")
    first = train(tiny_train_config(target, shards, tmp_path / "run_a", max_steps=10))
    export = export_drafter(first.model, tmp_path / "export")
    g = torch.Generator().manual_seed(11)
    new_shards = []
    for s in range(2):
        rows = [
            {
                "input_ids": torch.randint(0, VOCAB - 1, (28,), generator=g),
                "loss_mask": torch.ones(28, dtype=torch.int8),
                "hidden_states": torch.randn(28, N_FEATS * HIDDEN, generator=g),
            }
            for _ in range(4)
        ]
        new_shards.append(
            str(write_rows_shard(tmp_path / f"new-{s}.safetensors", rows, [100 + 4 * s + r for r in range(4)]))
        )
    cfg = tiny_train_config(target, new_shards, tmp_path / "run_b", max_steps=3, init_from=str(export))
    second = train(cfg)
    first_loss = second.records[0]["loss"]

    # the export's loss on the batch of step 0 of the second run, computed apart from train()
    reloaded = load_exported(export)
    embed, head = load_target_head(str(target))
    reloaded.attach_target(embed, head)
    dataset = HiddenStateShards(
        new_shards, split="train", eval_fraction=0.0, max_length=cfg.max_length, block_size=cfg.block_size
    )
    epoch, rows = StepPlan(len(dataset), 1, cfg.batch_size, cfg.seed).rows(0, 0)
    batch = build_batch(dataset, rows, epoch, cfg.seed, cfg.block_size, cfg.max_anchors, cfg.mask_token_id)
    with torch.no_grad():
        expected = float(batch_loss(reloaded, reloaded, batch, cfg.loss_gamma)["loss"])
    assert abs(first_loss - expected) < 1e-4 * max(1.0, abs(expected)), (first_loss, expected)
    # and not what a random init gives on the same batch
    scratch = train(tiny_train_config(target, new_shards, tmp_path / "run_c", max_steps=1))
    assert abs(scratch.records[0]["loss"] - expected) > 0.05
