"""DFlash drafter core: layer ids, masks, anchors, labels, loss, and train/inference consistency."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dflash_assets.dflash.model.draft_config import DFlashConfig, default_mask_token_id
from dflash_assets.dflash.model.draft_model import DFlashDraftModel
from dflash_assets.dflash.model.loss import dflash_loss, dflash_loss_from_hidden, position_weights
from dflash_assets.dflash.model.masks import block_inputs, dflash_training_mask, sample_anchors, valid_anchor_positions
from dflash_assets.dflash.target.layers import default_target_layer_ids

torch.set_num_threads(1)


def tiny_config(**kw) -> DFlashConfig:
    values = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=64,
        mask_token_id=63,
        target_layer_ids=[1, 3, 5],
        num_target_layers=8,
        num_hidden_layers=2,
        block_size=4,
        rope_theta=10000.0,
    )
    values.update(kw)
    return DFlashConfig(**values)


def tiny_model(seed: int = 0, **kw) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(tiny_config(**kw))
    model.reset_parameters(0.2, seed=seed)  # larger init so outputs differ clearly between inputs
    cfg = model.config
    model.attach_target(torch.randn(cfg.vocab_size, cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size))
    return model.eval()


def test_default_target_layer_ids_match_published_values():
    # Qwen3.6-27B (64 layers): mission facts; Qwen3-8B (36 layers): z-lab's released drafter config.
    assert default_target_layer_ids(64) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    # 30 layers: 1 + i*6.5 -> 1, 7.5, 14, 20.5, 27 with Python's round-half-to-even -> 8 and 20.
    assert default_target_layer_ids(30) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(64, n=1) == [32]
    with pytest.raises(ValueError):
        default_target_layer_ids(3)


def test_training_mask_hand_case():
    # seq len 8, block_size 3, anchors 2 and 5: block 0 sees context 0..1, block 1 sees context 0..4,
    # each block sees its own 3 tokens and never the other block.
    expected = torch.tensor(
        [
            # ctx 0..7              | block0 | block1
            [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
            [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
            [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    got = dflash_training_mask(torch.tensor([2, 5]), block_size=3, context_len=8)
    assert torch.equal(got, expected)


def test_block_inputs_label_alignment():
    input_ids = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17], dtype=torch.int32)
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.int8)
    out = block_inputs(input_ids, loss_mask, torch.tensor([2, 5]), block_size=3, mask_token_id=99)
    # block position k predicts the token at anchor + k (no extra shift)
    assert out["labels"].tolist() == [12, 13, 14, 15, 16, 17]
    assert out["block_input_ids"].tolist() == [12, 99, 99, 15, 99, 99]
    assert out["block_position_ids"].tolist() == [2, 3, 4, 5, 6, 7]
    # position 0 never counts; label tokens with loss_mask 0 do not count
    assert out["label_mask"].tolist() == [False, True, True, False, True, True]
    with pytest.raises(ValueError):
        block_inputs(input_ids, loss_mask, torch.tensor([6]), block_size=3, mask_token_id=99)


def test_sample_anchors_valid_distinct_and_seeded():
    loss_mask = torch.zeros(40, dtype=torch.int8)
    loss_mask[10:40] = 1
    valid = valid_anchor_positions(loss_mask, block_size=4)
    assert valid.tolist() == list(range(10, 37))  # loss_mask 1 and a + 4 <= 40
    a = sample_anchors(loss_mask, 4, 8, torch.Generator().manual_seed(3))
    b = sample_anchors(loss_mask, 4, 8, torch.Generator().manual_seed(3))
    c = sample_anchors(loss_mask, 4, 8, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.numel() == 8 and len(set(a.tolist())) == 8 and a.tolist() == sorted(a.tolist())
    assert all(10 <= x <= 36 for x in a.tolist())
    assert sample_anchors(loss_mask, 4, 100).tolist() == list(range(10, 37))
    assert sample_anchors(torch.ones(3, dtype=torch.int8), 4, 8).numel() == 0


def test_position_weights_and_loss_against_hand_computation():
    w = position_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    assert math.isclose(float(w[15]), math.exp(-14 / 7), rel_tol=1e-6)
    torch.manual_seed(0)
    bs, v = 4, 11
    logits = torch.randn(2 * bs, v)
    labels = torch.randint(0, v, (2 * bs,))
    mask = torch.tensor([1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)  # position 0 ignored even if set
    out = dflash_loss(logits, labels, mask, block_size=bs, gamma=2.0)
    num = den = 0.0
    for i in range(2 * bs):
        k = i % bs
        if mask[i] and k > 0:
            wk = math.exp(-(k - 1) / 2.0)
            ce = -torch.log_softmax(logits[i], -1)[labels[i]].item()
            num += wk * ce
            den += wk
    assert math.isclose(float(out["loss"]), num / den, rel_tol=1e-5)
    hits = (logits.argmax(-1) == labels) & mask
    assert out["count"].tolist() == [0, 2, 2, 1]
    expected_correct = [0.0] + [float(sum(hits[j].item() for j in range(2 * bs) if j % bs == k)) for k in range(1, bs)]
    assert out["correct"].tolist() == expected_correct


def test_chunked_loss_from_hidden_equals_full_logits_loss():
    torch.manual_seed(1)
    head = torch.randn(50, 8)
    hidden = torch.randn(3, 12, 8, requires_grad=True)
    labels = torch.randint(0, 50, (3, 12))
    mask = torch.rand(3, 12) > 0.3
    mask[:, ::4] = False
    full = dflash_loss(hidden @ head.T, labels, mask, block_size=4)
    (g_full,) = torch.autograd.grad(full["loss"], hidden)
    chunked = dflash_loss_from_hidden(hidden, head, labels, mask, block_size=4, logits_budget=50 * 5)
    (g_chunk,) = torch.autograd.grad(chunked["loss"], hidden)
    assert torch.allclose(full["loss"], chunked["loss"], atol=1e-6)
    assert torch.allclose(g_full, g_chunk, atol=1e-6)
    assert torch.equal(full["correct"], chunked["correct"]) and torch.equal(full["count"], chunked["count"])


def test_state_dict_has_only_drafter_tensors():
    model = tiny_model()
    keys = set(model.state_dict())
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.0.self_attn.q_norm.weight",
        "layers.1.mlp.down_proj.weight",
    } <= keys
    assert not any("embed" in k or "lm_head" in k or k.startswith("target_") for k in keys)
    assert model.state_dict()["fc.weight"].shape == (32, 3 * 32)
    # target tensors are buffers: no gradient, not optimised
    assert all(p is not model.target_embed_weight for p in model.parameters())


def _single_block_reference(model, input_ids, features, anchor, bs):
    """What inference computes for one block: context = features[:anchor], no mask."""
    block = torch.full((1, bs), model.config.mask_token_id)
    block[0, 0] = input_ids[anchor]
    pos = torch.cat([torch.arange(anchor), torch.arange(anchor, anchor + bs)])[None]
    return model(block, target_hidden=features[None, :anchor], position_ids=pos)[0]


# the drafter's own attention shape, unlike the target's (SpecForge's Qwen3.6 drafter: 32 / 8 / 128 vs 24 / 4 / 256)
OWN_SHAPE = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=6, intermediate_size=40)


@pytest.mark.parametrize("shape", [{}, OWN_SHAPE], ids=["target_shape", "own_attention_shape"])
def test_packed_training_forward_equals_per_block_inference(shape):
    model = tiny_model(**shape)
    assert model.layers[0].self_attn.q_proj.weight.shape == (
        model.config.num_attention_heads * model.config.head_dim,
        32,
    )
    bs, t = model.config.block_size, 20
    torch.manual_seed(2)
    input_ids = torch.randint(0, 60, (t,))
    features = torch.randn(t, 3 * 32)
    anchors = torch.tensor([3, 7, 12, 16])
    blk = block_inputs(input_ids, torch.ones(t, dtype=torch.int8), anchors, bs, model.config.mask_token_id)
    mask = dflash_training_mask(anchors, bs, t)
    pos = torch.cat([torch.arange(t), blk["block_position_ids"]])[None]
    with torch.no_grad():
        packed = model(
            blk["block_input_ids"][None],
            target_hidden=features[None],
            position_ids=pos,
            attention_mask=mask[None, None],
        )[0]
        for b, a in enumerate(anchors.tolist()):
            ref = _single_block_reference(model, input_ids, features, a, bs)
            assert torch.allclose(packed[b * bs : (b + 1) * bs], ref, atol=1e-5), f"block at anchor {a}"
        # the context at and after an anchor must not leak into its block
        poisoned = features.clone()
        poisoned[7:] = 100.0
        packed2 = model(
            blk["block_input_ids"][None],
            target_hidden=poisoned[None],
            position_ids=pos,
            attention_mask=mask[None, None],
        )[0]
        assert torch.allclose(packed[:bs], packed2[:bs], atol=1e-5)  # anchor 3
        assert torch.allclose(packed[bs : 2 * bs], packed2[bs : 2 * bs], atol=1e-5)  # anchor 7 sees < 7
        assert not torch.allclose(packed[2 * bs :], packed2[2 * bs :], atol=1e-3)  # later anchors see it


def test_block_is_bidirectional():
    model = tiny_model()
    bs = model.config.block_size
    features = torch.randn(1, 5, 96)
    pos = torch.arange(5 + bs)[None]
    ids = torch.tensor([[5, 63, 63, 63]])
    ids2 = torch.tensor([[5, 63, 63, 7]])  # change only the last block token
    with torch.no_grad():
        h1 = model(ids, target_hidden=features, position_ids=pos)
        h2 = model(ids2, target_hidden=features, position_ids=pos)
    assert not torch.allclose(h1[0, 0], h2[0, 0], atol=1e-4)  # earlier positions see later ones


def test_from_target_config_local_model_shape():
    from dflash_assets.generation.engines.local_model import ensure_local_model

    cfg_json = json.loads((ensure_local_model() / "config.json").read_text())
    dc = DFlashConfig.from_target_config(cfg_json, mask_token_id=16, num_hidden_layers=2)
    assert (dc.hidden_size, dc.num_attention_heads, dc.num_key_value_heads, dc.head_dim) == (576, 9, 3, 64)
    assert dc.vocab_size == 49152 and dc.num_target_layers == 30 and dc.rope_theta == 100000.0
    assert dc.target_layer_ids == [1, 8, 14, 20, 27] and dc.block_size == 16
    with pytest.raises(ValueError):
        DFlashConfig.from_target_config(cfg_json, mask_token_id=16, target_layer_ids=[30])


def test_drafter_shape_overrides_and_their_checks():
    from dflash_assets.dflash.model.draft_config import DRAFT_SHAPE_FIELDS

    target = {
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "vocab_size": 64,
        "num_hidden_layers": 8,
    }
    dc = DFlashConfig.from_target_config(target, mask_token_id=63, num_hidden_layers=1, **OWN_SHAPE)
    assert {k: getattr(dc, k) for k in OWN_SHAPE} == OWN_SHAPE and dc.hidden_size == 32
    assert set(OWN_SHAPE) <= set(DRAFT_SHAPE_FIELDS) <= set(dc.to_dict())
    wrapped = DFlashConfig.from_target_config({"text_config": target}, mask_token_id=63, num_hidden_layers=1)
    assert (wrapped.num_target_layers, wrapped.target_layer_ids) == (8, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="mask_token_id 64 is outside the target's vocabulary"):
        DFlashConfig.from_target_config(target, mask_token_id=64)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        DFlashConfig.from_target_config(target, mask_token_id=63, num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match="head_dim 7 must be even"):
        DFlashConfig.from_target_config(target, mask_token_id=63, head_dim=7)


def test_default_mask_token_id_choices():
    from transformers import AutoTokenizer

    from dflash_assets.generation.engines.local_model import ensure_local_model

    tok = AutoTokenizer.from_pretrained(ensure_local_model())
    # SmolLM2: no spare embedding rows -> the Jupyter marker <empty_output>, never produced in chat.
    assert default_mask_token_id(tok, 49152) == tok.convert_tokens_to_ids("<empty_output>") == 16
    # Qwen3-like: spare rows past the tokenizer -> first unused row (z-lab uses 151669 = len(tokenizer)).
    assert default_mask_token_id(tok, 49152 + 64) == len(tok)


def test_forward_rejects_bad_positions_and_missing_target():
    model = tiny_model()
    with pytest.raises(ValueError):
        model(torch.tensor([[1, 63, 63, 63]]), target_hidden=torch.randn(1, 5, 96), position_ids=torch.arange(4)[None])
    bare = DFlashDraftModel(tiny_config())
    with pytest.raises(RuntimeError):
        bare(torch.tensor([[1, 63, 63, 63]]), target_hidden=torch.randn(1, 5, 96), position_ids=torch.arange(9)[None])
    with pytest.raises(ValueError):
        bare.attach_target(torch.randn(10, 32))


def test_sliding_window_layer_ignores_context_beyond_its_window_in_training_and_inference():
    """Issue 17 acceptance 5: a sliding layer (window W, HF convention: the query counts) sees only keys at
    positions q-W < p <= q (causal); the packed training forward and single-block inference agree."""
    w, bs, t = 6, 4, 24
    model = tiny_model(num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=w)
    torch.manual_seed(5)
    input_ids = torch.randint(0, 60, (t,))
    features = torch.randn(t, 3 * 32)
    anchors = torch.tensor([4, 11, 18])
    blk = block_inputs(input_ids, torch.ones(t, dtype=torch.int8), anchors, bs, model.config.mask_token_id)
    mask = dflash_training_mask(anchors, bs, t)
    pos = torch.cat([torch.arange(t), blk["block_position_ids"]])[None]
    a = 18  # the third block: queries at 18..21 see context positions > 18 - 6 = 12 .. < 18, i.e. 13..17
    with torch.no_grad():
        packed = model(
            blk["block_input_ids"][None],
            target_hidden=features[None],
            position_ids=pos,
            attention_mask=mask[None, None],
        )[0]
        ref = _single_block_reference(model, input_ids, features, a, bs)
        assert torch.allclose(packed[2 * bs :], ref, atol=1e-5)  # training mask == inference
        far = features.clone()
        far[: a - w + 1] = 50.0  # positions 0..12: beyond the window of every query of the block
        assert torch.allclose(_single_block_reference(model, input_ids, far, a, bs), ref, atol=1e-5)
        packed_far = model(
            blk["block_input_ids"][None], target_hidden=far[None], position_ids=pos, attention_mask=mask[None, None]
        )[0]
        assert torch.allclose(packed_far[2 * bs :], ref, atol=1e-5)
        near = features.clone()
        near[a - w + 1] = 50.0  # position 13: inside the window of the block's first query only
        changed = _single_block_reference(model, input_ids, near, a, bs)
        assert not torch.allclose(changed[0], ref[0], atol=1e-3)
        assert torch.allclose(changed[1:], ref[1:], atol=1e-5)  # queries at 19.. see 14.. only
        # causal inside the block: changing the last block token leaves earlier positions unchanged
        ids = torch.full((1, bs), model.config.mask_token_id)
        ids[0, 0] = input_ids[a]
        ids2 = ids.clone()
        ids2[0, -1] = 7
        p = torch.arange(a + bs)[None]
        h1 = model(ids, target_hidden=features[None, :a], position_ids=p)
        h2 = model(ids2, target_hidden=features[None, :a], position_ids=p)
        assert torch.allclose(h1[0, :-1], h2[0, :-1], atol=1e-5)
    # a full-attention layer of the same weights does see the far context
    full = tiny_model(num_hidden_layers=1)
    with torch.no_grad():
        assert not torch.allclose(
            _single_block_reference(full, input_ids, far, a, bs),
            _single_block_reference(full, input_ids, features, a, bs),
            atol=1e-3,
        )


def test_layer_types_are_checked():
    with pytest.raises(ValueError, match="one per layer"):
        tiny_config(layer_types=["full_attention"])
    with pytest.raises(ValueError, match="unknown"):
        tiny_config(layer_types=["full_attention", "linear_attention"])
    with pytest.raises(ValueError, match="sliding_window"):
        tiny_config(layer_types=["sliding_attention", "full_attention"])
    assert tiny_config().layer_types == ["full_attention", "full_attention"]


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
def test_context_cache_gives_the_same_block_as_reprojecting_the_context(layer_types):
    """The incremental path (cached context keys/values, extended step by step) equals a full forward."""
    model = tiny_model(layer_types=layer_types, sliding_window=5 if layer_types else None)
    bs = model.config.block_size
    torch.manual_seed(3)
    input_ids = torch.randint(0, 60, (30,))
    features = torch.randn(30, 3 * 32)
    cache = model.new_context_cache()
    model.extend_context(cache, features[None, :9])
    with torch.no_grad():
        for start, grow in ((9, 3), (12, 1), (13, 4), (17, 0)):
            block = torch.full((1, bs), model.config.mask_token_id)
            block[0, 0] = input_ids[start]
            got = model.forward_block(block, cache)[0]
            ref = _single_block_reference(model, input_ids, features, start, bs)
            assert torch.allclose(got, ref, atol=1e-5), start
            model.extend_context(cache, features[None, start : start + grow])
    assert cache.length == 17
