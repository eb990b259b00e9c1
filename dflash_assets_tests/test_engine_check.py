"""The export check that stands for SGLang's DFLASH loader (``dflash.export.sglang_check``): this project's export
passes, and each thing SGLang 0.5.23 refuses (or loads wrongly without a word) is refused with its reason.

No process, no torch model beyond a tiny export: the rules read config.json and the safetensors header.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_assets.dflash.export.directory import export_drafter
from dflash_assets.dflash.export.sglang_check import check_dflash_export, expected_parameters, is_hybrid_target
from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.model.draft_model import DFlashDraftModel

HIDDEN, TARGET_LAYERS, TARGET_VOCAB, MASK = 32, 8, 49280, 49200
HYBRID = ["linear_attention"] * 3 + ["full_attention"]


def write_target_config(
    directory: Path,
    *,
    vocab: int = TARGET_VOCAB,
    hidden: int = HIDDEN,
    layers: int = TARGET_LAYERS,
    vocab_tokens: dict[str, int] | None = None,
) -> Path:
    """A Qwen3.6-shaped target config (vision wrapper, text_config, hybrid layer pattern); optionally a
    tokenizer.json holding ``vocab_tokens``."""
    directory.mkdir(parents=True, exist_ok=True)
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "layer_types": (HYBRID * layers)[:layers],
    }
    (directory / "config.json").write_text(
        json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text})
    )
    if vocab_tokens is not None:
        (directory / "tokenizer.json").write_text(
            json.dumps(
                {
                    "model": {"vocab": {"a": 0}},
                    "added_tokens": [{"id": i, "content": t} for t, i in vocab_tokens.items()],
                }
            )
        )
    return directory


def make_export(directory: Path, **overrides) -> Path:
    """This project's export of a tiny drafter (2 layers: sliding + full, block 4) at the target's width."""
    fields = dict(
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=TARGET_VOCAB,
        mask_token_id=MASK,
        target_layer_ids=[1, 3, 5],
        num_target_layers=TARGET_LAYERS,
        num_hidden_layers=2,
        block_size=4,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    )
    fields.update(overrides)
    model = DFlashDraftModel(DFlashConfig(**fields))
    model.reset_parameters(0.02, seed=0)
    return export_drafter(model, directory)


def edit_config(export: Path, change) -> None:
    config = json.loads((export / "config.json").read_text())
    change(config)
    (export / "config.json").write_text(json.dumps(config))


def edit_tensors(export: Path, change) -> None:
    tensors = load_file(str(export / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(export / "model.safetensors"))


def test_the_projects_export_passes_and_its_parameters_are_sglangs(tmp_path):
    export = make_export(tmp_path / "export")
    check = check_dflash_export(export, target_dir=write_target_config(tmp_path / "target"), num_draft_tokens=4)
    assert check.refusals == [] and check.warnings == []
    # every tensor the export writes is one SGLang's DFlashDraftModel has a parameter for, and no more
    assert set(check.tensors) == set(expected_parameters(json.loads((export / "config.json").read_text())))
    assert is_hybrid_target(json.loads((tmp_path / "target" / "config.json").read_text()))


def _rename_fc(t):
    t["proj.weight"] = t.pop("fc.weight")


def _add_embedding(t):
    t["embed_tokens.weight"] = torch.zeros(10, HIDDEN)


def _drop_norm(t):
    del t["layers.1.post_attention_layernorm.weight"]


def _bad_shape(t):
    t["layers.0.mlp.down_proj.weight"] = torch.zeros(HIDDEN, 63)


def _domino(t):
    t["prefix_gru.weight_ih_l0"] = torch.zeros(4, HIDDEN)


CASES = {
    # name: (config change, tensor change, target kwargs, flags, text the refusal must hold)
    "architecture": (
        lambda c: c.update(architectures=["Qwen3ForCausalLM"]),
        None,
        {},
        {},
        "architectures = ['Qwen3ForCausalLM']",
    ),
    "mask_token_id >= target vocab": (
        lambda c: c["dflash_config"].update(mask_token_id=TARGET_VOCAB),
        None,
        {},
        {},
        f"mask_token_id {TARGET_VOCAB} >= the target's vocab_size {TARGET_VOCAB}",
    ),
    "mask token id conflicts with the tokenizer": (
        None,
        None,
        {"vocab_tokens": {"<|MASK|>": 49100}},
        {},
        "differs from the target tokenizer's id 49100",
    ),
    "sliding layers without sliding_window": (
        lambda c: c.update(sliding_window=None),
        None,
        {},
        {},
        "sliding_window is missing while layer_types has sliding_attention",
    ),
    "layer_types shorter than the layers": (
        lambda c: c.update(layer_types=["full_attention"]),
        None,
        {},
        {},
        "layer_types has 1 entries for num_hidden_layers 2",
    ),
    "unknown layer type": (
        lambda c: c.update(layer_types=["linear_attention", "full_attention"]),
        None,
        {},
        {},
        "layer_types ['linear_attention']",
    ),
    "a tensor name SGLang skips": (
        None,
        _rename_fc,
        {},
        {},
        "would skip silently (no DFlashDraftModel parameter of that name): proj.weight",
    ),
    "the target's embedding exported": (
        None,
        _add_embedding,
        {},
        {},
        "skip silently (no DFlashDraftModel parameter of that name): embed_tokens.weight",
    ),
    "a missing tensor": (None, _drop_norm, {}, {}, "tensors missing: layers.1.post_attention_layernorm.weight"),
    "a wrong shape": (None, _bad_shape, {}, {}, "layers.0.mlp.down_proj.weight [32, 63] (config says [32, 64])"),
    "Domino weights": (None, _domino, {}, {}, "tensor prefix_gru.weight_ih_l0"),
    "target layers out of range": (
        lambda c: c["dflash_config"].update(target_layer_ids=[1, 3, 8]),
        None,
        {},
        {},
        "target_layer_ids [8] lie outside the target's 8 layers",
    ),
    "hidden size other than the target's": (
        None,
        None,
        {"hidden": 64},
        {},
        "hidden_size 32 differs from the target's 64",
    ),
    "activation": (lambda c: c.update(hidden_act="gelu"), None, {}, {}, "hidden_act = 'gelu'"),
    "mask_token_id missing": (
        lambda c: c["dflash_config"].pop("mask_token_id"),
        None,
        {},
        {},
        "mask_token_id is missing",
    ),
    "heads not divisible by --tp-size": (
        None,
        None,
        {},
        {"tp_size": 3},
        "num_attention_heads 4 is not divisible by --tp-size 3",
    ),
    "window below the draft tokens": (
        None,
        None,
        {},
        {"draft_window_size": 2},
        "--speculative-draft-window-size 2 < the 4 draft tokens",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_what_sglang_refuses_is_refused_with_the_field_and_the_fix(tmp_path, case):
    change_config, change_tensors, target_kwargs, flags, reason = CASES[case]
    export = make_export(tmp_path / "export")
    if change_config:
        edit_config(export, change_config)
    if change_tensors:
        edit_tensors(export, change_tensors)
    check = check_dflash_export(export, target_dir=write_target_config(tmp_path / "target", **target_kwargs), **flags)
    assert not check.ok
    assert any(reason in r for r in check.refusals), check.refusals
    assert all("fix:" in r for r in check.refusals), check.refusals  # every reason says what to do


def test_a_block_size_other_than_the_draft_tokens_is_a_warning_as_in_sglang(tmp_path):
    export = make_export(tmp_path / "export")
    check = check_dflash_export(export, target_dir=write_target_config(tmp_path / "target"), num_draft_tokens=8)
    assert check.ok and any("differs from the drafter's block_size 4" in w for w in check.warnings)


def test_an_unreadable_export_is_refused_not_raised(tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{not json")
    check = check_dflash_export(tmp_path / "export")
    assert not check.ok and "config.json unreadable" in check.refusals[0]


def test_the_configs_choices_are_the_flag_builders():
    from typing import get_args

    from dflash_assets.generation.servers.sglang_dflash import (
        DRAFT_ATTENTION_BACKENDS,
        MAMBA_STRATEGIES,
        SGLANG_DRAFT_ATTENTION_BACKENDS,
    )
    from dflash_assets.stages.evaluation.config import EvaluationConfig

    fields = EvaluationConfig.model_fields
    assert get_args(fields["draft_attention_backend"].annotation) == ("sglang_default", *DRAFT_ATTENTION_BACKENDS)
    assert get_args(fields["mamba_radix_cache_strategy"].annotation) == ("from_target", *MAMBA_STRATEGIES)
    assert set(DRAFT_ATTENTION_BACKENDS) <= set(SGLANG_DRAFT_ATTENTION_BACKENDS)


def test_an_export_with_the_recipes_attention_shape_passes(tmp_path):
    """The published recipe's drafter attention (32 heads x 128 = 4,096 != hidden 5,120) scaled down: the
    heads' width differs from the hidden size, and SGLang's loader shapes follow head_dim, not hidden."""
    export = make_export(tmp_path / "export", num_attention_heads=8, num_key_value_heads=2, head_dim=8)  # 64 != 32
    check = check_dflash_export(export, target_dir=write_target_config(tmp_path / "target"), num_draft_tokens=4)
    assert check.refusals == [] and check.warnings == []
    config = json.loads((export / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 2, 8)
    assert check.tensors["layers.0.self_attn.q_proj.weight"] == [64, HIDDEN]
    assert check.tensors["layers.0.self_attn.o_proj.weight"] == [HIDDEN, 64]
