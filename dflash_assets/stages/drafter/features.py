"""Where the drafter's target features come from: stored shards (offline) or the frozen target (online).

Shared by the main job (which skips ``hidden_states`` when online), ``dflash_drafter`` and
``drafter_evaluation``. ``features: auto`` (the default) is decided by the storage plan
(:mod:`dflash_assets.stages.storage_plan`): online when storing every selected row's features does not fit.
"""

from __future__ import annotations

import os

import dagster as dg

from dflash_assets.common.config import op_config
from dflash_assets.stages.hidden_states import HiddenStatesConfig, storage_plan
from dflash_assets.stages.storage_plan import resolve_features
from dflash_assets.stages.tokenized import tokenized_file


def hidden_states_config() -> HiddenStatesConfig:
    """The project's ``ops.hidden_states.config`` as a ``HiddenStatesConfig``."""
    return HiddenStatesConfig(**((op_config("hidden_states")["ops"].get("hidden_states") or {}).get("config") or {}))


def configured_mode() -> str:
    """``ops.dflash_drafter.config.features`` of the project config (default ``auto``)."""
    return ((op_config("dflash_drafter")["ops"].get("dflash_drafter") or {}).get("config") or {}).get(
        "features", "auto"
    )


def decide_mode(
    instance: dg.DagsterInstance, storage, target_model, mode: str, fallback_tokens_per_row: float = 0.0
) -> tuple[str, str]:
    """``(offline|online, reason)`` for a ``features`` setting; ``auto`` computes the storage plan."""
    if mode in ("offline", "online"):
        return mode, f"features: {mode} (configured)"
    try:
        plan = storage_plan(
            instance, storage, target_model, hidden_states_config(), fallback_tokens_per_row=fallback_tokens_per_row
        )
    except (
        OSError,
        KeyError,
        ValueError,
    ) as exc:  # no corpus yet, no target config: hidden_states plans (and fails) itself
        return "offline", f"features: auto -> offline (no storage plan yet: {type(exc).__name__}: {exc})"
    chosen = resolve_features(mode, plan)
    why = "fits" if plan.fits else "does not fit"
    return chosen, f"features: auto -> {chosen} (storage plan {why}: {plan.describe()})"


def tokenized_inputs(storage, keys: list[str]) -> tuple[list[str], list[str]]:
    """``(local parquet paths, partitions used)`` of tokenized_sequences, in partition order (S3: downloaded
    to scratch when missing or of another size)."""
    store = storage.open()
    paths, used = [], []
    for pk in keys:
        parts = tokenized_file(pk)
        if not store.exists(*parts):
            continue
        path = (
            storage.ensure_local(*parts, size=store.size(*parts))
            if storage.is_remote
            else storage.local_scratch(*parts)
        )
        if os.path.exists(path):
            paths.append(path)
            used.append(pk)
    return paths, used


def heldout_set(
    storage,
    keys: list[str],
    mode: str,
    *,
    eval_fraction: float,
    max_length: int,
    block_size: int,
    target=None,
    target_layer_ids: list[int] | None = None,
):
    """The drafter's held-out rows as a dataset with features: shards (offline) or tokenized rows whose
    features the frozen ``target`` computes per row (online; needs ``target`` and ``target_layer_ids``;
    without ``target``, rows without features, which :meth:`TokenizedRows.attach` can give them later)."""
    if mode == "online":
        from dflash_assets.dflash.training.online import OnlineTargetFeatures, TokenizedRows, read_tokenized_rows

        paths, _ = tokenized_inputs(storage, keys)
        features = None if target is None else OnlineTargetFeatures(target, target_layer_ids)
        return TokenizedRows(
            read_tokenized_rows(paths),
            split="eval",
            eval_fraction=eval_fraction,
            max_length=max_length,
            block_size=block_size,
            features=features,
        )
    from dflash_assets.dflash.shards.dataset import HiddenStateShards
    from dflash_assets.stages.shard_access import complete_shards

    shards, _, _ = complete_shards(storage, keys)
    return HiddenStateShards(
        shards, split="eval", eval_fraction=eval_fraction, max_length=max_length, block_size=block_size
    )
