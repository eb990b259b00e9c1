"""The in-process side of an engine evaluation: every prompt the engine decoded with the drafter is replayed here
(:func:`~dflash_assets.dflash.decoding.engine_replay.replay_prompt_drafters`): one target forward over the engine's
prompt and output (over what follows the prompt before's shared prefix), the drafter at every anchor. It gives the
in-process figures (this drafter's own chain over the same output) and the step-by-step parity that
:mod:`~dflash_assets.stages.evaluation.parity` judges, without decoding again."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dflash_assets.dflash.decoding.acceptance import tau_statistics
from dflash_assets.dflash.decoding.engine_replay import PrefixCache, PromptReplay, replay_prompt_drafters

#: differences kept per dataset in the report (every count is kept; the lines name the first ones)
MAX_LISTED = 20


def replay_engine_datasets(
    target: torch.nn.Module,
    drafters: Mapping[str, torch.nn.Module],
    prompts: Mapping[str, Sequence[Sequence[int]]],
    records: Sequence[Mapping[str, Any]],
    tolerance: float,
    progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Replay the engine's drafter records (``records``: one per prompt with ``dataset``, ``position``,
    ``output_ids``, ``steps`` or ``error``) of every prompt set in ``prompts`` (dataset -> prompt ids by position)
    for each of ``drafters`` (name -> drafter, all reading the same target layers), one target forward per prompt
    shared by them. Prompts run in the order of their token ids, so one sharing a prefix with the one before (a
    conversation's next turn) runs the target over what follows it only (:class:`PrefixCache`).

    Returns:
        ``{dataset: {drafter name: entry}}``, each entry the report's in-process run of that drafter:
        :func:`tau_statistics` of its own chain per replayed prompt, ``accepted_lengths`` and ``per_prompt_tau``
        (None where the engine lost the prompt), ``plain_output_ids`` (the engine's output, checked against the
        target here), ``block_size``, ``num_prompts``, ``new_tokens``, ``lossless`` (every replayed output the
        target's greedy output here), ``first_mismatch``, ``source``, and ``step_parity``: ``prompts_replayed``,
        ``steps_compared``, ``differences`` (count), ``ties``, ``mismatches`` (count), ``mismatch_margins``
        (each mismatch's margin, logits, ascending), ``listed`` (the first
        :data:`MAX_LISTED` differences with dataset position, step, anchor, draft position, both accepted counts,
        both tokens, margin, tie), ``target_ties``, ``tolerance``, ``wall_s`` (seconds of this dataset's prompts).
    """
    by_key = {(r["dataset"], r["position"]): r for r in records}
    jobs = []  # (sequence ids, dataset, position, record or None)
    for name, rows in prompts.items():
        for position, prompt_ids in enumerate(rows):
            record = by_key.get((name, position))
            ok = record is not None and "error" not in record and record.get("output_ids")
            jobs.append(([*prompt_ids, *record["output_ids"]] if ok else [], name, position, record if ok else None))
    jobs.sort(key=lambda job: job[0])  # a turn right after the turn whose prompt and reply it extends
    prefix = PrefixCache(target)
    replays: dict[str, list[dict[str, PromptReplay] | None]] = {
        name: [None] * len(rows) for name, rows in prompts.items()
    }
    wall = dict.fromkeys(prompts, 0.0)
    for done, (_, name, position, record) in enumerate(jobs, 1):
        started = time.monotonic()
        if record is not None:
            replays[name][position] = replay_prompt_drafters(
                target, drafters, prompts[name][position], record["output_ids"], record.get("steps"),
                tolerance=tolerance, prefix=prefix,
            )  # fmt: skip
        wall[name] += time.monotonic() - started
        if progress is not None:
            progress(done, len(jobs))
    if log is not None and prefix.enabled and prefix.total_tokens:
        share = prefix.reused_tokens / prefix.total_tokens
        log(
            f"replay: {prefix.reused_tokens:,} of {prefix.total_tokens:,} tokens ({share:.0%}) taken from the prompt "
            "before's KV cache (shared prefixes)"
        )
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, rows in replays.items():
        outputs = [list(by_key[(name, i)]["output_ids"]) if r is not None else None for i, r in enumerate(rows)]
        out[name] = {
            who: _entry(
                [None if r is None else r[who] for r in rows],
                outputs,
                int(drafter.config.block_size),
                tolerance,
                wall[name],
            )
            for who, drafter in drafters.items()
        }
    return out


def _entry(replays, outputs, block: int, tolerance: float, wall_s: float) -> dict[str, Any]:
    """One dataset's in-process run from its prompts' replays (None: lost by the engine)."""
    kept = [(i, r) for i, r in enumerate(replays) if r is not None]
    stats = tau_statistics([r.own_accepted_lengths for _, r in kept], block)
    first = next(((i, r.target_mismatches[0]) for i, r in kept if r.target_mismatches), None)
    differences = [(i, d) for i, r in kept for d in r.differences]
    listed = [
        {
            "prompt": i,
            "step": d.step,
            "anchor": d.anchor,
            "draft_position": d.position,
            "engine_accepted": d.engine_accepted,
            "here_accepted": d.here_accepted,
            "output_token": d.engine_token,
            "here_token": d.here_token,
            "margin": d.margin,
            "tie": d.tie,
        }
        for i, d in sorted(differences, key=lambda x: (x[1].tie, x[0], x[1].step))[:MAX_LISTED]
    ]
    return {
        **stats,
        "accepted_lengths": [None if r is None else list(r.own_accepted_lengths) for r in replays],
        "per_prompt_tau": [
            None
            if r is None or not r.own_accepted_lengths
            else sum(r.own_accepted_lengths) / len(r.own_accepted_lengths)
            for r in replays
        ],
        "plain_output_ids": outputs,
        "block_size": block,
        "num_prompts": len(kept),
        "new_tokens": sum(len(o) for o in outputs if o is not None),
        "lossless": first is None,
        "first_mismatch": None
        if first is None
        else {"prompt": first[0], "token": first[1][0], "expected": first[1][2], "actual": first[1][1]},
        "source": "the engine's outputs replayed here: one target forward per prompt, this drafter at every anchor",
        "step_parity": {
            "prompts_replayed": len(kept),
            "steps_compared": sum(len(r.engine_accepted) for _, r in kept),
            "differences": len(differences),
            "ties": sum(1 for _, d in differences if d.tie),
            "mismatches": sum(1 for _, d in differences if not d.tie),
            # every mismatch's margin: the parity check tells the engine's kernels from a bug by them
            "mismatch_margins": sorted(round(d.margin, 4) for _, d in differences if not d.tie),
            "listed": listed,
            "target_ties": sum(r.target_ties for _, r in kept),
            "target_mismatches": sum(len(r.target_mismatches) for _, r in kept),
            "tolerance": tolerance,
            "wall_s": round(wall_s, 2),
        },
    }


__all__ = ["MAX_LISTED", "replay_engine_datasets"]
