"""Measuring a DFlash drafter: acceptance length tau, lossless check, speedup, teacher-forced proxy.

Definitions (DFlash paper arXiv 2602.06036, "average acceptance length tau"; z-lab/dflash
``benchmark.py``): a target verification step yields the accepted drafts plus the target's bonus token,
so its accepted length is in ``[1, block_size]``; tau is the mean over all verification steps of all
prompts (pooled, i.e. total tokens from verification steps / number of verification steps). Plain
decoding has tau = 1 by the same count.

The teacher-forced proxy needs no target forward at all: on stored hidden-state shards (features of
text the target generated itself), the drafter proposes the block at sampled anchors; the accepted
length of that block under greedy verification would be ``1 + (number of leading correct positions)``
exactly when the stored text is the target's greedy output, and its mean estimates tau.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from dflash_assets.dflash.loss import accuracy_per_position, expected_acceptance_length
from dflash_assets.dflash.speculative import SpecResult, dflash_generate, target_generate
from dflash_assets.figures import figure_png_bytes, new_figure

__all__ = [
    "acceptance_histogram",
    "acceptance_histogram_png",
    "acceptance_length",
    "evaluate_drafter",
    "teacher_forced_acceptance",
    "untrained_drafter_like",
]


def acceptance_length(accepted_lengths: Iterable[int]) -> float:
    """tau = mean tokens produced per target verification step (bonus token included).

    ``sum(accepted_lengths) / len(accepted_lengths)``; each entry is in ``[1, block_size]``, so
    ``1 <= tau <= block_size``. Returns NaN for an empty list (e.g. generation ended at the prefill).
    """
    values = [int(v) for v in accepted_lengths]
    return sum(values) / len(values) if values else math.nan


def acceptance_histogram(accepted_lengths: Iterable[int], block_size: int) -> list[int]:
    """Counts of verification steps by accepted length: element ``k - 1`` counts steps accepting ``k``
    tokens, ``k = 1 .. block_size`` (list of ``block_size`` ints).

    Raises:
        ValueError: a length outside ``[1, block_size]``.
    """
    counts = [0] * block_size
    for v in accepted_lengths:
        v = int(v)
        if not 1 <= v <= block_size:
            raise ValueError(f"accepted length {v} outside [1, {block_size}]")
        counts[v - 1] += 1
    return counts


def acceptance_histogram_png(
    series: Sequence[int] | Mapping[str, Sequence[int]],
    block_size: int,
    title: str = "DFlash acceptance length per verification step",
) -> bytes:
    """PNG (bytes) of the distribution of accepted lengths, as fractions of steps per length.

    Args:
        series: accepted lengths of one drafter, or ``{label: accepted_lengths}`` for several (e.g.
            trained vs untrained), drawn as grouped bars with tau in the legend.
        block_size: x axis runs 1 .. block_size.

    Rendered off-screen by :func:`dflash_assets.figures.figure_png_bytes` (Agg, no display needed,
    no ``Software`` text chunk, so equal inputs give equal bytes).
    """
    if not isinstance(series, Mapping):
        series = {"drafter": series}
    fig, ax = new_figure(figsize=(7, 3.6), dpi=100)
    xs = list(range(1, block_size + 1))
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, lengths) in enumerate(series.items()):
        counts = acceptance_histogram(lengths, block_size)
        total = max(1, sum(counts))
        offset = (i - (n - 1) / 2) * width
        tau = acceptance_length(lengths)
        ax.bar([x + offset for x in xs], [c / total for c in counts], width=width,
               label=f"{label} (tau={tau:.2f}, {sum(counts)} steps)")
    ax.set_xlabel("tokens accepted per target forward (incl. bonus)")
    ax.set_ylabel("fraction of verification steps")
    ax.set_xticks(xs)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return figure_png_bytes(fig)


def untrained_drafter_like(drafter: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """A freshly initialised drafter of the same config, device, dtype and attached target head.

    With the training run's ``seed`` and ``init_std`` this is exactly the trained drafter's starting
    point (``dflash.train`` calls ``reset_parameters(init_std, seed=seed)``). Returned in ``eval()`` mode.
    """
    from dflash_assets.dflash.model import DFlashDraftModel

    base = getattr(drafter, "module", drafter)
    fresh = DFlashDraftModel(base.config)
    fresh.reset_parameters(std, seed=seed)
    fresh.to(device=base.fc.weight.device, dtype=base.fc.weight.dtype)
    if base.target_embed_weight is not None:
        fresh.attach_target(base.target_embed_weight, base.target_lm_head_weight)
    return fresh.eval()


def evaluate_drafter(
    target: nn.Module,
    drafter: nn.Module,
    prompts_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_ids: Iterable[int] | None = None,
    target_layer_ids: Sequence[int] | None = None,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    plain_results: Sequence[SpecResult] | None = None,
    warmup: bool = True,
    progress: Callable[[int, int, SpecResult], None] | None = None,
) -> dict:
    """Greedy speculative decoding vs plain greedy decoding of the same prompts, on this machine.

    Args:
        target, drafter: as for :func:`dflash_generate` (both in ``eval()`` mode).
        prompts_ids: token ids of each prompt (chat template applied).
        max_new_tokens: per prompt; eos_token_ids: stop tokens for both decoders.
        target_layer_ids, block_size, mask_token_id: default to ``drafter.config``'s.
        plain_results: earlier :func:`target_generate` results of the same prompts (reused, e.g. when
            comparing several drafters; their ``wall_s`` is used for the speedup).
        warmup: run one 2-token generation of each kind first so one-off costs stay out of the timing.
        progress: called as ``progress(done, total, result)`` after each speculative generation (logging).

    Returns:
        dict with ``tau`` (pooled, see :func:`acceptance_length`), ``per_prompt_tau`` (list),
        ``histogram`` (:func:`acceptance_histogram`), ``accepted_lengths`` (per prompt lists),
        ``block_size``, ``num_prompts``, ``new_tokens`` (total generated), ``target_forwards_plain``,
        ``target_forwards_spec``, ``target_forwards_saved`` (plain - spec), ``forward_reduction``
        (plain / spec), ``wall_s_plain``, ``wall_s_spec`` (seconds, summed over prompts), ``speedup``
        (``wall_s_plain / wall_s_spec``), ``lossless`` (every prompt's speculative output equals the
        plain greedy output token for token), ``mismatched_prompts`` (indices where it does not).

    Raises:
        ValueError: no prompts, or ``plain_results`` of a different length.
    """
    if not prompts_ids:
        raise ValueError("no prompts")
    if plain_results is not None and len(plain_results) != len(prompts_ids):
        raise ValueError("plain_results must have one result per prompt")
    cfg = getattr(drafter, "config", None)
    block_size = int(block_size if block_size is not None else cfg.block_size)
    kw = dict(target_layer_ids=target_layer_ids, block_size=block_size, mask_token_id=mask_token_id,
              eos_token_ids=eos_token_ids)
    eos = list(eos_token_ids or [])
    if warmup:
        dflash_generate(target, drafter, prompts_ids[0], min(2, max_new_tokens), **kw)
        if plain_results is None:
            target_generate(target, prompts_ids[0], min(2, max_new_tokens), eos)
    plain = list(plain_results) if plain_results is not None else [
        target_generate(target, p, max_new_tokens, eos) for p in prompts_ids
    ]
    spec = []
    for p in prompts_ids:
        spec.append(dflash_generate(target, drafter, p, max_new_tokens, **kw))
        if progress is not None:
            progress(len(spec), len(prompts_ids), spec[-1])
    all_lengths = [v for s in spec for v in s.accepted_lengths]
    mismatched = [i for i, (a, b) in enumerate(zip(plain, spec)) if a.output_ids != b.output_ids]
    fw_plain = sum(r.num_target_forwards for r in plain)
    fw_spec = sum(r.num_target_forwards for r in spec)
    wall_plain = sum(r.wall_s for r in plain)
    wall_spec = sum(r.wall_s for r in spec)
    return {
        "tau": acceptance_length(all_lengths),
        "per_prompt_tau": [acceptance_length(s.accepted_lengths) for s in spec],
        "histogram": acceptance_histogram(all_lengths, block_size),
        "accepted_lengths": [list(s.accepted_lengths) for s in spec],
        "block_size": block_size,
        "num_prompts": len(prompts_ids),
        "new_tokens": sum(s.num_new_tokens for s in spec),
        "target_forwards_plain": fw_plain,
        "target_forwards_spec": fw_spec,
        "target_forwards_saved": fw_plain - fw_spec,
        "forward_reduction": fw_plain / fw_spec if fw_spec else math.nan,
        "wall_s_plain": wall_plain,
        "wall_s_spec": wall_spec,
        "speedup": wall_plain / wall_spec if wall_spec > 0 else math.nan,
        "lossless": not mismatched,
        "mismatched_prompts": mismatched,
    }


@torch.no_grad()
def teacher_forced_acceptance(
    drafter: nn.Module,
    dataset,
    *,
    max_anchors: int = 64,
    max_rows: int | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    logits_chunk: int = 1024,
    return_blocks: bool = False,
) -> dict:
    """Teacher-forced acceptance length of ``drafter`` on stored features (no target needed).

    For each row, up to ``max_anchors`` anchors are drawn (``sample_anchors``, generator seeded by
    ``(seed, row)``); every block ``[x_a, MASK..]`` sees the stored features of positions ``< a`` (the
    training layout, :func:`collate_training_batch`), and its accepted length is
    ``1 + (number of leading positions k = 1.. whose argmax equals the stored token x_{a+k})``; a
    position whose label has ``loss_mask == 0`` ends the run. This equals the real greedy acceptance
    length at that anchor when the stored text is the target's own greedy output (up to the features'
    bf16 rounding), and is a proxy otherwise (e.g. sampled completions).

    Args:
        drafter: :class:`DFlashDraftModel` with the target head attached.
        dataset: :class:`HiddenStateShards` (its ``block_size`` should equal the drafter's) or a list of
            shard paths (read with ``split="all"``).
        max_anchors: blocks per row; max_rows: rows evaluated (first ones); device: default the
            drafter's; logits_chunk: block positions whose logits are built at once (memory bound
            ``logits_chunk * vocab_size * 4`` bytes).
        return_blocks: also return the per-block accepted lengths and anchors.

    Returns:
        dict: ``tau`` (mean accepted length over blocks; NaN with no block), ``tau_independent``
        (``expected_acceptance_length`` of the per-position accuracies, which assumes independent
        positions), ``acc_per_position`` (block_size floats, NaN at 0), ``histogram``
        (:func:`acceptance_histogram`), ``num_blocks``, ``num_rows``; with ``return_blocks``,
        ``blocks``: list of ``(row, anchor, accepted_length)``.
    """
    from dflash_assets.dflash.data import HiddenStateShards, collate_training_batch
    from dflash_assets.dflash.masks import sample_anchors

    bs = int(drafter.config.block_size)
    mask_id = int(drafter.config.mask_token_id)
    if isinstance(dataset, (list, tuple)):  # shard paths (a dataset object, e.g. online TokenizedRows, is used as is)
        dataset = HiddenStateShards(list(dataset), split="all", block_size=bs)
    was_training = drafter.training
    drafter.eval()
    device = torch.device(device) if device is not None else drafter.fc.weight.device
    n_rows = len(dataset) if max_rows is None else min(len(dataset), max_rows)
    correct = torch.zeros(bs)
    count = torch.zeros(bs)
    lengths: list[int] = []
    blocks: list[tuple[int, int, int]] = []
    head = drafter.target_lm_head_weight
    for r in range(n_rows):
        sample = dataset[r]
        g = torch.Generator().manual_seed(seed * 1_000_003 + r)
        anchors = sample_anchors(sample["loss_mask"], bs, max_anchors, g)
        m = anchors.numel()
        if m == 0:
            continue
        batch = collate_training_batch([sample], [anchors], bs, mask_id).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            hidden = drafter(batch.block_input_ids, target_hidden=batch.context_hidden,
                             position_ids=batch.position_ids, attention_mask=batch.attention_mask)
        hidden = hidden[0, : m * bs]
        preds = torch.cat([
            torch.nn.functional.linear(hidden[i : i + logits_chunk].float(), head.float()).argmax(-1)
            for i in range(0, hidden.shape[0], logits_chunk)
        ])
        hit = ((preds == batch.labels[0, : m * bs]) & batch.label_mask[0, : m * bs]).view(m, bs).cpu()
        valid = batch.label_mask[0, : m * bs].view(m, bs).cpu()
        correct += hit.float().sum(0)
        count += valid.float().sum(0)
        run = hit[:, 1:].to(torch.int64).cumprod(1).sum(1) + 1  # leading correct drafts + the bonus
        lengths.extend(run.tolist())
        if return_blocks:
            blocks.extend((r, int(a), int(v)) for a, v in zip(anchors.tolist(), run.tolist()))
    drafter.train(was_training)
    acc = accuracy_per_position(correct, count)
    out = {
        "tau": acceptance_length(lengths),
        "tau_independent": expected_acceptance_length(acc),
        "acc_per_position": acc,
        "histogram": acceptance_histogram(lengths, bs),
        "num_blocks": len(lengths),
        "num_rows": n_rows,
    }
    if return_blocks:
        out["blocks"] = blocks
    return out
