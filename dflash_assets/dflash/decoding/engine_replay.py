"""The engine's speculative decoding replayed here, step by step: does the drafter this process holds propose what
the engine's did? (plain torch + transformers)

A greedy speculative decoder with a lossless verifier writes the target's greedy continuation ``y`` of the prompt
``x`` whatever it drafts; a verification step anchored at the last accepted token ``y_a`` drafts
``d_1 .. d_K`` from the target's features of the positions before it, and accepts the leading drafts equal to
``y_{a+1} ..``, plus one token of the target's own. Given the engine's output and its accepted count at each step,
everything the engine's drafter saw is known: the same tokens, hence (up to float rounding) the same target
features, one forward over ``x + y``. So each engine step is replayed independently of the others, at the
engine's own anchor, and compared with the accepted count the engine reported. A difference names the step and the
draft position where the two drafters parted, and it cannot cascade into later steps.

Float rounding is the only legitimate source of difference (the engine's kernels and summation order are not
ours), besides what an engine is known to compute otherwise, replayed as it computes it
(:func:`with_context_k_norm_of_layer0`): a difference at a draft position where this drafter's two candidate
tokens are within ``tolerance`` logits of each other is a tie, counted apart; any other is a mismatch, which the
export, the engine's loader or the features caused (a wrong target-layer map, mask token, template, loader key or saved
weight all move logits by far more; the tests inject each). The same one forward also checks the engine's
output itself against the target here (teacher forced: each token the argmax of the target's logits, ties
allowed the same way).

Beside the parity, the replay walks this drafter's own chain of anchors over the same output (next anchor =
anchor + accepted + 1), which is what in-process speculative decoding would measure on these prompts, at the
cost of one target forward and a few drafter forwards per prompt instead of a decode.

Prompts of an evaluation share long prefixes (the turns of one agentic conversation: each turn's prompt is the one
before, its reply and the tool's result; 73% of the main job's replayed tokens): a :class:`PrefixCache` keeps the
last sequence's KV cache and features, and the next forward runs over what differs only (attention-only targets;
a linear-attention layer's recurrent state cannot be cut back to a prefix). One forward also serves several
drafters (the trained one and its untrained floor).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash_assets.dflash.decoding.speculative import FeatureCapture, cached_target_forward
from dflash_assets.dflash.shards.dataset import collate_training_batch
from dflash_assets.dflash.target.hybrid_cache import crop_attention_layers

__all__ = [
    "PrefixCache",
    "PromptReplay",
    "StepDifference",
    "numeric_tolerance",
    "prefix_reusable",
    "replay_prompt",
    "replay_prompt_drafters",
    "with_context_k_norm_of_layer0",
]

#: logits within which two candidate tokens count as tied, by the dtype both sides decode in: float32 rounding
#: through a few hundred accumulations moves a logit by ~1e-4 (seen: |engine - here| up to 2e-4 on the demo's
#: drafter in vLLM's CPU build); bf16 / fp16 keep 8 / 11 bits of mantissa, ~1e-2 relative on logits of order 10
_TOLERANCE = {torch.float32: 0.02, torch.float64: 0.02, torch.bfloat16: 0.5, torch.float16: 0.1}


def numeric_tolerance(dtype: torch.dtype) -> float:
    """Logits within which two candidate tokens are tied when the engine and this process decode in ``dtype``."""
    return _TOLERANCE.get(dtype, 0.5)


def with_context_k_norm_of_layer0(drafter: nn.Module) -> nn.Module:
    """A copy of ``drafter`` whose every layer normalises its context's keys with layer 0's ``k_norm`` weight, as
    vLLM's CPU build computes a DFlash drafter (0.32.0): its context-key path normalises the keys of all layers in
    one ``rms_norm`` call with the per-layer weights stacked ``[num_layers, head_dim]``, and the CPU kernel applies
    the first row to every layer (:func:`~dflash_assets.stages.evaluation.vllm_probe.grouped_rms_norm_probe`
    measures it in the engine's own environment). The block's own keys and everything else are the model's. The
    weights are shared with ``drafter``, not copied; ``drafter`` is unchanged."""
    first = drafter.layers[0].self_attn.k_norm.weight.detach()
    layers = []
    for layer in drafter.layers:  # shallow copies: parameters and the target's head are shared, not duplicated
        attn = copy.copy(layer.self_attn)
        attn._buffers = {**layer.self_attn._buffers, "context_k_norm_weight": first}
        shell = copy.copy(layer)
        shell._modules = {**layer._modules, "self_attn": attn}
        layers.append(shell)
    engine = copy.copy(drafter)
    engine._modules = {**drafter._modules, "layers": nn.ModuleList(layers)}
    return engine


@dataclass
class StepDifference:
    """One engine step whose accepted count this process does not reproduce.

    Attributes:
        step: 0-based verification step of the prompt; anchor: absolute position of its anchor token;
        position: 1-based draft position where the two parted; engine_accepted / here_accepted: drafts accepted;
        engine_token: the output's token at that position (what the target wrote); here_token: this drafter's
        draft there; margin: logits between this drafter's choice and the other candidate (>= 0);
        tie: ``margin <= tolerance``.
    """

    step: int
    anchor: int
    position: int
    engine_accepted: int
    here_accepted: int
    engine_token: int
    here_token: int
    margin: float
    tie: bool


@dataclass
class PromptReplay:
    """The replay of one prompt's engine output.

    Attributes:
        engine_accepted: per engine step, its accepted drafts (capped at the tokens the reply carries);
        here_accepted: per engine step, the drafts this drafter would have had accepted at the same anchor;
        differences: the steps where those differ (ties included, flagged);
        own_accepted_lengths: accepted length (drafts + 1) of each step of this drafter's own chain over the
            output (the in-process speculative decoding of this output);
        target_mismatches: ``(output index, engine token, target's argmax, margin)`` where the output is not the
            target's greedy token here beyond the tolerance; target_ties: such places within it.
    """

    engine_accepted: list[int] = field(default_factory=list)
    here_accepted: list[int] = field(default_factory=list)
    differences: list[StepDifference] = field(default_factory=list)
    own_accepted_lengths: list[int] = field(default_factory=list)
    target_mismatches: list[tuple[int, int, int, float]] = field(default_factory=list)
    target_ties: int = 0

    @property
    def mismatches(self) -> list[StepDifference]:
        """The differences beyond the numeric tolerance."""
        return [d for d in self.differences if not d.tie]


def prefix_reusable(target: nn.Module) -> bool:
    """Whether ``target``'s KV cache can be cut back to a prefix and extended (:class:`PrefixCache`): every layer
    full attention (``layer_types`` absent or all ``full_attention``, no active sliding window). A hybrid target's
    linear-attention state (Qwen3.5/3.6) holds the whole sequence in a fixed-size state and cannot be cut."""
    config = getattr(target, "config", None)
    config = getattr(config, "text_config", None) or config
    if config is None:
        return False
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return False
    return not (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))


class PrefixCache:
    """The last sequence a replay ran the target over: its ids, KV cache and features, so the next sequence's
    forward runs only over what follows their common prefix (:func:`prefix_reusable` targets; otherwise every
    forward is whole). Features of a shared prefix equal a whole forward's up to float rounding (another
    summation order), far inside :func:`numeric_tolerance`. Memory: one sequence's KV cache and features.

    Attributes:
        reused_tokens / total_tokens: tokens taken from the cache / of every sequence run (for the log).
    """

    def __init__(self, target: nn.Module) -> None:
        self.enabled = prefix_reusable(target)
        self.ids: torch.Tensor | None = None
        self.cache = None
        self.features: torch.Tensor | None = None
        self.reused_tokens = 0
        self.total_tokens = 0

    def shared(self, ids: torch.Tensor, keep: int) -> int:
        """Tokens of ``ids`` [T] the next forward can take from the cache: the common prefix with the last
        sequence, leaving the last ``keep`` positions (whose logits are wanted) to the forward."""
        if not self.enabled or self.ids is None:
            return 0
        n = min(self.ids.numel(), ids.numel() - keep)
        if n <= 0:
            return 0
        same = (self.ids[:n] == ids[:n].to(self.ids.device)).to(torch.int64)
        return int(same.cumprod(0).sum())


@torch.no_grad()
def _features_and_logits(
    target: nn.Module, ids: torch.Tensor, layer_ids: Sequence[int], keep: int, prefix: PrefixCache | None = None
):
    """Target features ``[T, n*H]`` float32 of ``ids`` [T] and the logits ``[keep, V]`` float32 of its last ``keep``
    positions, from one forward (over what follows the prefix ``prefix`` holds, when it holds one)."""
    shared = prefix.shared(ids, keep) if prefix is not None else 0
    with FeatureCapture(target, layer_ids) as capture:
        if prefix is None or not prefix.enabled:
            out = target(input_ids=ids[None], logits_to_keep=keep, use_cache=False)
            features = capture.pop()[0].float()
        else:
            cache = prefix.cache if shared else None
            if cache is not None:
                crop_attention_layers(cache, shared)
            out, cache = cached_target_forward(target, ids[shared:], shared, cache, logits_to_keep=keep)
            new = capture.pop()[0].float()
            features = torch.cat([prefix.features[:shared], new]) if shared else new
            prefix.ids, prefix.cache, prefix.features = ids, cache, features
            prefix.reused_tokens += shared
    if prefix is not None:
        prefix.total_tokens += ids.numel()
    return features, out.logits[0].float()


@torch.no_grad()
def _block_logits(drafter: nn.Module, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, first: int):
    """Drafter logits ``[M, K+1, V]`` float32 of the blocks anchored at ``anchors`` (int64 [M]), each seeing the
    features of positions before its anchor, as in training (:func:`collate_training_batch`)."""
    bs = int(drafter.config.block_size)
    mask_id = int(drafter.config.mask_token_id)
    t = ids.shape[0]
    pad = max(0, int(anchors.max()) + bs - t)  # blocks near the end run past the output: padded, never compared
    loss_mask = torch.zeros(t + pad, dtype=torch.long)
    loss_mask[first:t] = 1
    sample = {
        "input_ids": torch.cat([ids.cpu(), torch.full((pad,), mask_id, dtype=torch.long)]),
        "loss_mask": loss_mask,
        "hidden_states": torch.cat([features, features[-1:].expand(pad, -1)]) if pad else features,
    }
    device = drafter.fc.weight.device
    batch = collate_training_batch([sample], [anchors], bs, mask_id).to(device)
    hidden = drafter(
        batch.block_input_ids,
        target_hidden=batch.context_hidden.to(drafter.fc.weight.dtype),
        position_ids=batch.position_ids,
        attention_mask=batch.attention_mask,
    )
    m = anchors.numel()
    head = drafter.target_lm_head_weight
    return torch.nn.functional.linear(hidden[0, : m * bs].float(), head.float()).view(m, bs, -1)


def _accepted(drafts: torch.Tensor, truth: torch.Tensor) -> int:
    """Leading drafts (``[K]``) equal to ``truth`` (``[<= K]``: the output's next tokens, fewer at its end)."""
    n = min(drafts.numel(), truth.numel())
    hits = (drafts[:n] == truth[:n]).to(torch.int64)
    return int(hits.cumprod(0).sum())


@torch.no_grad()
def replay_prompt(
    target: nn.Module,
    drafter: nn.Module,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    engine_steps: Sequence[Sequence[int]] | None,
    *,
    tolerance: float,
    anchors_per_forward: int = 64,
    prefix: PrefixCache | None = None,
) -> PromptReplay:
    """Replay one prompt's engine output (see the module docstring).

    Args:
        target: the HF target (its features must be the drafter's: ``drafter.config.target_layer_ids``).
        drafter: :class:`~dflash_assets.dflash.model.draft_model.DFlashDraftModel` with the target's head attached.
        prompt_ids, output_ids: what the engine read and wrote (token ids; the output is greedy).
        engine_steps: ``(drafted, accepted)`` per verification step, in order (vLLM's per-request figures); None:
            no engine steps (the output of plain decoding), only the target check and this drafter's own chain.
        tolerance: logits within which two candidates tie (:func:`numeric_tolerance`).
        anchors_per_forward: drafter blocks per forward.
        prefix: the :class:`PrefixCache` of the replay's earlier prompts (None: a whole forward, nothing kept).

    Returns:
        :class:`PromptReplay`.

    Raises:
        ValueError: the prompt or the output is empty.
    """
    replays = replay_prompt_drafters(
        target, {"drafter": drafter}, prompt_ids, output_ids, engine_steps, tolerance=tolerance,
        anchors_per_forward=anchors_per_forward, prefix=prefix,
    )  # fmt: skip
    return replays["drafter"]


@torch.no_grad()
def replay_prompt_drafters(
    target: nn.Module,
    drafters: Mapping[str, nn.Module],
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    engine_steps: Sequence[Sequence[int]] | None,
    *,
    tolerance: float,
    anchors_per_forward: int = 64,
    prefix: PrefixCache | None = None,
) -> dict[str, PromptReplay]:
    """:func:`replay_prompt` for several drafters over one target forward (``{name: PromptReplay}``, the names of
    ``drafters``); the target check is the same for all.

    Raises:
        ValueError: the prompt or the output is empty, no drafter, or the drafters read different target layers.
    """
    p, n = len(prompt_ids), len(output_ids)
    if p == 0 or n == 0:
        raise ValueError("replay needs a prompt and at least one output token")
    if not drafters:
        raise ValueError("replay needs at least one drafter")
    layer_sets = {tuple(int(i) for i in d.config.target_layer_ids) for d in drafters.values()}
    if len(layer_sets) != 1:
        raise ValueError(f"the drafters replayed together must read the same target layers, got {sorted(layer_sets)}")
    device = next(target.parameters()).device
    ids = torch.tensor([*prompt_ids, *output_ids], dtype=torch.long)
    features, logits = _features_and_logits(target, ids.to(device), list(layer_sets.pop()), n + 1, prefix)
    checked = PromptReplay()
    _check_target(checked, logits[:n], ids[p:], tolerance)
    return {
        name: _replay_drafter(drafter, ids, features, p, n, engine_steps, checked, tolerance, anchors_per_forward)
        for name, drafter in drafters.items()
    }


def _replay_drafter(drafter, ids, features, p, n, engine_steps, checked, tolerance, anchors_per_forward):
    """One drafter's :class:`PromptReplay` given the target's features of ``ids`` (prompt ``p`` + output ``n``)."""
    out = PromptReplay(target_mismatches=list(checked.target_mismatches), target_ties=checked.target_ties)
    # drafts at every output position a block can start from: anchors p .. p+n-2 (the last token drafts nothing)
    anchors = torch.arange(p, p + n - 1)
    k = int(drafter.config.block_size) - 1
    drafts = torch.empty(anchors.numel(), k, dtype=torch.long)
    top2 = torch.empty(anchors.numel(), k, 2)
    label_logit = torch.empty(anchors.numel(), k)
    for lo in range(0, anchors.numel(), anchors_per_forward):
        chunk = anchors[lo : lo + anchors_per_forward]
        block = _block_logits(drafter, ids, features.cpu(), chunk, p)[:, 1:].cpu()  # [m, K, V]
        drafts[lo : lo + chunk.numel()] = block.argmax(-1)
        top2[lo : lo + chunk.numel()] = block.topk(2, dim=-1).values
        label_pos = (chunk[:, None] + torch.arange(1, k + 1)[None, :]).clamp(max=p + n - 1)
        label_logit[lo : lo + chunk.numel()] = block.gather(-1, ids[label_pos][..., None])[..., 0]

    def here(a: int) -> int:  # drafts accepted at anchor position a
        return _accepted(drafts[a - p], ids[a + 1 : min(a + 1 + k, p + n)])

    a = p
    while a < p + n - 1:
        got = here(a)
        out.own_accepted_lengths.append(min(got + 1, p + n - a - 1))
        a += got + 1
    a = p
    for step, pair in enumerate(engine_steps or []):
        if a >= p + n - 1:
            break  # vLLM observed a step past the reply's last token (its drafts trimmed at the stop)
        # drafts this step verified inside the output: as many as the engine drafted (fewer than K near its token
        # limit), and no more than the output holds after the anchor (vLLM counts accepted drafts it then trims)
        cap = min(int(pair[0]), p + n - 1 - a, k)
        engine, mine = min(int(pair[1]), cap), min(here(a), cap)
        out.engine_accepted.append(engine)
        out.here_accepted.append(mine)
        if engine != mine:
            out.differences.append(_difference(step, a, p, engine, mine, drafts, top2, label_logit, ids, tolerance))
        a += engine + 1
    return out


def _check_target(out: PromptReplay, logits: torch.Tensor, output: torch.Tensor, tolerance: float) -> None:
    """The engine's output against the target's greedy choice here (logits ``[n, V]`` predict ``output`` [n])."""
    argmax = logits.argmax(-1)
    for i in torch.nonzero(argmax != output, as_tuple=False).flatten().tolist():
        margin = float(logits[i, argmax[i]] - logits[i, output[i]])
        if margin <= tolerance:
            out.target_ties += 1
        else:
            out.target_mismatches.append((i, int(output[i]), int(argmax[i]), round(margin, 4)))


def _difference(step, a, p, engine, mine, drafts, top2, label_logit, ids, tolerance) -> StepDifference:
    """The :class:`StepDifference` at the first draft position where the two accepted counts part."""
    j = min(engine, mine)  # 0-based draft index: both accepted the drafts before it
    row = a - p
    if mine > engine:  # here the draft equals the output's token; the engine's did not
        margin = float(top2[row, j, 0] - top2[row, j, 1])
    else:  # the engine's draft was the output's token; this drafter chose another
        margin = float(top2[row, j, 0] - label_logit[row, j])
    return StepDifference(
        step=step,
        anchor=a,
        position=j + 1,
        engine_accepted=engine,
        here_accepted=mine,
        engine_token=int(ids[a + 1 + j]),
        here_token=int(drafts[row, j]),
        margin=round(margin, 5),
        tie=margin <= tolerance,
    )
