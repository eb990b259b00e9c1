"""Where the drafter's target features come from: stored shards (offline) or the frozen target (online).

Shared by the main job (which skips ``hidden_states`` when online), ``dflash_drafter`` and
``drafter_evaluation``. ``features: auto`` (the default) is decided with the storage plan, in one place
(:func:`dflash_assets.stages.storage_plan.feature_source`): online when storing every selected row's features
does not fit.
"""

from __future__ import annotations

import dagster as dg

from dflash_assets.common.config import op_config
from dflash_assets.stages.hidden_states import HiddenStatesConfig
from dflash_assets.stages.storage_plan import feature_source
from dflash_assets.stages.stored_inputs import complete_shards, tokenized_inputs


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
    """``(offline|online, reason)`` for a ``features`` setting, with the project's hidden-state settings
    (:func:`~dflash_assets.stages.storage_plan.feature_source` decides)."""
    return feature_source(instance, storage, target_model, mode, hidden_states_config(), fallback_tokens_per_row)


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

    shards, _, _ = complete_shards(storage, keys)
    return HiddenStateShards(
        shards, split="eval", eval_fraction=eval_fraction, max_length=max_length, block_size=block_size
    )
