"""Dataset acceptance length from per-prompt sums: the two averages the field reports (stdlib only).

Shared by the in-process evaluation (:func:`dflash_assets.dflash.decoding.evaluation.tau_statistics`, per-step
accepted lengths) and the engine evaluation (SGLang's per-request ``completion_tokens`` and
``spec_verify_ct``), so both figures follow one formula:

* **per-prompt mean** (z-lab's benchmark, the headline): mean over prompts of ``S_i / n_i``; standard
  error ``std(S_i / n_i, ddof=1) / sqrt(m)``;
* **pooled**: ``sum S_i / sum n_i``; standard error of the ratio estimator clustered by prompt (Cochran,
  *Sampling Techniques*, 6.3): ``sqrt(sum_i (S_i - tau * n_i)^2 / (m (m - 1))) / mean(n_i)``,

with ``S_i`` the tokens from verification steps and ``n_i`` the steps of prompt ``i`` of ``m``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def tau_from_sums(measured: Sequence[tuple[float, int]]) -> dict:
    """``tau``, ``tau_stderr``, ``tau_pooled``, ``tau_pooled_stderr``, ``num_prompts_measured`` (m) and
    ``num_steps`` of ``measured``: ``(S_i, n_i)`` per prompt, tokens and verification steps, ``n_i >= 1``
    (leave out prompts without a step). Taus are NaN for m = 0; standard errors 0 for m < 2."""
    m = len(measured)
    means = [s / n for s, n in measured]
    tau = sum(means) / m if m else math.nan
    se = math.sqrt(sum((x - tau) ** 2 for x in means) / (m - 1) / m) if m > 1 else 0.0
    total_s, total_n = sum(s for s, _ in measured), sum(n for _, n in measured)
    pooled = total_s / total_n if total_n else math.nan
    pooled_se = (
        (math.sqrt(sum((s - pooled * n) ** 2 for s, n in measured) / (m * (m - 1))) / (total_n / m)) if m > 1 else 0.0
    )
    return {
        "tau": tau,
        "tau_stderr": se,
        "tau_pooled": pooled,
        "tau_pooled_stderr": pooled_se,
        "num_prompts_measured": m,
        "num_steps": total_n,
    }


__all__ = ["tau_from_sums"]
