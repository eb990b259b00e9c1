"""A drafter run's :class:`~dflash_assets.dflash.training.train.TrainConfig` from the asset's settings, checked
against the target's config.json before any work."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_assets.dflash.model.draft_config import DRAFT_SHAPE_FIELDS, DFlashConfig
from dflash_assets.dflash.target.layers import resolve_target_layer_ids, text_config
from dflash_assets.dflash.training.config import TrainConfig, TrainSettings
from dflash_assets.stages.drafter.config import DrafterConfig
from dflash_assets.stages.drafter.features import hidden_states_config

if TYPE_CHECKING:
    from dflash_assets.stages.resources.target_model import TargetModelResource


def draft_overrides(config: DrafterConfig) -> dict:
    """The drafter-shape settings given (:data:`~dflash_assets.dflash.model.draft_config.DRAFT_SHAPE_FIELDS`; None = the
    target's)."""
    values = {k: getattr(config, k) for k in DRAFT_SHAPE_FIELDS if getattr(config, k) is not None}
    if "layer_types" in values:
        values["layer_types"] = list(values["layer_types"])
    return values


def resolved_settings(config: DrafterConfig, target_model: TargetModelResource) -> tuple[list[int], dict]:
    """``(target_layer_ids, draft overrides)`` of a run, checked against the target's config.json (no model loaded).

    ``target_layer_ids`` are ``ops.hidden_states.config.target_layer_ids`` resolved once
    (:func:`~dflash_assets.dflash.target.layers.resolve_target_layer_ids`) for offline and online training
    alike, so the layers the drafter learns from never depend on whether the storage plan fits. The drafter
    config is built here so that a bad shape or mask token fails before any work.

    Raises:
        ValueError: a bad setting, naming its key (``ops.dflash_drafter.config: ...`` or
            ``ops.hidden_states.config.target_layer_ids: ...``) and the fix.
    """
    model_path = target_model.resolved_path()
    try:
        layer_ids = resolve_target_layer_ids(model_path, hidden_states_config().target_layer_ids or None, 5)
    except ValueError as exc:
        raise ValueError(f"ops.hidden_states.config.target_layer_ids: {exc}") from exc
    overrides = draft_overrides(config)
    target_config = text_config(model_path)
    # the default mask token is chosen from the tokenizer at training time and checked there
    mask = config.mask_token_id if config.mask_token_id is not None else int(target_config["vocab_size"]) - 1
    try:
        DFlashConfig.from_target_config(
            target_config,
            mask_token_id=mask,
            num_hidden_layers=config.num_hidden_layers,
            target_layer_ids=layer_ids,
            block_size=config.block_size,
            **overrides,
        )
    except (ValueError, TypeError) as exc:
        raise ValueError(f"ops.dflash_drafter.config: {exc}") from exc
    return layer_ids, overrides


def train_config_for(
    config: DrafterConfig,
    target_model: TargetModelResource,
    *,
    mode: str,
    shards: list[str],
    tokenized: list[str],
    out_dir: str,
    init_from: str | None = None,
) -> TrainConfig:
    """The :class:`TrainConfig` of a run, the same for offline and online features but for the data
    (``shards`` / ``tokenized``); layers and shape from :func:`resolved_settings`.

    Raises:
        ValueError: see :func:`resolved_settings`.
    """
    layer_ids, overrides = resolved_settings(config, target_model)
    model_path = target_model.resolved_path()
    return TrainConfig(
        **config.model_dump(include=set(TrainSettings.model_fields)),  # the settings both declare, once
        shards=shards,
        out_dir=out_dir,
        features=mode,
        tokenized=tokenized,
        target_dtype=target_model.dtype,
        target_model_path=str(model_path),
        num_context_features=len(layer_ids),
        target_layer_ids=layer_ids,
        draft_overrides=overrides,
        device=target_model.device,
        init_from=init_from,
    )
