"""Issue 48: a drafter initialised from its target's last decoder layers (``init_from_target``).

Checked against the target itself, not against the code's own arithmetic: after the init, draft layer 0's values
over the context are the values the target's first copied layer computes from the same features (captured with a
hook on the target's ``v_proj``), and the copied tensors are the target's.
"""

from __future__ import annotations

import pytest
import torch

from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.model.draft_model import DFlashDraftModel, load_target_head
from dflash_assets.dflash.model.target_init import init_from_target_layers
from dflash_assets_tests.tiny_target import make_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, _ = make_target(tmp_path_factory.mktemp("tiny_source"), layers=8, vocab=64)
    with torch.no_grad():  # norms away from 1, so that copying them is visible
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return path, model


def _drafter(model, layers=2, **overrides) -> DFlashDraftModel:
    cfg = DFlashConfig.from_target_config(
        model.config, mask_token_id=63, num_hidden_layers=layers, target_layer_ids=[1, 3, 5], block_size=4, **overrides
    )
    d = DFlashDraftModel(cfg)
    d.reset_parameters(seed=0)
    return d


def test_context_values_of_draft_layer_0_are_the_target_layers(tiny):
    """Features of layers [1, 3, 5] of an 8-layer target, 2 draft layers: copies of layers 6 and 7, fc passing layer
    5's output (slot 2), hidden_norm = layer 6's input norm. Draft layer 0's values over the context equal target
    layer 6's value states for the same tokens."""
    path, model = tiny
    drafter = _drafter(model)
    report = init_from_target_layers(drafter, path)
    assert report["source_layers"] == [6, 7] and report["feature_layer"] == 5 and report["feature_slot"] == 2
    assert not report["skipped"] or set(report["skipped"]) == {
        f"layers.{j}.self_attn.{n}_norm.weight" for j in (0, 1) for n in "qk"
    }  # a Llama target has no q/k norms: they stay at ones
    ids = torch.randint(0, 63, (1, 11), generator=torch.Generator().manual_seed(2))
    captured = {}
    hook = model.model.layers[6].self_attn.v_proj.register_forward_hook(lambda m, a, out: captured.setdefault("v", out))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    hook.remove()
    feats = torch.cat([out.hidden_states[i + 1] for i in (1, 3, 5)], dim=-1)
    with torch.no_grad():
        context = drafter.project_context(feats)
        values = drafter.layers[0].self_attn.v_proj(context)
    torch.testing.assert_close(values, captured["v"], rtol=1e-5, atol=1e-5)
    for name in ("q_proj", "o_proj"):
        torch.testing.assert_close(
            getattr(drafter.layers[1].self_attn, name).weight, getattr(model.model.layers[7].self_attn, name).weight
        )
    torch.testing.assert_close(drafter.layers[1].mlp.down_proj.weight, model.model.layers[7].mlp.down_proj.weight)
    torch.testing.assert_close(drafter.norm.weight, model.model.norm.weight)
    assert torch.equal(drafter.layers[0].self_attn.k_norm.weight, torch.ones(8))


def test_a_narrower_mlp_takes_the_leading_channels(tiny):
    path, model = tiny
    drafter = _drafter(model, layers=1, intermediate_size=16)
    report = init_from_target_layers(drafter, path)
    assert {"layers.0.mlp.gate_proj.weight", "layers.0.mlp.down_proj.weight"} <= set(report["partial"])
    torch.testing.assert_close(drafter.layers[0].mlp.gate_proj.weight, model.model.layers[7].mlp.gate_proj.weight[:16])
    torch.testing.assert_close(
        drafter.layers[0].mlp.down_proj.weight, model.model.layers[7].mlp.down_proj.weight[:, :16]
    )
    assert report["feature_layer"] == 5  # the deepest feature layer below layer 7


def test_training_setting_initialises_from_the_target(tiny, tmp_path):
    from dflash_assets.dflash.training.config import TrainConfig
    from dflash_assets.dflash.training.setup import build_model

    path, model = tiny
    cfg = TrainConfig(shards=[], out_dir=str(tmp_path), target_model_path=str(path), init_from_target=True)
    dc = _drafter(model, layers=1).config
    built = build_model(cfg, dc, load_target_head(str(path)), torch.device("cpu"))
    torch.testing.assert_close(built.layers[0].self_attn.v_proj.weight, model.model.layers[7].self_attn.v_proj.weight)
    plain = build_model(
        TrainConfig(shards=[], out_dir=str(tmp_path)), dc, load_target_head(str(path)), torch.device("cpu")
    )
    assert not torch.equal(plain.layers[0].self_attn.v_proj.weight, built.layers[0].self_attn.v_proj.weight)


def test_a_run_recorded_before_the_setting_keeps_its_id():
    """The config fingerprint of a drafter config that leaves init_from_target unset is the one computed before the
    setting existed (the same settings without that key), so no finished run is trained again after an upgrade."""
    import hashlib
    import json

    from dflash_assets.stages.drafter.config import DrafterConfig
    from dflash_assets.stages.drafter.identity import config_fingerprint

    config = DrafterConfig(num_hidden_layers=2, block_size=4)
    added = {"init_from_target", "distill_weight", "loss_positions"}
    before = config.model_dump(exclude={"nproc", "nnodes", "rdzv_endpoint", "rdzv_id", "features", *added})
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
        before.pop(key)
    expect = hashlib.sha256(json.dumps(before, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert config_fingerprint(config) == expect
    assert config_fingerprint(DrafterConfig(num_hidden_layers=2, block_size=4, init_from_target=True)) != expect
