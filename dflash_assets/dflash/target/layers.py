"""Which target decoder layers feed the drafter: the one place ``target_layer_ids`` is resolved.

Used by the storage plan, hidden-state extraction, online and offline training, the drafter config
(and so the export) alike, so that every stage reads the same layers: the configured ids when given,
else the DFlash default rule over the target's decoder layer count. A multimodal wrapper (e.g.
Qwen3.5/3.6 ``*ForConditionalGeneration``, decoder at ``model.language_model``) counts the layers of its
``text_config``.

Plain Python; no torch, no Dagster.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["default_target_layer_ids", "num_target_layers", "resolve_target_layer_ids", "text_config"]


def default_target_layer_ids(num_target_layers: int, n: int = 5) -> list[int]:
    """Target layer ids whose outputs feed the drafter: ``round(1 + i*(L-4)/(n-1))`` for i in 0..n-1.

    Same rule as z-lab/dflash ``build_target_layer_ids`` and SGLang's copy of it (Python ``round``,
    i.e. round-half-to-even; ``n == 1`` gives the middle layer ``L // 2``). Id ``i`` means the output of
    decoder layer ``i``, i.e. HF ``hidden_states[i + 1]``. L=64 -> [1, 16, 31, 46, 61];
    L=30 -> [1, 8, 14, 20, 27].

    Raises:
        ValueError: ``n < 1``, or ``L < 4`` when ``n > 1``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(f"need num_target_layers >= 4, got {num_target_layers}")
    span = num_target_layers - 4  # from layer 1 to layer L-3
    return [round(1 + i * span / (n - 1)) for i in range(n)]


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _as_config(target: Any) -> Any:
    """A config (dict or HF config object) from a model, a config, or a model directory."""
    if isinstance(target, (str, os.PathLike)):
        return json.loads((Path(target) / "config.json").read_text())
    config = getattr(target, "config", None)
    if config is not None and not isinstance(target, Mapping) and hasattr(target, "parameters"):
        return config  # an nn.Module
    return target


def text_config(target: Any) -> Any:
    """The decoder's config of ``target`` (a model, an HF config, a config dict or a model directory):
    its ``text_config`` when it has one (multimodal wrappers), else the config itself."""
    config = _as_config(target)
    return _get(config, "text_config", None) or config


def num_target_layers(target: Any) -> int:
    """Decoder layers of ``target`` (``text_config.num_hidden_layers`` for a multimodal wrapper).

    Raises:
        KeyError: the config has no ``num_hidden_layers``.
    """
    value = _get(text_config(target), "num_hidden_layers", None)
    if value is None:
        raise KeyError("the target's config has no num_hidden_layers (nor text_config.num_hidden_layers)")
    return int(value)


def resolve_target_layer_ids(target: Any, configured: Sequence[int] | None = None, n: int = 5) -> list[int]:
    """The target layer ids every stage uses.

    Args:
        target: the target model, its HF config / config dict, or its directory (``config.json``).
        configured: ``target_layer_ids`` from the run config; None or empty = the default rule.
        n: number of layers for the default rule (the drafter's context features).

    Returns:
        ``list(configured)`` when given, else ``default_target_layer_ids(L, n)`` over the decoder's L layers.

    Raises:
        ValueError: an id outside ``0 .. L-1`` (the message names ``target_layer_ids`` and the range).
    """
    layers = num_target_layers(target)
    ids = [int(i) for i in configured] if configured else default_target_layer_ids(layers, n)
    bad = [i for i in ids if not 0 <= i < layers]
    if bad:
        raise ValueError(
            f"target_layer_ids {bad} are outside 0..{layers - 1} for this target ({layers} decoder layers)"
        )
    return ids
