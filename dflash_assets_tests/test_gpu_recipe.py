"""The GPU config's drafter is the published Qwen3.6-27B recipe (TARGET.md, SpecForge
``configs/qwen3.6-27b-dflash.json``), built the way the drafter asset builds it, against a target directory
holding Qwen3.6-27B's text config (no weights: only ``config.json`` is read).

Known from the source, not computed by the code under test: 5 draft layers, 4 sliding (window 2,048) + 1 full,
32 heads / 8 KV heads / head_dim 128, FFN 17,408, hidden 5,120 (the target's), ``mask_token_id`` 248,070,
block size 16, target layers [1, 16, 31, 46, 61] for a 64-layer target.
"""

from __future__ import annotations

import json

import yaml

from dflash_assets.common.config import BUNDLED

GPU_CONFIG = BUNDLED / "gpu_qwen36_27b.yaml"


def qwen36_27b_target(path):
    """A target directory whose config.json is Qwen3.6-27B's wrapper + text config (TARGET.md figures)."""
    path.mkdir()
    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * 16
    text = {
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 64,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "vocab_size": 248320,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "layer_types": layer_types,
        "rope_theta": 10_000_000,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
    }
    (path / "config.json").write_text(
        json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text})
    )
    return path


def test_gpu_config_drafter_is_the_published_recipe(tmp_path, monkeypatch):
    from dflash_assets.dflash.export.directory import hf_config_dict
    from dflash_assets.dflash.export.sglang_check import check_dflash_export
    from dflash_assets.dflash.model.draft_config import DFlashConfig
    from dflash_assets.dflash.target.layers import text_config
    from dflash_assets.stages.drafter.config import DrafterConfig
    from dflash_assets.stages.drafter.settings import resolved_settings
    from dflash_assets.stages.resources.target_model import TargetModelResource

    monkeypatch.setenv("DFLASH_CONFIG", str(GPU_CONFIG))
    ops = yaml.safe_load(GPU_CONFIG.read_text())["ops"]
    config = DrafterConfig(**ops["dflash_drafter"]["config"])
    target_dir = qwen36_27b_target(tmp_path / "Qwen3.6-27B")
    layer_ids, overrides = resolved_settings(config, TargetModelResource(model_path=str(target_dir), device="cpu"))
    assert layer_ids == [1, 16, 31, 46, 61]
    draft = DFlashConfig.from_target_config(
        text_config(target_dir),
        mask_token_id=config.mask_token_id,
        num_hidden_layers=config.num_hidden_layers,
        target_layer_ids=layer_ids,
        block_size=config.block_size,
        **overrides,
    )
    exported = hf_config_dict(draft)
    assert (exported["num_attention_heads"], exported["num_key_value_heads"], exported["head_dim"]) == (32, 8, 128)
    assert (exported["hidden_size"], exported["intermediate_size"], exported["vocab_size"]) == (5120, 17408, 248320)
    assert exported["num_hidden_layers"] == 5 and exported["num_target_layers"] == 64
    assert exported["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    assert exported["sliding_window"] == 2048
    assert exported["dflash_config"] == {
        "mask_token_id": 248070,
        "target_layer_ids": [1, 16, 31, 46, 61],
        "block_size": 16,
    }
    # SGLang's loader rules on this config.json and the target (the weights file is not written: ~3 GB)
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    (export_dir / "config.json").write_text(json.dumps(exported))
    check = check_dflash_export(export_dir, target_dir=target_dir, num_draft_tokens=16)
    assert [r for r in check.refusals if not r.startswith("model.safetensors unreadable")] == []
