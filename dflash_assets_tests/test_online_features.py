"""Online target features: training with the frozen target in the loop equals training on stored shards."""

from __future__ import annotations

import json
import re
from pathlib import Path

import polars as pl
import pytest
import torch
from tiny_target import HIDDEN, LAYER_IDS, VOCAB, make_rows, make_target

from dflash_assets.dflash.shards.extraction import extract_partition
from dflash_assets.dflash.shards.format import read_index
from dflash_assets.dflash.training.config import TrainConfig
from dflash_assets.dflash.training.online import OnlineTargetFeatures, TokenizedRows, read_tokenized_rows
from dflash_assets.dflash.training.train import train

torch.set_num_threads(2)


def write_tokenized(path: Path, rows: list[dict]) -> str:
    pl.DataFrame(
        rows, schema={"index": pl.Int64, "input_ids": pl.List(pl.Int64), "loss_mask": pl.List(pl.Int64)}
    ).write_parquet(path)
    return str(path)


def cfg(target: Path, out: Path, **kw) -> TrainConfig:
    values = dict(
        shards=[],
        out_dir=str(out),
        target_model_path=str(target),
        num_hidden_layers=1,
        num_context_features=len(LAYER_IDS),
        target_layer_ids=LAYER_IDS,
        block_size=4,
        mask_token_id=VOCAB - 1,
        max_anchors=4,
        batch_size=2,
        lr=3e-3,
        max_steps=50,
        checkpoint_every=0,
        log_every=1,
        seed=5,
        device="cpu",
        eval_fraction=0.2,
        prefetch=1,
    )
    values.update(kw)
    return TrainConfig(**values)


def test_online_equals_offline_loss_curve_and_weights(tmp_path):
    """Acceptance 2: same data, seed and 50 steps; fp32 target on CPU, features rounded to bf16 both ways
    (what the shards store): max |loss difference| <= 1e-4 and the same weights within 1e-4."""
    model, target = make_target(tmp_path)
    rows = make_rows()
    # two partitions, as the drafter asset lists them: rows sorted by index within each
    parts = [rows[:6], rows[6:]]
    shards = []
    for k, part in enumerate(parts):
        out = tmp_path / f"hs-{k}"
        extract_partition(model, part, out, LAYER_IDS, rows_per_shard=4, max_tokens_per_batch=256, dtype=torch.bfloat16)
        shards += [str(out / s["name"]) for s in read_index(out)["shards"]]
    tokenized = [
        write_tokenized(tmp_path / f"tok-{k}.parquet", part[::-1]) for k, part in enumerate(parts)
    ]  # unsorted on disk

    offline = train(cfg(target, tmp_path / "offline", shards=shards, features="offline"))
    online = train(cfg(target, tmp_path / "online", features="online", tokenized=tokenized))
    assert online.summary["features"] == "online" and offline.summary["features"] == "offline"
    assert online.summary["target_forwards"] == 50  # one batched forward per step (eval uses per-row forwards apart)
    assert offline.summary["target_forwards"] == 0
    assert online.summary["train_rows"] == offline.summary["train_rows"] >= 6
    a = [r["loss"] for r in offline.records]
    b = [r["loss"] for r in online.records]
    assert len(a) == len(b) == 50
    diff = max(abs(x - y) for x, y in zip(a, b))
    print("max loss diff", diff, a[0], a[-1])
    assert diff <= 1e-4, diff
    assert a[-1] < a[0]  # it trained
    sa, sb = offline.model.state_dict(), online.model.state_dict()
    assert sa.keys() == sb.keys()
    worst = max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)
    assert worst <= 1e-4, worst
    assert abs(offline.summary["eval"]["loss"] - online.summary["eval"]["loss"]) <= 1e-4
    # a different target gives different features: the check above can fail
    other, _ = make_target(tmp_path / "other", seed=9)
    feats = OnlineTargetFeatures(other, LAYER_IDS)
    ds = TokenizedRows(read_tokenized_rows(tokenized[:1]), split="all", block_size=4, features=feats)
    from dflash_assets.dflash.shards.dataset import HiddenStateShards

    ref = HiddenStateShards(shards[:1], split="all", block_size=4)[0]["hidden_states"].float()
    assert (ds[0]["hidden_states"].float() - ref).abs().max() > 1e-2


def test_online_features_match_extractor_and_are_trainable(tmp_path):
    """Padded positions are zero, real ones equal a one-row forward, and the result can enter autograd."""
    model, _ = make_target(tmp_path)
    feats = OnlineTargetFeatures(model, LAYER_IDS, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 12))
    out = feats(ids, torch.tensor([12, 7]))
    assert out.shape == (2, 12, len(LAYER_IDS) * HIDDEN)
    assert out[1, 7:].abs().sum() == 0
    with torch.no_grad():
        hs = model(ids[1:, :7], output_hidden_states=True).hidden_states
    ref = torch.cat([hs[i + 1][0] for i in LAYER_IDS], dim=-1)
    assert torch.allclose(out[1, :7], ref, atol=1e-5)
    w = torch.nn.Parameter(torch.ones(()))
    (out * w).sum().backward()  # an inference tensor here would raise
    assert w.grad is not None
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    assert feats.forwards == 1 and feats.tokens == 19


def test_cli_online_mode_writes_summary(tmp_path):
    """``python -m dflash_assets.dflash.training.train --tokenized ...`` trains online (same entry point as
    torchrun)."""
    from dflash_assets.dflash.training.train import main

    _, target = make_target(tmp_path)
    tok = write_tokenized(tmp_path / "tok.parquet", make_rows(6))
    out = tmp_path / "cli"
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"num_context_features": 3, "max_anchors": 4, "draft_overrides": {}}))
    rc = main(
        [
            "--tokenized",
            tok,
            "--out",
            str(out),
            "--target-model",
            str(target),
            "--num-hidden-layers",
            "1",
            "--block-size",
            "4",
            "--mask-token-id",
            str(VOCAB - 1),
            "--max-steps",
            "3",
            "--device",
            "cpu",
            "--target-layer-ids",
            "1,3,5",
            "--config-json",
            str(extra),
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["features"] == "online" and summary["step"] == 3 and summary["target_forwards"] == 3


def test_online_and_offline_runs_of_the_drafter_asset_use_the_configured_layers(tmp_path, monkeypatch):
    """ops.hidden_states.config.target_layer_ids set to non-default ids: the drafter asset's training config
    (``train_config_for``) takes them for both feature sources, so online training (which runs the target
    itself) learns from the layers the offline shards store. Before, online fell back to the default ids."""
    from dflash_assets.assets.hidden_states import resolve_layer_ids
    from dflash_assets.dflash.target.layers import resolve_target_layer_ids
    from dflash_assets.stages.drafter.config import DrafterConfig
    from dflash_assets.stages.drafter.features import hidden_states_config
    from dflash_assets.stages.drafter.settings import train_config_for
    from dflash_assets.stages.resources.target_model import TargetModelResource

    configured = [0, 2, 4]
    project = tmp_path / "project.yaml"
    project.write_text(f"ops:\n  hidden_states:\n    config:\n      target_layer_ids: {configured}\n")
    monkeypatch.setenv("DFLASH_CONFIG", str(project))
    model, target_dir = make_target(tmp_path)
    assert resolve_target_layer_ids(target_dir, None, 5) != configured  # what online used to take
    # offline: hidden_states stores the layers its config resolves to
    stored = resolve_layer_ids(hidden_states_config().target_layer_ids, model)
    assert stored == configured
    rows = make_rows()
    extract_partition(
        model, rows, tmp_path / "hs", stored, rows_per_shard=4, max_tokens_per_batch=256, dtype=torch.bfloat16
    )
    shards = [str(tmp_path / "hs" / s["name"]) for s in read_index(tmp_path / "hs")["shards"]]
    tokenized = [write_tokenized(tmp_path / "tok.parquet", rows)]
    settings = DrafterConfig(
        num_hidden_layers=1,
        block_size=4,
        mask_token_id=VOCAB - 1,
        max_steps=8,
        max_anchors=4,
        batch_size=2,
        lr=3e-3,
        eval_fraction=0.0,
        checkpoint_every=0,
        seed=5,
        intermediate_size=32,
    )
    resource = TargetModelResource(model_path=str(target_dir), dtype="float32", device="cpu")
    runs = {}
    for mode in ("offline", "online"):
        cfg = train_config_for(
            settings,
            resource,
            mode=mode,
            shards=shards if mode == "offline" else [],
            tokenized=tokenized if mode == "online" else [],
            out_dir=str(tmp_path / mode),
        )
        assert cfg.target_layer_ids == configured and cfg.num_context_features == 3
        runs[mode] = train(cfg, online_target=model if mode == "online" else None)
    for result in runs.values():
        assert result.summary["draft_config"]["target_layer_ids"] == configured
        assert result.model.fc.weight.shape == (HIDDEN, 3 * HIDDEN)
    # the same layers -> the same features -> the same losses (bf16 features both ways)
    a, b = ([r["loss"] for r in runs[m].records] for m in ("offline", "online"))
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-4


def test_drafter_settings_are_checked_against_the_target_before_any_work(tmp_path, monkeypatch):
    from dflash_assets.stages.drafter.config import DrafterConfig
    from dflash_assets.stages.drafter.settings import resolved_settings
    from dflash_assets.stages.resources.target_model import TargetModelResource

    monkeypatch.setenv("DFLASH_CONFIG", str(tmp_path / "project.yaml"))
    (tmp_path / "project.yaml").write_text("ops: {}\n")
    _, target_dir = make_target(tmp_path)
    resource = TargetModelResource(model_path=str(target_dir))
    ids, overrides = resolved_settings(
        DrafterConfig(mask_token_id=VOCAB - 1, num_attention_heads=8, head_dim=4), resource
    )
    assert ids == [1, 2, 2, 2, 3] and overrides == {"num_attention_heads": 8, "head_dim": 4}  # 6 layers, default rule
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"ops.dflash_drafter.config: mask_token_id {VOCAB} is outside the target's vocabulary (vocab_size {VOCAB})"
        ),
    ):
        resolved_settings(DrafterConfig(mask_token_id=VOCAB), resource)
    with pytest.raises(
        ValueError,
        match=re.escape("ops.dflash_drafter.config: num_attention_heads 6 must be a multiple of num_key_value_heads 4"),
    ):
        resolved_settings(DrafterConfig(num_attention_heads=6, num_key_value_heads=4), resource)
    (tmp_path / "project.yaml").write_text("ops:\n  hidden_states:\n    config:\n      target_layer_ids: [1, 6]\n")
    with pytest.raises(
        ValueError, match=r"ops.hidden_states.config.target_layer_ids: target_layer_ids \[6\] are outside 0..5"
    ):
        resolved_settings(DrafterConfig(), resource)
