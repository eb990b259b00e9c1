"""Measuring a DFlash drafter: acceptance length tau, lossless check, speedup, teacher-forced proxy.

Definitions (DFlash paper arXiv 2602.06036, "average acceptance length tau"; z-lab/dflash
``benchmark.py``): a target verification step yields the accepted drafts plus the target's bonus token,
so its accepted length is in ``[1, block_size]``. Two averages are reported (:func:`tau_statistics`):

* **per-prompt mean** (the headline, as z-lab's benchmark reports a dataset): the mean over prompts of
  each prompt's mean accepted length;
* **pooled**: total tokens from verification steps / number of verification steps over all prompts
  (long prompts weigh more);

both with standard errors across prompts, by :func:`dflash_assets.dflash.tau.tau_from_sums` (the formula
the engine evaluation uses too).

Plain decoding has tau = 1 by the same count.

The quick estimate needs no target forward: on stored hidden-state shards (features of text the target
generated itself) :func:`teacher_forced_chain` walks the decoder's own chain of anchors (first anchor at
the first generated token; next anchor = anchor + accepted drafts + 1), so it visits exactly the blocks
greedy decoding would when the stored text is the target's greedy output. :func:`teacher_forced_acceptance`
(uniform anchors) runs high: a uniformly drawn anchor often sits in an easy stretch that decoding skips
in one long accepted run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from dflash_assets.dflash.loss import accuracy_per_position, expected_acceptance_length
from dflash_assets.dflash.speculative import SpecResult, dflash_generate, target_generate
from dflash_assets.dflash.tau import tau_from_sums
from dflash_assets.figures import figure_png_bytes, new_figure

__all__ = [
    "acceptance_histogram",
    "acceptance_histogram_png",
    "acceptance_length",
    "acceptance_per_position",
    "evaluate_drafter",
    "evaluate_drafters",
    "tau_statistics",
    "teacher_forced_acceptance",
    "teacher_forced_chain",
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


def acceptance_per_position(accepted_lengths: Iterable[int], block_size: int) -> list[float]:
    """Acceptance rate of each draft position: element ``k - 1`` (``k = 1 .. block_size - 1``) is the share of
    steps that accepted draft ``k`` among the steps that accepted drafts ``1 .. k - 1``, i.e.
    ``#(L >= k + 1) / #(L >= k)`` over accepted lengths ``L`` (NaN where no step reached position ``k``).
    A step cut short by the token limit or an EOS counts as a rejection at its cut."""
    values = [int(v) for v in accepted_lengths]
    out = []
    for k in range(1, block_size):
        reached = sum(1 for v in values if v >= k)
        out.append(sum(1 for v in values if v >= k + 1) / reached if reached else math.nan)
    return out


def tau_statistics(per_prompt_lengths: Sequence[Sequence[int]], block_size: int) -> dict:
    """tau of a dataset as the field reports it, from each prompt's accepted lengths per verification step.

    Prompts without a verification step (generation ended at the prefill) are left out of both averages.

    Returns:
        dict: ``tau`` (mean of per-prompt means, z-lab's figure), ``tau_stderr`` (std of per-prompt taus,
        ddof 1, / sqrt(m)), ``tau_pooled`` (all tokens / all steps), ``tau_pooled_stderr`` (ratio
        estimator, clustered by prompt; see the module docstring), ``per_prompt_tau`` (list, NaN for a
        prompt without steps), ``num_prompts_measured`` (m), ``num_steps``, ``histogram``
        (:func:`acceptance_histogram` of all steps), ``acceptance_per_position``
        (:func:`acceptance_per_position`). Taus are NaN and standard errors 0 when m < 1 resp. m < 2.
    """
    per_prompt = [acceptance_length(v) for v in per_prompt_lengths]
    sums = tau_from_sums([(sum(v), len(v)) for v in per_prompt_lengths if len(v)])
    everything = [v for lengths in per_prompt_lengths for v in lengths]
    return {
        **sums,
        "per_prompt_tau": per_prompt,
        "histogram": acceptance_histogram(everything, block_size),
        "acceptance_per_position": acceptance_per_position(everything, block_size),
    }


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
        ax.bar(
            [x + offset for x in xs],
            [c / total for c in counts],
            width=width,
            label=f"{label} (tau={tau:.2f}, {sum(counts)} steps)",
        )
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
    use_context_cache: bool = True,
) -> dict:
    """Greedy speculative decoding vs plain greedy decoding of the same prompts, on this machine.

    One drafter's case of :func:`evaluate_drafters` (see there for the timing and the returned fields).
    """
    return evaluate_drafters(
        target,
        {"drafter": drafter},
        prompts_ids,
        max_new_tokens,
        eos_token_ids=eos_token_ids,
        target_layer_ids=target_layer_ids,
        block_size=block_size,
        mask_token_id=mask_token_id,
        plain_results=plain_results,
        warmup=warmup,
        progress=None if progress is None else (lambda name, done, total, r: progress(done, total, r)),
        use_context_cache=use_context_cache,
    )["drafter"]


def evaluate_drafters(
    target: nn.Module,
    drafters: Mapping[str, nn.Module],
    prompts_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_ids: Iterable[int] | None = None,
    target_layer_ids: Sequence[int] | None = None,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    plain_results: Sequence[SpecResult] | None = None,
    warmup: bool = True,
    progress: Callable[[str, int, int, SpecResult], None] | None = None,
    use_context_cache: bool = True,
) -> dict[str, dict]:
    """Greedy speculative decoding with each drafter vs plain greedy decoding of the same prompts.

    Timing is warm and interleaved: after one short warm-up generation of each kind, every prompt is
    decoded plainly and with each drafter back to back, the order rotating from prompt to prompt, so load
    changes on a shared machine hit every decoder alike. ``plain_results`` skips plain decoding (outputs,
    forwards and timing are taken from it; ``timing`` then says ``"reused plain results"``).

    Args:
        target: HF causal LM; drafters: ``{name: drafter}`` as for :func:`dflash_generate` (``eval()`` mode).
        prompts_ids: token ids of each prompt (chat template applied).
        max_new_tokens: per prompt; eos_token_ids: stop tokens for all decoders.
        target_layer_ids, block_size, mask_token_id: default to each drafter's config.
        plain_results: earlier :func:`target_generate` results of the same prompts.
        warmup: run one 2-token generation of each kind first so one-off costs stay out of the timing.
        progress: called as ``progress(name, done, total, result)`` after each speculative generation.
        use_context_cache: passed to :func:`dflash_generate`.

    Returns:
        ``{name: dict}``: the :func:`tau_statistics` fields (``tau`` = mean of per-prompt means,
        ``tau_stderr``, ``tau_pooled``, ``tau_pooled_stderr``, ``per_prompt_tau``, ``histogram``,
        ``acceptance_per_position``, ...), ``accepted_lengths`` (per prompt lists), ``block_size``,
        ``num_prompts``, ``new_tokens`` (total generated), ``target_forwards_plain``,
        ``target_forwards_spec``, ``target_forwards_saved`` (plain - spec), ``forward_reduction``
        (plain / spec), ``target_tokens_plain`` / ``target_tokens_spec`` (tokens fed through those
        forwards), ``rollback`` (how a hybrid target's cache was rolled back: ``none`` / ``mixers`` /
        ``forward``, see :class:`~dflash_assets.dflash.speculative.SpecResult`), ``rollback_forwards`` and
        ``rollback_tokens`` (the extra target passes and tokens that cost, summed over prompts),
        ``wall_s_plain``, ``wall_s_spec`` (seconds, summed over prompts), ``speedup``
        (``wall_s_plain / wall_s_spec``), ``timing``, ``lossless`` (every prompt's speculative output
        equals the plain greedy output token for token), ``mismatched_prompts`` (indices where it does not).

    Raises:
        ValueError: no prompts, no drafter, or ``plain_results`` of a different length.
    """
    if not prompts_ids or not drafters:
        raise ValueError("no prompts" if not prompts_ids else "no drafter")
    if plain_results is not None and len(plain_results) != len(prompts_ids):
        raise ValueError("plain_results must have one result per prompt")
    eos = list(eos_token_ids or [])
    names = list(drafters)

    def kw(name: str) -> dict:
        cfg = getattr(drafters[name], "config", None)
        return dict(
            target_layer_ids=target_layer_ids,
            block_size=int(block_size if block_size is not None else cfg.block_size),
            mask_token_id=mask_token_id,
            eos_token_ids=eos_token_ids,
            use_context_cache=use_context_cache,
        )

    if warmup:
        for name in names:
            dflash_generate(target, drafters[name], prompts_ids[0], min(2, max_new_tokens), **kw(name))
        if plain_results is None:
            target_generate(target, prompts_ids[0], min(2, max_new_tokens), eos)
    plain: list[SpecResult] = []
    spec: dict[str, list[SpecResult]] = {n: [] for n in names}
    for i, p in enumerate(prompts_ids):
        order = ([None] if plain_results is None else []) + names  # None = plain decoding
        shift = i % len(order)
        for who in order[shift:] + order[:shift]:
            if who is None:
                plain.append(target_generate(target, p, max_new_tokens, eos))
            else:
                spec[who].append(dflash_generate(target, drafters[who], p, max_new_tokens, **kw(who)))
                if progress is not None:
                    progress(who, i + 1, len(prompts_ids), spec[who][-1])
        if plain_results is not None:
            plain.append(plain_results[i])
    out = {}
    for name in names:
        runs, bs = spec[name], kw(name)["block_size"]
        mismatched = [i for i, (a, b) in enumerate(zip(plain, runs)) if a.output_ids != b.output_ids]
        fw_plain = sum(r.num_target_forwards for r in plain)
        fw_spec = sum(r.num_target_forwards for r in runs)
        wall_plain = sum(r.wall_s for r in plain)
        wall_spec = sum(r.wall_s for r in runs)
        out[name] = {
            **tau_statistics([r.accepted_lengths for r in runs], bs),
            "accepted_lengths": [list(r.accepted_lengths) for r in runs],
            "block_size": bs,
            "num_prompts": len(prompts_ids),
            "new_tokens": sum(r.num_new_tokens for r in runs),
            "target_forwards_plain": fw_plain,
            "target_forwards_spec": fw_spec,
            "target_forwards_saved": fw_plain - fw_spec,
            "forward_reduction": fw_plain / fw_spec if fw_spec else math.nan,
            "target_tokens_plain": sum(r.num_target_tokens for r in plain),
            "target_tokens_spec": sum(r.num_target_tokens for r in runs),
            "rollback": ",".join(sorted({r.rollback for r in runs})) or "none",
            "rollback_forwards": sum(r.rollback_forwards for r in runs),
            "rollback_tokens": sum(r.rollback_tokens for r in runs),
            "wall_s_plain": wall_plain,
            "wall_s_spec": wall_spec,
            "speedup": wall_plain / wall_spec if wall_spec > 0 else math.nan,
            "timing": "reused plain results"
            if plain_results is not None
            else "warm, interleaved per prompt (order rotating)",
            "lossless": not mismatched,
            "mismatched_prompts": mismatched,
        }
    return out


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
            hidden = drafter(
                batch.block_input_ids,
                target_hidden=batch.context_hidden,
                position_ids=batch.position_ids,
                attention_mask=batch.attention_mask,
            )
        hidden = hidden[0, : m * bs]
        preds = torch.cat(
            [
                torch.nn.functional.linear(hidden[i : i + logits_chunk].float(), head.float()).argmax(-1)
                for i in range(0, hidden.shape[0], logits_chunk)
            ]
        )
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


@torch.no_grad()
def teacher_forced_chain(
    drafter: nn.Module,
    dataset,
    *,
    max_rows: int | None = None,
    max_new_tokens: int | None = None,
    anchors_per_forward: int = 256,
    device: torch.device | str | None = None,
) -> dict:
    """Quick tau estimate on stored features along the decoder's own chain of anchors (no target forward).

    For each row the first anchor is the first generated token (the first ``loss_mask == 1`` position,
    which greedy decoding gets from the prefill); the block ``[x_a, MASK..]`` sees the stored features of
    positions ``< a``; its accepted length ``L`` is ``1 + (leading drafts equal to the stored x_{a+k})``,
    counting only positions inside the row (and the first ``max_new_tokens`` generated tokens, if given);
    the next anchor is ``a + L`` (previous anchor + accepted drafts + 1, the bonus token). Exactly the
    blocks greedy speculative decoding visits when the stored text is the target's greedy output (up to the
    features' bf16 rounding); with sampled completions it is an estimate.

    Blocks at every generated position are predicted in packed forwards of ``anchors_per_forward`` anchors
    (the same layout as training, :func:`collate_training_batch`), then the chain is walked; the cost is
    about ``block_size`` times a pass over the row.

    Args:
        drafter: :class:`DFlashDraftModel` with the target head attached.
        dataset: :class:`HiddenStateShards` or a list of shard paths (read with ``split="all"``).
        max_rows: first rows only; max_new_tokens: stop each chain after this many generated tokens
            (to match a decoding limit); device: default the drafter's.

    Returns:
        dict: the :func:`tau_statistics` fields over rows (``tau`` per-row mean, ``tau_pooled``, standard
        errors, ``histogram``, ``acceptance_per_position``), ``accepted_lengths`` (per row lists),
        ``num_rows``, ``num_blocks``.
    """
    from dflash_assets.dflash.data import HiddenStateShards, collate_training_batch

    bs = int(drafter.config.block_size)
    mask_id = int(drafter.config.mask_token_id)
    if isinstance(dataset, (list, tuple)):  # shard paths (a dataset object, e.g. online TokenizedRows, is used as is)
        dataset = HiddenStateShards(list(dataset), split="all", block_size=bs)
    was_training = drafter.training
    drafter.eval()
    device = torch.device(device) if device is not None else drafter.fc.weight.device
    head = drafter.target_lm_head_weight
    n_rows = len(dataset) if max_rows is None else min(len(dataset), max_rows)
    per_row: list[list[int]] = []
    for r in range(n_rows):
        sample = dataset[r]
        ids, lm = sample["input_ids"], sample["loss_mask"].bool()
        t = ids.shape[0]
        generated = torch.nonzero(lm, as_tuple=False).flatten()
        if generated.numel() < 2:
            per_row.append([])
            continue
        first = int(generated[0])
        end = t if max_new_tokens is None else min(t, first + max_new_tokens)
        # hits[a, k]: draft k of the block anchored at a equals the stored token (k = 1..bs-1)
        positions = torch.arange(first, end - 1)
        hits = torch.zeros(end, bs, dtype=torch.bool)
        for lo in range(0, positions.numel(), anchors_per_forward):
            anchors = positions[lo : lo + anchors_per_forward]
            pad = max(0, int(anchors.max()) + bs - t)  # blocks near the end run past the row: pad with masked labels
            s = (
                sample
                if not pad
                else {
                    "input_ids": torch.cat([ids, torch.full((pad,), mask_id, dtype=ids.dtype)]),
                    "loss_mask": torch.cat([sample["loss_mask"], torch.zeros(pad, dtype=sample["loss_mask"].dtype)]),
                    "hidden_states": torch.cat([sample["hidden_states"], sample["hidden_states"][-1:].expand(pad, -1)]),
                }
            )
            batch = collate_training_batch([s], [anchors], bs, mask_id).to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                hidden = drafter(
                    batch.block_input_ids,
                    target_hidden=batch.context_hidden,
                    position_ids=batch.position_ids,
                    attention_mask=batch.attention_mask,
                )
            m = anchors.numel()
            pred = torch.nn.functional.linear(hidden[0, : m * bs].float(), head.float()).argmax(-1).view(m, bs).cpu()
            label_pos = anchors[:, None] + torch.arange(bs)[None, :]
            inside = label_pos < end
            labels = torch.where(inside, s["input_ids"][label_pos.clamp(max=s["input_ids"].shape[0] - 1)], -1)
            hits[anchors] = (pred == labels) & inside
        lengths, a = [], first
        while a < end - 1:
            run = int(hits[a, 1:].to(torch.int64).cumprod(0).sum())
            n = min(1 + run, end - 1 - a)  # the bonus token must lie inside the row
            lengths.append(n)
            a += n
        per_row.append(lengths)
    drafter.train(was_training)
    return {
        **tau_statistics(per_row, bs),
        "accepted_lengths": per_row,
        "num_rows": n_rows,
        "num_blocks": sum(len(v) for v in per_row),
    }
