"""Issue 48 item 2: parity that tests the mechanism. An engine's speculative decoding is replayed step by step
(``dflash/decoding/engine_replay.py``) and each step's accepted count compared.

The "engine" here is this project's own decoder (``dflash_generate``: a KV cache, a drafter context cache, one
verification forward per step), an implementation independent of the replay (one forward over the whole output,
every anchor in one drafter forward with the training mask). A drafter overfit on a tiny random target's greedy
outputs gives steps of every accepted length; the real vLLM engine is ``test_engine_parity_vllm.py``'s.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dflash_assets.dflash.decoding.engine_replay import numeric_tolerance, replay_prompt
from dflash_assets.dflash.decoding.ngram import ngram_steps
from dflash_assets.dflash.decoding.speculative import dflash_generate, target_generate
from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.model.draft_model import load_target_head
from dflash_assets_tests.test_ngram_baseline import ngram_replay
from dflash_assets_tests.tiny_target import HIDDEN, LAYER_IDS, LAYERS, VOCAB, make_target
from dflash_simulators.overfit_drafter import greedy_rows, overfit

BLOCK = 4
NEW = 24
TOL = numeric_tolerance(torch.float32)


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    target, path = make_target(tmp)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB - 1, (10 + 3 * i,), generator=g).tolist() for i in range(8)]
    plain = [target_generate(target, p, NEW) for p in prompts]
    config = DFlashConfig(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        vocab_size=VOCAB, mask_token_id=VOCAB - 1, target_layer_ids=LAYER_IDS, num_target_layers=LAYERS,
        num_hidden_layers=1, block_size=BLOCK,
    )  # fmt: skip
    embed, head = load_target_head(str(path))
    # trained only part way: every accepted length occurs, partial acceptances included
    result, _ = overfit(target, greedy_rows(prompts, plain), LAYER_IDS, tmp, config, (embed, head), steps=60, lr=5e-3)
    drafter = result.model.eval()
    runs = [dflash_generate(target, drafter, p, NEW) for p in prompts]
    return {"target": target, "drafter": drafter, "prompts": prompts, "runs": runs, "plain": plain}


def _steps(run):
    """``(drafted, accepted)`` per step of a ``dflash_generate`` run: it drafts fewer near ``NEW`` tokens."""
    out, got = [], 1
    for n in run.accepted_lengths:
        out.append((min(BLOCK - 1, NEW - got - 1), n - 1))
        got += n
    return out


def test_the_replay_reproduces_every_step_of_an_independent_decoder(setting):
    lengths = [n for run in setting["runs"] for n in run.accepted_lengths]
    assert {1, BLOCK} <= set(lengths) and any(1 < n < BLOCK for n in lengths), lengths  # a varied run
    for p, run, plain in zip(setting["prompts"], setting["runs"], setting["plain"]):
        assert run.output_ids == plain.output_ids  # lossless, so the replay's "engine output" is the greedy one
        replay = replay_prompt(setting["target"], setting["drafter"], p, run.output_ids, _steps(run), tolerance=TOL)
        assert replay.here_accepted == replay.engine_accepted == [n - 1 for n in run.accepted_lengths]
        assert replay.differences == [] and replay.target_mismatches == []
        # this drafter's own chain over the output is the decoder's chain
        assert replay.own_accepted_lengths == run.accepted_lengths


def _first_mismatches(setting, drafter, steps_of=_steps):
    found = []
    for p, run in zip(setting["prompts"], setting["runs"]):
        replay = replay_prompt(setting["target"], drafter, p, run.output_ids, steps_of(run), tolerance=TOL)
        found += replay.mismatches
    return found


@pytest.mark.parametrize(
    "inject",
    ["a mis-saved weight", "a wrong mask token", "a wrong target-layer map"],
)
def test_each_injected_mismatch_is_named_at_its_step(setting, inject):
    drafter = copy.deepcopy(setting["drafter"])
    if inject == "a mis-saved weight":
        with torch.no_grad():
            drafter.fc.weight.mul_(-1.0)
    elif inject == "a wrong mask token":
        drafter.config.mask_token_id = 5
    else:
        drafter.config.target_layer_ids = [0, 2, 4]
    found = _first_mismatches(setting, drafter)
    assert found, f"{inject}: no step differed"
    d = found[0]
    assert d.margin > TOL and not d.tie
    assert 1 <= d.position < BLOCK and d.engine_accepted != d.here_accepted
    assert d.anchor >= len(setting["prompts"][0])


def test_steps_the_engine_reports_wrongly_are_named(setting):
    """The engine side at fault: one step reported with one more accepted draft than its output allows."""
    p, run = setting["prompts"][0], setting["runs"][0]
    steps = _steps(run)
    i = next(k for k, (_, a) in enumerate(steps) if a < BLOCK - 2)
    steps[i] = (BLOCK - 1, steps[i][1] + 1)
    replay = replay_prompt(setting["target"], setting["drafter"], p, run.output_ids, steps, tolerance=TOL)
    assert [d.step for d in replay.differences][:1] == [i]
    assert replay.differences[0].position == steps[i][1]  # the draft the engine claims, this drafter refused
    assert replay.differences[0].here_accepted == steps[i][1] - 1


def test_an_output_that_is_not_the_targets_greedy_one_is_named(setting):
    p, run = setting["prompts"][1], setting["runs"][1]
    output = list(run.output_ids)
    output[5] = (output[5] + 1) % (VOCAB - 1)
    replay = replay_prompt(setting["target"], setting["drafter"], p, output, None, tolerance=TOL)
    assert [m[0] for m in replay.target_mismatches][:1] == [5]
    assert replay.target_mismatches[0][1] == output[5] and replay.target_mismatches[0][2] == run.output_ids[5]


def test_ngram_steps_follow_the_rule_as_an_independent_replay_does():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        vocab = int(torch.randint(2, 20, (1,), generator=g))
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(0, vocab, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        lo = int(torch.randint(1, 3, (1,), generator=g))
        hi, k = lo + int(torch.randint(0, 3, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        steps, reference = ngram_steps(prompt, output, lo, hi, k), ngram_replay(prompt, output, lo, hi, k)
        assert 1 + len(steps) == reference["forwards"]
        assert sum(1 for d, _ in steps if d) == reference["drafts"]
        assert (sum(d for d, _ in steps), sum(a for _, a in steps)) == (
            reference["draft_tokens"],
            reference["accepted"],
        )


def _two_layer_drafter() -> torch.nn.Module:
    from dflash_assets.dflash.model.draft_model import DFlashDraftModel

    config = DFlashConfig(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        vocab_size=VOCAB, mask_token_id=VOCAB - 1, target_layer_ids=LAYER_IDS, num_target_layers=LAYERS,
        num_hidden_layers=2, block_size=BLOCK,
    )  # fmt: skip
    drafter = DFlashDraftModel(config)
    drafter.reset_parameters(seed=5)
    g = torch.Generator().manual_seed(6)
    drafter.attach_target(torch.randn(VOCAB, HIDDEN, generator=g))
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.k_norm.weight.copy_(torch.rand(8, generator=g) + 0.5)
    return drafter.eval()


def test_the_engine_view_norms_every_layers_context_keys_with_layer_0s_weight_and_nothing_else():
    """Issue 48: vLLM 0.32.0's CPU build normalises every draft layer's context keys with layer 0's k_norm weight
    (vllm_probe). The replay's copy computes exactly that: layer 1's context keys by hand with layer 0's weight, its
    block keys with its own; both context paths (whole forward, cached context) agree; the drafter is unchanged and
    shares its weights with the copy."""
    from dflash_assets.dflash.decoding.engine_replay import with_context_k_norm_of_layer0
    from dflash_assets.dflash.model.draft_model import rope_cos_sin

    drafter = _two_layer_drafter()
    engine = with_context_k_norm_of_layer0(drafter)
    assert engine.layers[1].self_attn.q_proj.weight is drafter.layers[1].self_attn.q_proj.weight
    assert engine.target_lm_head_weight is drafter.target_lm_head_weight
    assert all(layer.self_attn.context_k_norm_weight is None for layer in drafter.layers)
    assert set(engine.state_dict()) == set(drafter.state_dict())  # nothing new is saved

    g = torch.Generator().manual_seed(7)
    h = torch.randn(1, 6, HIDDEN, generator=g)
    cos, sin = rope_cos_sin(torch.arange(6)[None], 8, drafter.config.rope_theta, torch.float32)
    attn = drafter.layers[1].self_attn
    k = attn.k_proj(h).view(1, 6, 2, 8)
    normed = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + attn.k_norm.eps)
    with torch.no_grad():
        for weight, context in ((drafter.layers[0].self_attn.k_norm.weight, True), (attn.k_norm.weight, False)):
            want = (normed * weight).transpose(1, 2)
            want = want * cos[:, None] + torch.cat([-want[..., 4:], want[..., :4]], -1) * sin[:, None]
            got, _ = engine.layers[1].self_attn.kv(h, cos, sin, context=context)
            torch.testing.assert_close(got, want)

    features = torch.randn(1, 9, len(LAYER_IDS) * HIDDEN, generator=g)
    block = torch.tensor([[5] + [VOCAB - 1] * (BLOCK - 1)])
    with torch.no_grad():
        whole = engine(block, target_hidden=features, position_ids=torch.arange(9 + BLOCK)[None])
        cached = engine.forward_block(block, engine.extend_context(engine.new_context_cache(), features))
        trained = drafter(block, target_hidden=features, position_ids=torch.arange(9 + BLOCK)[None])
    torch.testing.assert_close(whole, cached)
    assert (whole - trained).abs().max() > 1e-3  # the layers' k_norm weights differ: so do the drafts' states


def test_turns_that_extend_each_other_reuse_the_turn_befores_cache_and_replay_alike(setting):
    """Issue 48's main job spent 97 of its 109 replay seconds in target forwards over BFCL turns, each turn's prompt
    the turn before's prompt, reply and tool result (72% of the tokens shared). The replay runs them in token order
    and the target over what follows the shared prefix only; every step still matches the independent decoder's, the
    figures equal a whole forward's, and the tokens taken from the cache are the shared prefixes, counted here."""
    from dflash_assets.dflash.decoding.engine_replay import PrefixCache, prefix_reusable
    from dflash_assets.stages.evaluation.replay import replay_engine_datasets
    from dflash_assets_tests.tiny_target import make_hybrid_target

    target, drafter = setting["target"], setting["drafter"]
    g = torch.Generator().manual_seed(11)
    prompt = setting["prompts"][0]
    turns, runs = [], []
    for _ in range(4):  # each turn: the last one's prompt and reply, then a "tool result" of 3 tokens
        run = dflash_generate(target, drafter, prompt, NEW)
        turns.append(prompt)
        runs.append(run)
        prompt = [*prompt, *run.output_ids, *torch.randint(0, VOCAB - 1, (3,), generator=g).tolist()]
    order = [2, 0, 3, 1]  # positions out of conversation order: the replay sorts them
    prompts = {"agentic": [turns[i] for i in order], "code": setting["prompts"][1:3]}
    code_runs = [dflash_generate(target, drafter, p, NEW) for p in prompts["code"]]
    records = [
        {"dataset": "agentic", "position": pos, "output_ids": runs[i].output_ids, "steps": _steps(runs[i])}
        for pos, i in enumerate(order)
    ] + [
        {"dataset": "code", "position": pos, "output_ids": r.output_ids, "steps": _steps(r)}
        for pos, r in enumerate(code_runs)
    ]
    lines: list[str] = []
    with torch.no_grad():
        got = replay_engine_datasets(target, {"trained": drafter}, prompts, records, TOL, log=lines.append)
    for name, runs_by_pos in (("agentic", [runs[i] for i in order]), ("code", code_runs)):
        entry = got[name]["trained"]
        assert entry["accepted_lengths"] == [r.accepted_lengths for r in runs_by_pos]
        assert entry["step_parity"]["differences"] == 0 and entry["lossless"]
        whole = [
            replay_prompt(target, drafter, p, r.output_ids, _steps(r), tolerance=TOL)
            for p, r in zip(prompts[name], runs_by_pos)
        ]
        assert entry["accepted_lengths"] == [w.own_accepted_lengths for w in whole]
    # turn k+1 shares turn k's prompt and reply; the code prompts share nothing with the turns (random ids)
    shared = sum(len(turns[k]) + len(runs[k].output_ids) for k in range(3))
    total = sum(len(p) + len(r.output_ids) for p, r in zip(turns + prompts["code"], runs + code_runs))
    assert lines == [
        f"replay: {shared:,} of {total:,} tokens ({shared / total:.0%}) taken from the prompt before's KV cache "
        "(shared prefixes)"
    ]
    # the features the cache gives equal a whole forward's (float rounding only)
    prefix = PrefixCache(target)
    from dflash_assets.dflash.decoding.engine_replay import _features_and_logits

    for p, r in zip(turns[:2], runs[:2]):
        ids = torch.tensor([*p, *r.output_ids])
        cached, cached_logits = _features_and_logits(target, ids, LAYER_IDS, len(r.output_ids) + 1, prefix)
        fresh, fresh_logits = _features_and_logits(target, ids, LAYER_IDS, len(r.output_ids) + 1)
        torch.testing.assert_close(cached, fresh, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cached_logits, fresh_logits, atol=1e-4, rtol=1e-5)
    assert prefix.reused_tokens == len(turns[0]) + len(runs[0].output_ids)
    # a hybrid target's linear-attention state cannot be cut back: whole forwards there
    assert prefix_reusable(target) and not prefix_reusable(make_hybrid_target()[0])
