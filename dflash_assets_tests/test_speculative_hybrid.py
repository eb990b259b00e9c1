"""Speculative decoding on hybrid targets (Qwen3.5/3.6: 3 Gated DeltaNet layers, then 1 full-attention layer).

A verify step feeds the target drafts that may be rejected; the linear-attention layers' conv and recurrent
states absorb them and cannot be cropped. Checks, on tiny random-init targets (no weights from anywhere):
the rolled-back state equals a fresh prefill of exactly the accepted tokens; greedy output equals plain
decoding token for token with rejections happening (the ``Qwen3_5ForCausalLM`` decoder, the multimodal
``Qwen3_5ForConditionalGeneration`` wrapper, and the plain tiny Llama, which keeps its crop-only path); in
sampling mode every token is drawn from the target's true conditional distribution; feature capture on the
wrapper equals HF's hidden states.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_target import VOCAB, make_hybrid_target, make_target

from dflash_assets.dflash.decoding.speculative import FeatureCapture, dflash_generate, target_generate
from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.model.draft_model import DFlashDraftModel
from dflash_assets.dflash.target.features import TargetFeatureExtractor, find_decoder_layers
from dflash_assets.dflash.target.hybrid_cache import VerifyRollback, crop_attention_layers
from dflash_assets.dflash.target.kernels import linear_attention_kernels
from dflash_assets.dflash.target.layers import resolve_target_layer_ids
from dflash_simulators.oracle_drafter import OracleDrafter

LAYER_IDS = [1, 3, 7]  # 7 = the last layer: HF reports it after the final norm
BS = 4
MAX_NEW = 20
PROMPTS = [[5, 17, 3, 44, 9, 12, 80, 2], [60, 61, 7, 7, 30], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
# scripted wrong drafts per call (1-based draft index, None = all right): partial and full acceptances
CORRUPT = [2, 3, None, 1, 2, None, 3, 1, 2, None, 2, 3, 1]


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    from transformers.utils import logging

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    level = logging.get_verbosity()
    logging.set_verbosity_error()  # the reference-kernel notice (fla / causal-conv1d are GPU packages)
    yield
    logging.set_verbosity(level)
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def hybrid():
    return make_hybrid_target()[0]


@pytest.fixture(scope="module")
def wrapper():
    return make_hybrid_target(wrapper=True)[0]


def draft_config(target, layer_ids=LAYER_IDS) -> DFlashConfig:
    return DFlashConfig.from_target_config(
        target.config, mask_token_id=VOCAB - 1, num_hidden_layers=1, block_size=BS, target_layer_ids=layer_ids
    )


def untrained(target, layer_ids=LAYER_IDS) -> DFlashDraftModel:
    d = DFlashDraftModel(draft_config(target, layer_ids))
    d.reset_parameters(seed=0)
    return d.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight).eval()


def prefill(target, ids: list[int]):
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return cache


def linear_states(cache) -> list[torch.Tensor]:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    out = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            out += [layer.conv_states[0], layer.recurrent_states[0]]
    return out


def max_state_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(linear_states(a), linear_states(b)))


# ---------------------------------------------------------------------------------------------
# the rollback itself


def test_plain_crop_fails_on_a_hybrid_cache(hybrid):
    """The bug: DynamicCache.crop after a verify step raises on the linear-attention layers."""
    cache = prefill(hybrid, PROMPTS[0])
    with pytest.raises(RuntimeError, match="does not track past states"):
        cache.crop(-1)


def replay_verify(hybrid, ids: torch.Tensor, cache, start: int, n: int) -> None:
    """Run the first ``n`` of the verify tokens ``ids`` (1, k) again at positions ``start ..``, into ``cache``."""
    hybrid(input_ids=ids[:, :n], position_ids=torch.arange(start, start + n)[None], cache=cache, use_cache=True)


@pytest.mark.parametrize("mode", ["mixers", "forward"])
def test_rollback_leaves_exactly_the_state_of_the_accepted_tokens(hybrid, mode):
    prompt, verify = PROMPTS[0], [11, 23, 35, 47]
    start = len(prompt)
    for accepted in (1, 2, 3, 4):
        cache = prefill(hybrid, prompt)
        restore = VerifyRollback(hybrid, cache, mode)
        assert restore.mode == mode and restore.linear_ids == [0, 1, 2, 4, 5, 6]
        ids = torch.tensor([verify])
        replay = functools.partial(replay_verify, hybrid, ids, cache, start)
        with torch.no_grad(), restore:
            restore.before_verify(len(verify))
            hybrid(
                input_ids=ids, position_ids=torch.arange(start, start + len(verify))[None], cache=cache, use_cache=True
            )
            absorbed = [t.clone() for t in linear_states(cache)]
            restore.after_verify(start, len(verify), accepted, replay)
        fresh = prefill(hybrid, prompt + verify[:accepted])
        assert cache.get_seq_length() == fresh.get_seq_length() == start + accepted
        assert max_state_diff(cache, fresh) < 1e-5, (mode, accepted)
        for layer, ref in zip(cache.layers, fresh.layers):  # attention layers: the same keys and values
            if hasattr(layer, "keys"):
                torch.testing.assert_close(layer.keys, ref.keys, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(layer.values, ref.values, rtol=1e-5, atol=1e-6)
        rolled_back = accepted < len(verify)
        assert (restore.forwards, restore.tokens) == ((1, accepted) if rolled_back else (0, 0))
        if rolled_back:  # the states after the verify forward held the rejected tokens: the check can fail
            assert max(float((x - y).abs().max()) for x, y in zip(absorbed, linear_states(fresh))) > 1e-3
        # and the next token's logits are those of plain decoding
        with torch.no_grad():
            nxt = hybrid(
                input_ids=torch.tensor([[9]]),
                position_ids=torch.tensor([[start + accepted]]),
                cache=cache,
                use_cache=True,
            ).logits
            ref = hybrid(input_ids=torch.tensor([prompt + verify[:accepted] + [9]])).logits[:, -1:]
        torch.testing.assert_close(nxt, ref, rtol=1e-4, atol=1e-5)


def test_cropping_attention_only_is_not_enough(hybrid):
    """What the snapshot is for: crop the attention layers but keep the linear states -> wrong state."""
    prompt, verify = PROMPTS[1], [11, 23, 35]
    cache = prefill(hybrid, prompt)
    with torch.no_grad():
        hybrid(
            input_ids=torch.tensor([verify]),
            position_ids=torch.arange(len(prompt), len(prompt) + 3)[None],
            cache=cache,
            use_cache=True,
        )
    crop_attention_layers(cache, len(prompt) + 1)
    assert max_state_diff(cache, prefill(hybrid, prompt + verify[:1])) > 1e-3


def test_a_plain_target_keeps_the_crop_only_path(tmp_path):
    llama, _ = make_target(tmp_path)
    cache = prefill(llama, PROMPTS[0])
    restore = VerifyRollback(llama, cache, "auto")
    assert restore.mode == "none" and restore.linear_ids == [] and not restore.mixers
    with pytest.raises(ValueError, match="unknown"):
        VerifyRollback(llama, cache, "sometimes")


# ---------------------------------------------------------------------------------------------
# greedy: output equals plain decoding, with rejections


_PLAIN: dict = {}


def plain_ids(target, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    """Plain greedy decoding's first ``n`` tokens (one run of MAX_NEW + BS tokens per target and prompt, kept)."""
    key = (id(target), tuple(prompt))
    if key not in _PLAIN:
        _PLAIN[key] = target_generate(target, prompt, MAX_NEW + BS).output_ids  # no EOS: a fixed-length reference
    return _PLAIN[key][:n]


def _oracle_runs(target, prompts, layer_ids=LAYER_IDS, **kw):
    """``(prompt, speculative result, plain ids)`` per prompt, the oracle drafter making the scripted CORRUPT errors."""
    out = []
    for p in prompts:
        oracle = OracleDrafter(p + plain_ids(target, p, MAX_NEW + BS), draft_config(target, layer_ids), corrupt=CORRUPT)
        out.append((p, dflash_generate(target, oracle, p, MAX_NEW, **kw), plain_ids(target, p)))
    return out


def verified_per_step(accepted_lengths: list[int]) -> list[int]:
    """Tokens each verify forward fed (hand count): a block, or the tokens still allowed before MAX_NEW."""
    return [min(BS, MAX_NEW - 1 - sum(accepted_lengths[:i])) for i in range(len(accepted_lengths))]


@pytest.mark.parametrize("mode", ["auto", "forward"])
def test_greedy_on_hybrid_equals_plain_decoding_with_rejections(hybrid, mode):
    drafter = untrained(hybrid)
    assert target_generate(hybrid, PROMPTS[0], MAX_NEW).output_ids == plain_ids(hybrid, PROMPTS[0])
    for p in PROMPTS:
        spec = dflash_generate(hybrid, drafter, p, MAX_NEW, rollback=mode)
        assert spec.output_ids == plain_ids(hybrid, p)
        assert spec.rollback == ("mixers" if mode == "auto" else "forward")
        assert spec.rollback_forwards > 0 and spec.rollback_tokens >= spec.rollback_forwards  # drafts were rejected
    partial = 0
    for p, spec, plain in _oracle_runs(hybrid, PROMPTS, rollback=mode):
        assert spec.output_ids == plain
        # scripted errors at drafts 2 and 3 give steps of 2 and 3 tokens: rollbacks over more than one token
        assert {2, 3} <= set(spec.accepted_lengths) and BS in spec.accepted_lengths
        verified = verified_per_step(spec.accepted_lengths)
        rejected = [a for a, v in zip(spec.accepted_lengths, verified) if a < v]
        assert spec.rollback_forwards == len(rejected) and spec.rollback_tokens == sum(rejected)
        assert spec.num_target_tokens == len(p) + sum(verified)
        partial += len(rejected)
    assert partial >= 6


def test_greedy_on_the_multimodal_wrapper_equals_plain_decoding(wrapper):
    base, layers = find_decoder_layers(wrapper)
    assert base is wrapper.model.language_model and len(layers) == 8
    drafter = untrained(wrapper)
    for _, spec, plain in _oracle_runs(wrapper, PROMPTS[:2]) + [
        (p, dflash_generate(wrapper, drafter, p, MAX_NEW), plain_ids(wrapper, p)) for p in PROMPTS[:2]
    ]:
        assert spec.output_ids == plain
        assert spec.rollback == "mixers" and spec.rollback_forwards > 0


def test_greedy_on_a_plain_llama_is_unchanged_and_costs_nothing_extra(tmp_path):
    llama, _ = make_target(tmp_path)
    layer_ids = [1, 3, 5]
    for _, spec, plain in _oracle_runs(llama, PROMPTS, layer_ids):
        assert spec.output_ids == plain and min(spec.accepted_lengths) < BS
        assert (spec.rollback, spec.rollback_forwards, spec.rollback_tokens) == ("none", 0, 0)
    spec = dflash_generate(llama, untrained(llama, layer_ids), PROMPTS[0], MAX_NEW)
    assert spec.output_ids == plain_ids(llama, PROMPTS[0]) and spec.rollback == "none"


# ---------------------------------------------------------------------------------------------
# sampling: every token drawn from the target's true conditional distribution


def test_sampling_on_hybrid_uses_the_targets_true_distributions(hybrid):
    """Speculative sampling keeps the target's distribution when (a) the acceptance rule does, which
    test_speculative checks on its own, and (b) the target probabilities it uses are the true conditionals
    of the accepted prefix. (b) is what a wrong rollback breaks: here every logit row the decoder could
    have used (a verify row whose inputs are all accepted tokens) equals a fresh forward's over the final
    sequence, and every generated token after the first was drawn from such a row."""
    records = []

    def hook(module, args, kwargs, output):
        records.append((kwargs["input_ids"][0].tolist(), int(kwargs["position_ids"][0, 0]), output.logits[0].clone()))

    drafter = untrained(hybrid)
    handle = hybrid.register_forward_hook(hook, with_kwargs=True)
    try:
        runs = []
        for seed in range(3):
            for p in PROMPTS[:2]:
                records.clear()
                g = torch.Generator().manual_seed(seed)
                spec = dflash_generate(hybrid, drafter, p, 12, temperature=1.0, generator=g)
                runs.append((p, spec, list(records)))
    finally:
        handle.remove()
    checked = rollbacks = 0
    for p, spec, recs in runs:
        seq = p + spec.output_ids
        with torch.no_grad():
            full = hybrid(input_ids=torch.tensor([seq])).logits[0]
        covered = set()
        for ids, pos, logits in recs:
            first = len(ids) - logits.shape[0]  # rows are the last positions (the prefill keeps one)
            for row in range(logits.shape[0]):
                k = first + row
                if ids[: k + 1] != seq[pos : pos + k + 1]:
                    break  # from here on the rows saw a rejected draft
                torch.testing.assert_close(logits[row], full[pos + k], rtol=1e-4, atol=1e-5)
                covered.add(pos + k + 1)  # the position whose token this row's distribution decides
                checked += 1
        assert set(range(len(p), len(seq))) <= covered  # every generated token came from a checked row
        rollbacks += spec.rollback_forwards
    assert rollbacks > 0 and checked > 30


# ---------------------------------------------------------------------------------------------
# the wrapper as a feature source; which kernels run


def test_features_of_the_wrapper_equal_hf_hidden_states(wrapper):
    ids = torch.tensor([PROMPTS[2]])
    assert resolve_target_layer_ids(wrapper, None, 3) == [1, 3, 5]  # text_config.num_hidden_layers = 8
    assert resolve_target_layer_ids(wrapper.config.to_dict(), None, 3) == [1, 3, 5]
    with torch.no_grad():
        ref = wrapper(input_ids=ids, output_hidden_states=True).hidden_states
        with FeatureCapture(wrapper, LAYER_IDS) as cap:
            wrapper(input_ids=ids)
            captured = cap.pop()
    expect = torch.cat([ref[i + 1] for i in LAYER_IDS], dim=-1)
    torch.testing.assert_close(captured, expect, rtol=0, atol=0)
    extracted = TargetFeatureExtractor(wrapper, LAYER_IDS)(ids, torch.ones_like(ids), dtype=torch.float32)
    assert extracted.shape == (1, ids.shape[1], 3 * 32)
    torch.testing.assert_close(extracted, expect, rtol=1e-5, atol=1e-6)


def test_kernel_report_names_the_reference_path_without_the_gpu_packages(hybrid, tmp_path):
    import importlib.util

    report = linear_attention_kernels(hybrid)
    assert set(report["functions"]) == {
        "chunk_gated_delta_rule",
        "fused_recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    }
    have_fla = importlib.util.find_spec("fla") is not None
    have_conv = importlib.util.find_spec("causal_conv1d") is not None
    assert report["functions"]["chunk_gated_delta_rule"] == ("fla" if have_fla else "torch")
    assert report["functions"]["causal_conv1d_fn"] == ("causal_conv1d" if have_conv else "torch")
    assert report["fast"] == (have_fla and have_conv)
    assert report["summary"].startswith("linear attention: ")
    llama, _ = make_target(tmp_path)
    assert linear_attention_kernels(llama) == {"fast": None, "functions": {}, "summary": "no linear-attention layers"}
