"""DFlash speculative decoding with an HF target and a :class:`DFlashDraftModel` (plain torch + transformers).

One step (z-lab/dflash ``dflash_generate``; DFlash paper arXiv 2602.06036):

1. the last accepted token ``x_s`` sits at position ``s`` (it is *not* yet in the target's KV cache);
2. the drafter gets the block ``[x_s, MASK x (block_size-1)]`` at positions ``s .. s+block_size-1`` and
   the target features of every accepted position ``< s`` (as in training: context strictly before the
   anchor), and proposes ``d_1 .. d_{block_size-1}`` = argmax of its logits at block positions 1..;
3. the target runs ONE forward over ``[x_s, d_1, ..]`` on top of its KV cache (prefix ``< s``) and gives
   ``y_k`` = its greedy next token after ``[.., x_s, d_1..d_k]``;
4. the longest prefix with ``d_k == y_{k-1}`` is accepted, plus the target's own next token (the bonus),
   so every step yields between 1 and ``block_size`` tokens, all identical to plain greedy decoding;
5. the verification pass's features of the accepted positions (``x_s, d_1..d_j``) extend the drafter's
   context, and the target's cache is brought back to the accepted prefix: attention layers are cropped;
   linear-attention layers of hybrid targets (Qwen3.5/3.6 Gated DeltaNet, whose recurrent state cannot be
   cropped) are restored from a snapshot taken before the verify forward and advanced over the accepted
   tokens (:class:`~dflash_assets.dflash.target.hybrid_cache.VerifyRollback`; that extra target work is counted
   in :class:`SpecResult`).

Target features of position ``p`` are the outputs of decoder layers ``target_layer_ids`` at ``p``,
concatenated in that order (HF ``hidden_states[i + 1]``; for the last layer HF's final-norm output),
exactly what :class:`~dflash_assets.dflash.target.features.TargetFeatureExtractor` stores in shards.

With ``temperature > 0`` drafts are sampled from the drafter and accepted by the standard speculative
sampling rule (Leviathan et al. 2023 / Chen et al. 2023: accept ``d`` with probability
``min(1, p(d)/q(d))``, on rejection resample from ``norm(max(0, p - q))``), which keeps the target's
sampling distribution.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dflash_assets.dflash.target.features import find_decoder_layers
from dflash_assets.dflash.target.hybrid_cache import VerifyRollback

__all__ = [
    "FeatureCapture",
    "SpecResult",
    "cached_target_forward",
    "dflash_generate",
    "target_generate",
]


@dataclass
class SpecResult:
    """Result of one generation.

    Attributes:
        output_ids: generated token ids only (the prompt excluded), in order; ends with an EOS id when
            generation stopped on one.
        accepted_lengths: tokens produced by each target verification step (accepted drafts + the
            bonus token, after any EOS cut), in ``[1, block_size]``; the prefill, which yields the
            first token, is not a verification step and is not listed. Plain decoding lists 1 per
            decode step.
        num_target_forwards: target forward passes, prefill included
            (``1 + len(accepted_lengths)``).
        wall_s: wall-clock seconds of the whole generation (prefill included).
        stopped_on_eos: whether the last token is one of ``eos_token_ids``.
        num_draft_forwards: drafter forward passes (0 for plain decoding).
        num_target_tokens: tokens fed through those target forwards (prompt + every verified token).
        rollback: how the target's cache was brought back to the accepted prefix after a partial
            acceptance: ``none`` (attention layers only: cropped, no extra work), ``mixers`` (hybrid
            target: linear-attention mixers re-run) or ``forward`` (hybrid target: whole target re-run);
            see :class:`~dflash_assets.dflash.target.hybrid_cache.VerifyRollback`.
        rollback_forwards: extra target passes those rollbacks ran (``mixers``: passes of the
            linear-attention token mixers only; ``forward``: whole target forwards); 0 for ``none``.
        rollback_tokens: tokens those extra passes re-ran.
    """

    output_ids: list[int]
    accepted_lengths: list[int]
    num_target_forwards: int
    wall_s: float
    stopped_on_eos: bool = False
    num_draft_forwards: int = 0
    num_target_tokens: int = 0
    rollback: str = "none"
    rollback_forwards: int = 0
    rollback_tokens: int = 0

    @property
    def num_new_tokens(self) -> int:
        """``len(output_ids)``."""
        return len(self.output_ids)


class FeatureCapture:
    """Forward hooks that keep the outputs of ``target_layer_ids`` during a full target forward.

    Unlike :class:`TargetFeatureExtractor` the forward is not stopped early (the logits and KV cache are
    needed). Use as a context manager; after each target forward, :meth:`pop` returns
    ``[B, T, len(target_layer_ids) * hidden_size]`` (target dtype), slice ``k`` = layer
    ``target_layer_ids[k]``; the last decoder layer is passed through the model's final norm, matching
    HF ``hidden_states[L]``.

    Raises:
        ValueError: an id outside ``[0, num_layers)``.
    """

    def __init__(self, model: nn.Module, target_layer_ids: Sequence[int]) -> None:
        self.base_model, self.layers = find_decoder_layers(model)
        self.target_layer_ids = [int(i) for i in target_layer_ids]
        bad = [i for i in self.target_layer_ids if not 0 <= i < len(self.layers)]
        if bad or not self.target_layer_ids:
            raise ValueError(f"target_layer_ids {self.target_layer_ids} invalid for {len(self.layers)} layers")
        self.final_norm = getattr(self.base_model, "norm", None)
        self._outputs: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, layer_id: int):
        def hook(module, args, output):
            states = output[0] if isinstance(output, (tuple, list)) else output
            if layer_id == len(self.layers) - 1 and self.final_norm is not None:
                states = self.final_norm(states)  # HF reports the normed output for the last layer
            self._outputs[layer_id] = states

        return hook

    def __enter__(self) -> FeatureCapture:
        for i in sorted(set(self.target_layer_ids)):
            self._handles.append(self.layers[i].register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._outputs.clear()

    def pop(self) -> torch.Tensor:
        """Features of the last forward, ``[B, T, n * H]``; clears the stored outputs.

        Raises:
            RuntimeError: a needed layer did not run since the last call.
        """
        missing = [i for i in self.target_layer_ids if i not in self._outputs]
        if missing:
            raise RuntimeError(f"layers {missing} produced no output")
        out = torch.cat([self._outputs[i] for i in self.target_layer_ids], dim=-1)
        self._outputs.clear()
        return out


# ---------------------------------------------------------------------------------------------
# helpers


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt_tensor(input_ids, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"batch size must be 1, got input_ids of shape {tuple(ids.shape)}")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError("input_ids must be a non-empty [P] or [1, P] sequence")
    return ids.to(device)


def _cache_kwarg(target: nn.Module) -> str:
    # transformers 5.x renames past_key_values -> cache (the old name is deprecated until 5.40).
    params = inspect.signature(target.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(target: nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=target.config)
    except TypeError:  # older transformers
        return DynamicCache()


def _target_forward(target, ids: torch.Tensor, start: int, cache, cache_kw: str, logits_to_keep: int = 0):
    positions = torch.arange(start, start + ids.shape[-1], device=ids.device)[None]
    return target(
        input_ids=ids[None], position_ids=positions, use_cache=True, logits_to_keep=logits_to_keep, **{cache_kw: cache}
    )


def cached_target_forward(target: nn.Module, ids: torch.Tensor, start: int, cache=None, logits_to_keep: int = 0):
    """One target forward over ``ids`` (int64 ``[T]``) at positions ``start .. start+T-1``, extending ``cache`` (a
    ``DynamicCache`` holding positions ``0 .. start-1``; None: a new one, ``start`` 0). Returns ``(output, cache)``;
    ``output.logits`` is ``[1, logits_to_keep or T, V]``."""
    cache = _new_cache(target) if cache is None else cache
    return _target_forward(target, ids, start, cache, _cache_kwarg(target), logits_to_keep=logits_to_keep), cache


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy argmax (``temperature <= 0``) or a sample from ``softmax(logits / T)``; [..., V] -> [...]."""
    if temperature <= 0:
        return logits.argmax(-1)
    p = _probs(logits, temperature)
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(p.shape[:-1])


def _eos_cut(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, False


def _accept_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """(number of accepted drafts ``j``, bonus token): ``j`` = longest prefix with ``drafts[k] == argmax``."""
    posterior = target_logits.argmax(-1)  # [vs]: target's next token after each block position
    n = drafts.shape[0]
    match = (drafts == posterior[:n]).to(torch.int64)
    j = int(match.cumprod(0).sum()) if n else 0
    return j, int(posterior[j])


def _accept_sampling(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1): accept ``d_k`` w.p. ``min(1, p/q)``."""
    p = _probs(target_logits, temperature)  # [vs, V]
    n = drafts.shape[0]
    for k in range(n):
        d = int(drafts[k])
        pk, qk = float(p[k, d]), float(draft_probs[k, d])
        u = float(torch.rand((), generator=generator, device=p.device))
        if qk <= 0 or u * qk >= pk:  # rejected: resample from the residual max(0, p - q)
            residual = (p[k] - draft_probs[k]).clamp_min(0)
            total = residual.sum()
            dist = residual / total if float(total) > 0 else p[k]
            return k, int(torch.multinomial(dist[None], 1, generator=generator)[0, 0])
    return n, int(torch.multinomial(p[n][None], 1, generator=generator)[0, 0])


# ---------------------------------------------------------------------------------------------
# generation


@torch.inference_mode()
def _draft_settings(drafter, target_layer_ids, block_size, mask_token_id) -> tuple[list[int], int, int]:
    """``(target_layer_ids, block_size, mask_token_id)``: those given, else ``drafter.config``'s.

    Raises:
        ValueError: ``block_size < 2``.
    """
    cfg = getattr(drafter, "config", None)
    layer_ids = list(target_layer_ids if target_layer_ids is not None else cfg.target_layer_ids)
    block = int(block_size if block_size is not None else cfg.block_size)
    if block < 2:
        raise ValueError(f"block_size must be >= 2, got {block}")
    return layer_ids, block, int(mask_token_id if mask_token_id is not None else cfg.mask_token_id)


def _extend_context(drafter, draft_cache, context: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Newly accepted positions' features into the drafter's context: its key/value cache when it keeps one
    (the context tensor is then returned as is), else appended to ``context`` ``[1, C, n*H]``."""
    if draft_cache is not None:
        drafter.extend_context(draft_cache, features)
        return context
    return torch.cat([context, features], dim=1)


def _draft(drafter, block, last: int, start: int, verify: int, draft_cache, context, temperature, generator):
    """One drafter forward over ``[last, MASK..]`` at positions ``start ..``: ``(drafts [verify-1], their
    probabilities or None)`` on the drafter's device; no forward (empty drafts) when ``verify <= 1``. The context
    comes from ``draft_cache`` (projected keys/values) or, None, from ``context`` (features ``[1, C, n*H]``)."""
    if verify <= 1:
        return torch.zeros(0, dtype=torch.long, device=block.device), None
    block[0, 0] = last
    if draft_cache is not None:
        hidden = drafter.forward_block(block, draft_cache)
    else:
        positions = torch.arange(start + block.shape[1], device=block.device)[None]
        hidden = drafter(block, target_hidden=context, position_ids=positions, attention_mask=None)
    draft_logits = drafter.compute_logits(hidden[0, 1:verify])  # [verify-1, V]
    if temperature > 0:
        probs = _probs(draft_logits, temperature)
        return torch.multinomial(probs, 1, generator=generator)[:, 0], probs
    return draft_logits.argmax(-1), None


def _accept(drafts: torch.Tensor, draft_probs, logits: torch.Tensor, temperature: float, generator) -> tuple[int, int]:
    """``(accepted drafts, the target's bonus token)`` of one verification (``logits`` [verify, V]): greedy, or the
    speculative sampling rule when ``temperature > 0``."""
    if temperature > 0 and draft_probs is not None:
        return _accept_sampling(drafts, draft_probs.to(logits.device), logits, temperature, generator)
    if temperature > 0:
        return 0, int(_choose(logits[-1], temperature, generator))
    return _accept_greedy(drafts, logits)


def target_generate(
    target: nn.Module,
    input_ids,
    max_new_tokens: int,
    eos_token_ids: Iterable[int] | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> SpecResult:
    """Plain autoregressive decoding with a KV cache: one target forward per generated token.

    Args:
        target: HF causal LM (``*ForCausalLM``), batch size 1.
        input_ids: prompt, list[int] or int tensor [P] / [1, P].
        max_new_tokens: upper bound on generated tokens (>= 1).
        eos_token_ids: stop right after emitting any of these (the EOS token is kept in the output).
        temperature: 0 = greedy (argmax; ties go to the lowest id); > 0 samples from
            ``softmax(logits / temperature)``.

    Returns:
        :class:`SpecResult` with ``accepted_lengths == [1] * (num_target_forwards - 1)``.

    Raises:
        ValueError: ``max_new_tokens < 1`` or a malformed prompt.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = _device_of(target)
    eos = {int(t) for t in (eos_token_ids or ())}
    prompt = _prompt_tensor(input_ids, device)
    cache_kw = _cache_kwarg(target)
    _sync(device)
    t0 = time.perf_counter()
    cache = _new_cache(target)
    out = _target_forward(target, prompt, 0, cache, cache_kw, logits_to_keep=1)
    tok = int(_choose(out.logits[0, -1], temperature, generator))
    generated, forwards = [tok], 1
    stopped = tok in eos
    while not stopped and len(generated) < max_new_tokens:
        pos = prompt.shape[0] + len(generated) - 1
        out = _target_forward(target, torch.tensor([tok], device=device), pos, cache, cache_kw, logits_to_keep=1)
        forwards += 1
        tok = int(_choose(out.logits[0, -1], temperature, generator))
        generated.append(tok)
        stopped = tok in eos
    _sync(device)
    return SpecResult(
        generated,
        [1] * (forwards - 1),
        forwards,
        time.perf_counter() - t0,
        stopped,
        num_target_tokens=prompt.shape[0] + forwards - 1,
    )


@torch.inference_mode()
def dflash_generate(
    target: nn.Module,
    drafter: nn.Module,
    input_ids,
    max_new_tokens: int,
    target_layer_ids: Sequence[int] | None = None,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    use_context_cache: bool = True,
    rollback: str = "auto",
) -> SpecResult:
    """Speculative decoding of one prompt with a DFlash drafter (see the module docstring for the step).

    Args:
        target: HF causal LM in ``eval()`` mode (batch size 1, KV cache via ``DynamicCache``).
        drafter: a :class:`DFlashDraftModel` with the target's embedding / LM head attached, or any module
            with the same ``forward(input_ids, target_hidden=[1, C, n*H], position_ids=[1, C+Q],
            attention_mask=None) -> [1, Q, H]`` and ``compute_logits([.., H]) -> [.., V]``.
        input_ids: prompt, list[int] or int tensor [P] / [1, P].
        max_new_tokens: upper bound on generated tokens (>= 1); the last step verifies only as many
            drafts as still fit, so no target work is spent past the limit.
        target_layer_ids, block_size, mask_token_id: default to ``drafter.config``'s; must equal what
            the drafter was trained with. The drafter always sees a full ``block_size`` block (as in
            training); fewer drafts are verified only near ``max_new_tokens``.
        eos_token_ids: stop right after the first of these that is produced (kept in the output),
            exactly as :func:`target_generate` does.
        temperature: 0 = greedy verification (output equals :func:`target_generate` token for token);
            > 0 = speculative sampling (same distribution as sampling from the target).
        generator: RNG for ``temperature > 0``, on the target's device (drafter on the same device).
        use_context_cache: with a drafter that has ``extend_context`` / ``forward_block``
            (:class:`DFlashDraftModel`), keep the projected context's per-layer keys/values and project
            only the newly accepted positions each step; False re-projects the whole context every step
            (the reference layout, kept for timing comparisons). Outputs are the same either way.
        rollback: how a hybrid target's linear-attention state is brought back after a partial
            acceptance (:class:`~dflash_assets.dflash.target.hybrid_cache.VerifyRollback`): ``auto`` (default:
            ``mixers`` when possible), ``mixers`` or ``forward``; a target without linear attention
            always uses ``none`` (cropping only).

    Returns:
        :class:`SpecResult`; ``accepted_lengths[i]`` in ``[1, block_size]``.

    Raises:
        ValueError: ``max_new_tokens < 1``, ``block_size < 2``, a malformed prompt, or a ``rollback`` the
            target does not allow.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    target_layer_ids, block_size, mask_token_id = _draft_settings(drafter, target_layer_ids, block_size, mask_token_id)
    device, draft_device = _device_of(target), _device_of(drafter)
    eos = {int(t) for t in (eos_token_ids or ())}
    prompt = _prompt_tensor(input_ids, device)
    cache_kw = _cache_kwarg(target)
    accepted_lengths: list[int] = []
    _sync(device)
    t0 = time.perf_counter()
    cache = _new_cache(target)
    cached = use_context_cache and hasattr(drafter, "extend_context") and hasattr(drafter, "forward_block")
    restore = VerifyRollback(target, cache, rollback)
    target_tokens = prompt.shape[0]
    with FeatureCapture(target, target_layer_ids) as capture, restore:
        out = _target_forward(target, prompt, 0, cache, cache_kw, logits_to_keep=1)
        context = capture.pop().to(draft_device)  # [1, P, n*H]: features of positions 0..P-1
        draft_cache = drafter.extend_context(drafter.new_context_cache(), context) if cached else None
        generated = [int(_choose(out.logits[0, -1], temperature, generator))]
        forwards, draft_forwards, stopped = 1, 0, generated[0] in eos
        block = torch.full((1, block_size), mask_token_id, dtype=torch.long, device=draft_device)
        while not stopped and len(generated) < max_new_tokens:
            start = prompt.shape[0] + len(generated) - 1  # position of the last token (not in the KV cache)
            verify = min(block_size, max_new_tokens - len(generated))  # tokens this step may produce
            last = generated[-1]
            drafts, draft_probs = _draft(
                drafter, block, last, start, verify, draft_cache, context, temperature, generator
            )
            drafts = drafts.to(device)
            draft_forwards += int(verify > 1)
            verify_ids = torch.cat([torch.tensor([last], device=device), drafts])
            restore.before_verify(verify_ids.shape[0])
            out = _target_forward(target, verify_ids, start, cache, cache_kw, logits_to_keep=0)
            forwards, target_tokens = forwards + 1, target_tokens + verify_ids.shape[0]
            feats = capture.pop()  # [1, verify, n*H] at positions start .. start+verify-1
            j, bonus = _accept(drafts, draft_probs, out.logits[0], temperature, generator)
            new, stopped = _eos_cut([*drafts[:j].tolist(), bonus], eos)
            generated.extend(new)
            accepted_lengths.append(len(new))
            # accepted positions start .. start+len(new)-1 hold [last, d_1..d_j]: the next block's context
            context = _extend_context(drafter, draft_cache, context, feats[:, : len(new)].to(draft_device))

            def replay(n: int, ids=verify_ids, at=start) -> None:  # rollback "forward": the accepted tokens again
                _target_forward(target, ids[:n], at, cache, cache_kw, logits_to_keep=1)
                capture.pop()  # the same features as the verify pass's; not needed

            restore.after_verify(start, verify_ids.shape[0], len(new), replay)
    _sync(device)
    return SpecResult(
        generated, accepted_lengths, forwards, time.perf_counter() - t0, stopped, draft_forwards, target_tokens,
        restore.mode, restore.forwards, restore.tokens,
    )  # fmt: skip
