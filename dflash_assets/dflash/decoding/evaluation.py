"""Measuring a DFlash drafter: acceptance length tau, lossless check, speedup, teacher-forced proxy.

Definitions (DFlash paper arXiv 2602.06036, "average acceptance length tau"; z-lab/dflash
``benchmark.py``): a target verification step yields the accepted drafts plus the target's bonus token,
so its accepted length is in ``[1, block_size]``. Two averages are reported (:func:`tau_statistics`):

* **per-prompt mean** (the headline, as z-lab's benchmark reports a dataset): the mean over prompts of
  each prompt's mean accepted length;
* **pooled**: total tokens from verification steps / number of verification steps over all prompts
  (long prompts weigh more);

both with standard errors across prompts, by :func:`dflash_assets.dflash.decoding.tau.tau_from_sums` (the formula
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

from torch import nn

from dflash_assets.common.figures import figure_png_bytes, new_figure

# the statistics and the teacher-forced estimates lived here; imported from here by their callers
from dflash_assets.dflash.decoding.acceptance import (
    acceptance_histogram,
    acceptance_length,
    tau_statistics,
)
from dflash_assets.dflash.decoding.speculative import SpecResult, dflash_generate, target_generate

__all__ = ["acceptance_histogram_png", "evaluate_drafter", "evaluate_drafters", "untrained_drafter_like"]


def acceptance_histogram_png(
    series: Sequence[int] | Mapping[str, Sequence[int]],
    block_size: int,
    title: str = "DFlash acceptance length per verification step",
    per_position: Mapping[str, Sequence[float]] | None = None,
) -> bytes:
    """PNG (bytes) of the distribution of accepted lengths, as fractions of steps per length.

    Args:
        series: accepted lengths of one drafter, or ``{label: accepted_lengths}`` for several (e.g.
            trained vs untrained), drawn as grouped bars with tau in the legend.
        block_size: x axis runs 1 .. block_size.
        per_position: ``{label: rates}``, drawn in a second panel below: per draft position k (1 ..), the share
            of decode steps whose k-th drafted token was accepted (a step that drafted nothing counts as not
            accepted), e.g. the drafter and n-gram lookup on the engine. None or empty: one panel.

    Rendered off-screen by :func:`dflash_assets.common.figures.figure_png_bytes` (Agg, no display needed,
    no ``Software`` text chunk, so equal inputs give equal bytes).
    """
    if not isinstance(series, Mapping):
        series = {"drafter": series}
    per_position = {k: list(v) for k, v in (per_position or {}).items() if len(v)}
    fig, ax = new_figure(figsize=(7, 6.4 if per_position else 3.6), dpi=100)
    if per_position:
        ax.set_subplotspec(fig.add_gridspec(2, 1)[0, 0])
        _per_position_panel(fig.add_subplot(2, 1, 2), per_position)
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


def _per_position_panel(ax, per_position: Mapping[str, Sequence[float]]) -> None:
    width = max(len(v) for v in per_position.values())
    n = len(per_position)
    bar = 0.8 / n
    for i, (label, rates) in enumerate(per_position.items()):
        offset = (i - (n - 1) / 2) * bar
        ax.bar([k + 1 + offset for k in range(len(rates))], list(rates), width=bar, label=label)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted, share of decode steps")
    ax.set_xticks(list(range(1, width + 1)))
    ax.set_ylim(0, 1)
    ax.set_title("acceptance per draft position (a step without a draft: not accepted)", fontsize=10)
    ax.legend(fontsize=8)


def untrained_drafter_like(drafter: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """A freshly initialised drafter of the same config, device, dtype and attached target head.

    With the training run's ``seed`` and ``init_std`` this is exactly the trained drafter's starting
    point (``dflash.training.train`` calls ``reset_parameters(init_std, seed=seed)``). Returned in ``eval()`` mode.
    """
    from dflash_assets.dflash.model.draft_model import DFlashDraftModel

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
        ``forward``, see :class:`~dflash_assets.dflash.decoding.speculative.SpecResult`), ``rollback_forwards`` and
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
    timing = "reused plain results" if plain_results is not None else "warm, interleaved per prompt (order rotating)"
    return {name: _drafter_figures(spec[name], plain, kw(name)["block_size"], timing) for name in names}


def _drafter_figures(runs: list[SpecResult], plain: list[SpecResult], bs: int, timing: str) -> dict:
    """:func:`evaluate_drafters`' figures of one drafter from its runs beside the plain ones, prompt by prompt."""
    mismatched = [i for i, (a, b) in enumerate(zip(plain, runs)) if a.output_ids != b.output_ids]
    fw_plain = sum(r.num_target_forwards for r in plain)
    fw_spec = sum(r.num_target_forwards for r in runs)
    wall_plain = sum(r.wall_s for r in plain)
    wall_spec = sum(r.wall_s for r in runs)
    return {
        **tau_statistics([r.accepted_lengths for r in runs], bs),
        "accepted_lengths": [list(r.accepted_lengths) for r in runs],
        "block_size": bs,
        "num_prompts": len(runs),
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
        "timing": timing,
        "lossless": not mismatched,
        "mismatched_prompts": mismatched,
        "first_mismatch": first_divergence([r.output_ids for r in plain], [r.output_ids for r in runs]),
        "plain_output_ids": [list(r.output_ids) for r in plain],
    }


def first_divergence(expected: Sequence[Sequence[int]], actual: Sequence[Sequence[int]]) -> dict | None:
    """Where two decodings of the same prompts first part: ``{"prompt": i, "token": k, "expected": id or None,
    "actual": id or None}`` (``k``: position among the generated tokens; None past the end of a shorter output),
    or None when every output is equal. ``expected`` and ``actual`` hold one token-id list per prompt."""
    for i, (want, got) in enumerate(zip(expected, actual)):
        want, got = list(want), list(got)
        if want == got:
            continue
        k = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        return {
            "prompt": i,
            "token": k,
            "expected": want[k] if k < len(want) else None,
            "actual": got[k] if k < len(got) else None,
        }
    return None
