"""Export of the drafter as the HF directory SGLang loads for DFLASH speculative decoding."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflash_assets.dflash.export.directory import (
    config_from_hf_dict,
    export_drafter,
    hf_config_dict,
    load_exported,
    resolve_export,
)
from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.model.draft_model import DFlashDraftModel

torch.set_num_threads(1)


def make_model() -> DFlashDraftModel:
    cfg = DFlashConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=64,
        mask_token_id=63,
        target_layer_ids=[1, 16, 31, 46, 61],
        num_target_layers=64,
        num_hidden_layers=2,
        block_size=16,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
    )
    model = DFlashDraftModel(cfg)
    model.reset_parameters(0.2, seed=1)
    with torch.no_grad():  # non-trivial norm weights so a dropped/misnamed norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    g = torch.Generator().manual_seed(2)
    model.attach_target(torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g))
    return model.eval()


def expected_tensor_shapes(n_layers=2, h=32, heads=4, kv=2, hd=8, inter=48, n_feats=5) -> dict:
    shapes = {"fc.weight": [h, n_feats * h], "hidden_norm.weight": [h], "norm.weight": [h]}
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": [h],
                p + "post_attention_layernorm.weight": [h],
                p + "self_attn.q_proj.weight": [heads * hd, h],
                p + "self_attn.k_proj.weight": [kv * hd, h],
                p + "self_attn.v_proj.weight": [kv * hd, h],
                p + "self_attn.o_proj.weight": [h, heads * hd],
                p + "self_attn.q_norm.weight": [hd],
                p + "self_attn.k_norm.weight": [hd],
                p + "mlp.gate_proj.weight": [inter, h],
                p + "mlp.up_proj.weight": [inter, h],
                p + "mlp.down_proj.weight": [h, inter],
            }
        )
    return shapes


def _outputs(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([[5] + [63] * 15])
    feats = torch.randn(1, 7, 5 * 32, generator=g)
    pos = torch.arange(7 + 16)[None]
    with torch.no_grad():
        return model.compute_logits(model(ids, target_hidden=feats, position_ids=pos))


def test_export_config_fields(tmp_path):
    out = export_drafter(make_model(), tmp_path / "drafter")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 16 and cfg["num_target_layers"] == 64 and cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [1, 16, 31, 46, 61], "block_size": 16}
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        32,
        4,
        2,
        8,
    )
    assert cfg["intermediate_size"] == 48 and cfg["vocab_size"] == 64 and cfg["rms_norm_eps"] == 1e-6
    assert cfg["rope_theta"] == 1e6 and cfg["rope_parameters"]["rope_theta"] == 1e6
    assert cfg["max_position_embeddings"] == 4096 and cfg["hidden_act"] == "silu"
    assert cfg["layer_types"] == ["full_attention"] * 2  # non-causal (encoder-only) attention in SGLang
    assert cfg["tie_word_embeddings"] is False


def test_export_tensors_names_shapes_no_target_weights(tmp_path):
    out = export_drafter(make_model(), tmp_path / "drafter")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = f.keys()  # safe_open is not a dict: keys() is its only listing
        shapes = {k: list(f.get_slice(k).get_shape()) for k in names}
        dtypes = {f.get_tensor(k).dtype for k in names}
    assert shapes == expected_tensor_shapes()
    assert not any("embed" in k or "lm_head" in k for k in shapes)
    assert dtypes == {torch.bfloat16}
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_export_roundtrip_identical_outputs(tmp_path):
    model = make_model()
    out = export_drafter(model, tmp_path / "fp32", dtype=torch.float32)
    loaded = load_exported(out, embed_weight=model.target_embed_weight, lm_head_weight=model.target_lm_head_weight)
    assert loaded.config == model.config
    assert torch.equal(_outputs(model), _outputs(loaded))
    # bf16 export: same model up to bf16 rounding of the weights
    out16 = export_drafter(model, tmp_path / "bf16")
    loaded16 = load_exported(out16, embed_weight=model.target_embed_weight, lm_head_weight=model.target_lm_head_weight)
    a, b = _outputs(model), _outputs(loaded16)
    assert torch.allclose(a, b, atol=0.05 * a.abs().max().item())
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def _model_with(layers: int) -> DFlashDraftModel:
    cfg = make_model().config.to_dict()
    model = DFlashDraftModel(DFlashConfig(**{**cfg, "num_hidden_layers": layers, "layer_types": None}))
    model.reset_parameters(0.2, seed=layers)
    return model


def test_replacing_an_export_is_one_rename_and_a_reader_keeps_its_version(tmp_path, monkeypatch):
    """Issue 27: the swap was two renames (old away, new in), between which the export path did not
    exist, and a reader could take config.json from one export and the weights from the next. Now the
    path is a symlink switched by one rename; a reader that resolved it keeps a whole version."""
    import os

    out = tmp_path / "export"
    export_drafter(_model_with(1), out)
    reader_view = resolve_export(out)  # e.g. SGLang starting with --speculative-draft-model-path
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renames.append((str(a), str(b))), real_replace(a, b))[1])
    export_drafter(_model_with(2), out)
    touching_out = [r for r in renames if str(out) in (r[0], r[1])]
    assert len(touching_out) == 1 and touching_out[0][1] == str(out)  # one rename, onto the path, none off it
    assert out.is_symlink() and load_exported(out).config.num_hidden_layers == 2
    assert load_exported(reader_view).config.num_hidden_layers == 1  # the earlier version is still whole
    export_drafter(_model_with(1), out)
    assert not reader_view.exists()  # two exports later it is removed
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert len(list((tmp_path / "export.versions").iterdir())) == 2  # current and previous

    # a reader loading in a loop while exports switch in never misses the path nor mixes two exports
    import threading

    errors, loads, stop = [], [0], threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                load_exported(out)  # strict: config.json and weights of different exports would not load
                loads[0] += 1
            except Exception as exc:
                errors.append(repr(exc))

    reader = threading.Thread(target=read)
    reader.start()
    for layers in (2, 1, 2, 1, 2, 1):
        export_drafter(_model_with(layers), out)
    stop.set()
    reader.join()
    assert errors == [] and loads[0] > 0


def test_a_reader_whose_version_was_pruned_mid_read_resolves_again(tmp_path, monkeypatch):
    """CI (stop 44) failed with FileNotFoundError on .../export.versions/<v>/model.safetensors: the looping
    reader resolved version v, two exports then pruned v before its weights were opened. Loading through
    the export path resolves again and gets the current version whole; a version dir given directly does not."""
    from dflash_assets.dflash.export import directory as export_module

    out = tmp_path / "export"
    export_drafter(_model_with(1), out)
    stale = resolve_export(out)
    export_drafter(_model_with(2), out)
    export_drafter(_model_with(1), out)
    assert not stale.exists()
    export_drafter(_model_with(2), out)
    answers = iter([stale])
    real = export_module.resolve_export
    monkeypatch.setattr(export_module, "resolve_export", lambda p: next(answers, None) or real(p))
    assert load_exported(out).config.num_hidden_layers == 2
    with pytest.raises(FileNotFoundError):
        load_exported(stale)


def test_export_replaces_existing_dir_and_config_roundtrip(tmp_path):
    model = make_model()
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "stale.bin").write_text("old")
    export_drafter(model, out)
    assert not (out / "stale.bin").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left
    assert config_from_hf_dict(hf_config_dict(model.config)) == model.config


def test_load_rejects_mismatched_tensors(tmp_path):
    out = export_drafter(make_model(), tmp_path / "drafter")
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    cfg["layer_types"] = ["full_attention"] * 3
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError):
        load_exported(out)


def test_layer_types_and_sliding_window_exported_with_sglang_names_and_kept_on_reload(tmp_path):
    """Issue 17 acceptance 5: SGLang's DFlash loader reads ``layer_types`` and ``sliding_window`` (HF names)."""
    model = make_model()
    cfg = DFlashConfig(
        **{**model.config.to_dict(), "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2048}
    )
    windowed = DFlashDraftModel(cfg)
    windowed.load_state_dict(model.state_dict())
    out = export_drafter(windowed, tmp_path / "drafter")
    written = json.loads((out / "config.json").read_text())
    assert written["layer_types"] == ["sliding_attention", "full_attention"]
    assert written["sliding_window"] == 2048 and written["use_sliding_window"] is True
    back = load_exported(out)
    assert back.config.layer_types == ["sliding_attention", "full_attention"]
    assert back.config.sliding_window == 2048
    assert back.config == cfg
    plain = json.loads((export_drafter(model, tmp_path / "plain") / "config.json").read_text())
    assert plain["layer_types"] == ["full_attention"] * 2 and plain["sliding_window"] is None
