"""Acceptance statistics of speculative decoding: tau (mean accepted length per verification step), the
histogram of accepted lengths, acceptance per draft position, and tau per prompt and pooled with standard
errors (definitions: :mod:`dflash_assets.dflash.decoding.evaluation`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from dflash_assets.dflash.decoding.tau import tau_from_sums


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
