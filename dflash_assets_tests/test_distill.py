"""Issue 48: distilling the drafter to the target's own distribution (``distill_weight``, ``loss_positions: all``).

The target's distribution from its tail layers run on stored features, against a full forward of the same target;
the loss against values computed by hand; the batch's per-block target distribution against the rows'; a training
run with both settings on real shards.
"""

from __future__ import annotations

import math

import pytest
import torch

from dflash_assets.dflash.model.loss import dflash_loss_from_hidden
from dflash_assets.dflash.shards.dataset import HiddenStateShards, collate_training_batch
from dflash_assets.dflash.target.tail import TargetTail, WithTargetDistribution
from dflash_assets_tests.tiny_target import make_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, path = make_target(tmp_path_factory.mktemp("tiny_llama"), layers=8, vocab=64)
    return path, model


@pytest.mark.parametrize("layer_ids", [[1, 3, 5], [1, 7]])
def test_tail_gives_the_full_forwards_distribution(tiny, layer_ids):
    """Features [1, 3, 5]: layers 6-7, the final norm and the LM head run on layer 5's output. Features [1, 7]: the
    last layer's stored output is already normalised (HF hidden_states[8]); only the LM head runs. Either way row t
    holds the full forward's top-5 of token t (position t - 1)."""
    path, model = tiny
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)[0]
    tail = TargetTail(path, layer_ids, topk=5)
    got_ids, got_lp = tail(feats)
    ref = torch.log_softmax(out.logits[0, :-1].float(), dim=-1).topk(5, dim=-1)
    assert got_ids.dtype == torch.int32 and got_lp.dtype == torch.float16 and got_ids.shape == (20, 5)
    assert torch.equal(got_ids[1:].long(), ref.indices)
    torch.testing.assert_close(got_lp[1:].float(), ref.values, atol=2e-3, rtol=1e-3)  # float16 storage
    assert (got_lp[0] == -1e4).all()


def test_distillation_loss_by_hand():
    """Vocabulary 3, head = identity: block position 1 has logits [0, ln 3, 0], so p = [1/5, 3/5, 1/5].

    Label 1: CE = ln(5/3) = 0.510826. Target top-2: tokens [1, 0] with log-probabilities [ln .6, ln .3],
    renormalised [2/3, 1/3]: soft CE = 2/3 ln(5/3) + 1/3 ln 5 = 0.340551 + 0.536479 = 0.877030.
    Weight 0.25: 0.75 * 0.510826 + 0.25 * 0.877030 = 0.602377 (one counted position, its block weight cancels).
    With target_labels and label 2 in the data, the hard label becomes the target's argmax, token 1: the same value,
    and the position counts as correct (argmax 1).
    """
    hidden = torch.tensor([[[9.0, 9.0, 9.0], [0.0, math.log(3.0), 0.0]]])
    head = torch.eye(3)
    mask = torch.tensor([[False, True]])
    tids = torch.tensor([[[0, 0], [1, 0]]])
    tlp = torch.tensor([[[-1e4, -1e4], [math.log(0.6), math.log(0.3)]]])
    out = dflash_loss_from_hidden(
        hidden, head, torch.tensor([[0, 1]]), mask, 2, target_ids=tids, target_logprobs=tlp, distill_weight=0.25
    )
    assert float(out["loss"]) == pytest.approx(0.602377, abs=1e-5)
    plain = dflash_loss_from_hidden(hidden, head, torch.tensor([[0, 1]]), mask, 2)
    assert float(plain["loss"]) == pytest.approx(0.510826, abs=1e-5)
    relabelled = dflash_loss_from_hidden(
        hidden,
        head,
        torch.tensor([[0, 2]]),
        mask,
        2,
        target_ids=tids,
        target_logprobs=tlp,
        distill_weight=0.25,
        target_labels=True,
    )
    assert float(relabelled["loss"]) == pytest.approx(0.602377, abs=1e-5)
    assert relabelled["correct"].tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="needs the target's distribution"):
        dflash_loss_from_hidden(hidden, head, torch.tensor([[0, 1]]), mask, 2, distill_weight=0.5)
    # many chunks (checkpointed in backward) give the same loss and gradient as one
    h = torch.randn(1, 8, 3, requires_grad=True)
    args = (h, head, torch.randint(0, 3, (1, 8)), torch.ones(1, 8, dtype=torch.bool), 4)
    kw = dict(target_ids=torch.randint(0, 3, (1, 8, 2)), target_logprobs=torch.randn(1, 8, 2), distill_weight=0.5)
    one = dflash_loss_from_hidden(*args, **kw)["loss"]
    (g_one,) = torch.autograd.grad(one, h)
    many = dflash_loss_from_hidden(*args, logits_budget=3, **kw)["loss"]
    (g_many,) = torch.autograd.grad(many, h)
    torch.testing.assert_close(one, many)
    torch.testing.assert_close(g_one, g_many)


def _shard(tmp_path, model, rows, layer_ids):
    from dflash_assets.dflash.shards.format import write_shard

    feats, ids, masks = [], [], []
    for r in rows:
        with torch.no_grad():
            out = model(torch.tensor([r["input_ids"]]), output_hidden_states=True)
        feats.append(torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)[0].to(torch.bfloat16))
        ids.append(torch.tensor(r["input_ids"]))
        masks.append(torch.tensor(r["loss_mask"]))
    cu = torch.tensor([0, *torch.tensor([len(r["input_ids"]) for r in rows]).cumsum(0).tolist()])
    path = tmp_path / "shard-00000.safetensors"
    write_shard(
        path,
        torch.cat(feats),
        torch.cat(ids),
        torch.cat(masks),
        cu,
        torch.arange(len(rows)),
        target_layer_ids=layer_ids,
        hidden_size=32,
    )
    return path


def _rows(n_rows=3, prompt=10, generated=14):
    g = torch.Generator().manual_seed(3)
    return [
        {
            "input_ids": torch.randint(0, 63, (prompt + generated,), generator=g).tolist(),
            "loss_mask": [0] * prompt + [1] * generated,
        }
        for _ in range(n_rows)
    ]


def test_rows_and_batches_carry_the_targets_distribution(tiny, tmp_path):
    path, model = tiny
    shard = _shard(tmp_path, model, _rows(), [1, 3, 5])
    calls = []

    class Counting(TargetTail):
        def __call__(self, features, chunk=512):
            calls.append(features.shape[0])
            return super().__call__(features, chunk)

    ds = WithTargetDistribution(HiddenStateShards([shard], block_size=4), Counting(path, [1, 3, 5], topk=3), True)
    a, b = ds[1], ds[1]
    assert calls == [24]  # computed once per row, then kept
    assert torch.equal(a["target_ids"], b["target_ids"]) and a["loss_mask"].tolist() == [0] + [1] * 23
    assert len(ds) == 3 and ds.target_layer_ids == [1, 3, 5]  # the wrapped dataset's attributes
    anchors = [torch.tensor([2, 11]), torch.tensor([5])]
    batch = collate_training_batch([ds[0], ds[2]], anchors, 4, 63)
    for bi, (row, anc) in enumerate(zip((0, 2), anchors)):
        for j, anchor in enumerate(anc.tolist()):
            for k in range(4):
                assert torch.equal(batch.target_ids[bi, j * 4 + k], ds[row]["target_ids"][anchor + k].long())
    assert batch.target_logprobs.dtype == torch.float32 and batch.target_ids.shape == (2, 8, 3)
    assert batch.to("cpu").target_ids is not None


def test_training_with_distillation_on_every_position(tiny, tmp_path):
    from dflash_assets.dflash.training.config import TrainConfig
    from dflash_assets.dflash.training.train import train

    path, model = tiny
    shard = _shard(tmp_path, model, _rows(4), [1, 3, 5])
    cfg = TrainConfig(
        shards=[str(shard)],
        out_dir=str(tmp_path / "run"),
        target_model_path=str(path),
        num_hidden_layers=1,
        block_size=4,
        mask_token_id=63,
        max_steps=4,
        max_anchors=8,
        eval_fraction=0.0,
        checkpoint_every=0,
        target_layer_ids=[1, 3, 5],
        num_context_features=3,
        distill_weight=0.5,
        loss_positions="all",
        device="cpu",
    )
    result = train(cfg)
    assert result.step == 4 and math.isfinite(result.summary["final_loss"])
    with pytest.raises(ValueError, match="need offline features"):
        train(cfg.model_copy(update={"features": "online", "tokenized": ["x.parquet"], "shards": []}))
