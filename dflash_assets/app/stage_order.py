"""The pipeline's stages and their order, taken from the asset graph (each asset's dependencies).

The main job, ``status``, the schedule and the sensor read their stage lists from here, so adding or
rewiring an asset changes them all at once.
"""

from __future__ import annotations

import dagster as dg

from dflash_assets.assets import completions, drafter, evaluation, hidden_states, prompts, tokenized, truncation

ASSETS: list[dg.AssetsDefinition] = [
    prompts.prompt_corpus,
    completions.completions,
    truncation.truncation_report,
    tokenized.tokenized_sequences,
    hidden_states.hidden_states,
    drafter.dflash_drafter,
    evaluation.drafter_evaluation,
]


def stage_order(assets: list[dg.AssetsDefinition]) -> list[str]:
    """Asset names upstream first (Kahn's algorithm; ties keep the order of ``assets``).

    Raises:
        ValueError: the dependencies form a cycle.
    """
    names = [a.key.to_user_string() for a in assets]
    deps = {a.key.to_user_string(): {d.to_user_string() for d in a.asset_deps[a.key]} & set(names) for a in assets}
    order: list[str] = []
    while len(order) < len(names):
        ready = [n for n in names if n not in order and deps[n] <= set(order)]
        if not ready:
            raise ValueError(f"asset dependencies form a cycle among {sorted(set(names) - set(order))}")
        order.append(ready[0])
    return order


STAGE_ORDER = stage_order(ASSETS)
_PARTITIONED = {a.key.to_user_string() for a in ASSETS if a.partitions_def is not None}
# per prompt-range partition, upstream first: completions, tokenized_sequences, hidden_states
PARTITION_STAGES = [s for s in STAGE_ORDER if s in _PARTITIONED]
# unpartitioned stages after the corpus: truncation_report, dflash_drafter, drafter_evaluation
FINAL_STAGES = [s for s in STAGE_ORDER if s not in _PARTITIONED and s != STAGE_ORDER[0]]
