"""vLLM's n-gram (prompt lookup) speculation replayed on a known greedy output (stdlib only).

The rule, as vLLM 0.32's ``NgramProposer`` applies it (``vllm/v1/spec_decode/ngram_proposer.py``; matched against
a captured request in ``dflash_assets_tests/test_ngram_baseline.py``): at each step the longest suffix of
``prompt_lookup_min .. prompt_lookup_max`` context tokens that also occurs earlier in the context, at its earliest
occurrence, proposes the up to ``num_speculative_tokens`` tokens that followed that occurrence; with no such
suffix nothing is drafted. The target accepts the leading drafts equal to its greedy continuation and adds one
token of its own. Greedy decoding is lossless, so the output is the same whatever was drafted, and the steps
follow from it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ngram_steps"]


def ngram_steps(
    prompt_ids: Sequence[int], output_ids: Sequence[int], lookup_min: int, lookup_max: int, num_speculative_tokens: int
) -> list[tuple[int, int]]:
    """Each decode step of n-gram speculative decoding that produced ``output_ids`` after ``prompt_ids``:
    ``(drafted tokens, accepted drafts)``, ``(0, 0)`` for a step that found no match. The prefill, which makes the
    first output token, is not a step; target forwards = ``1 + len(steps)``. Accepted drafts count only tokens
    inside ``output_ids`` (vLLM also counts a last step's drafts past the stop, then trims them).

    Cost: O((prompt + output) x lookup_max) dictionary operations (earliest start of every n-gram, kept as the
    context grows), not a scan of the context per step.

    Raises:
        ValueError: ``lookup_min < 1``, ``lookup_max < lookup_min`` or ``num_speculative_tokens < 1``.
    """
    if lookup_min < 1 or lookup_max < lookup_min or num_speculative_tokens < 1:
        raise ValueError(
            f"n-gram lookup needs 1 <= prompt_lookup_min ({lookup_min}) <= prompt_lookup_max ({lookup_max}) and "
            f"num_speculative_tokens >= 1 ({num_speculative_tokens})"
        )
    ctx = [int(t) for t in prompt_ids]
    out = [int(t) for t in output_ids]
    earliest: dict[tuple[int, ...], int] = {}  # n-gram -> its earliest start, over n-grams ending before the suffix
    registered_end = 0  # n-grams ending at positions < registered_end are in ``earliest``

    def register_up_to(end: int) -> None:
        nonlocal registered_end
        for last in range(registered_end, end):
            for v in range(1, lookup_max + 1):
                start = last - v + 1
                if start >= 0:
                    earliest.setdefault(tuple(ctx[start : last + 1]), start)
        registered_end = max(registered_end, end)

    steps: list[tuple[int, int]] = []
    got = 1 if out else 0
    ctx.extend(out[:got])
    while got < len(out):
        n = len(ctx)
        # an occurrence of the suffix of length v must start before n - v; all such lie inside ctx[: n - 1]
        register_up_to(n - 1)
        draft: list[int] = []
        for v in range(min(lookup_max, n - 1), lookup_min - 1, -1):
            start = earliest.get(tuple(ctx[n - v :]))
            if start is not None and start < n - v:
                draft = ctx[start + v : start + v + num_speculative_tokens]
                break
        accepted = 0
        while accepted < len(draft) and got + accepted < len(out) and draft[accepted] == out[got + accepted]:
            accepted += 1
        steps.append((len(draft), accepted))
        take = min(accepted + 1, len(out) - got)
        ctx.extend(out[got : got + take])
        got += take
    return steps
