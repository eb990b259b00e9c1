"""Hidden-state storage plan: the bytes every selected row's features take, against free space or a budget,
and the drafter's feature source it decides (:func:`feature_source`): the one place both are decided.

Computed before ``hidden_states`` writes anything (:func:`storage_plan`) and by the main job,
``dflash_drafter`` and ``drafter_evaluation`` to choose offline or online features. Tokens come from
``tokenized_sequences`` metadata (``total_tokens``, ``rows`` per partition); a partition not tokenized yet is
estimated at the mean tokens per row of the tokenized ones (or, before any, at the generation cap). Bytes per
token: ``n_layers * hidden * 2 + 5`` (:func:`~dflash_assets.dflash.target.features.bytes_per_token`); hidden size
and layer count are read from the target's ``config.json`` (the model is not loaded).

Subset: ``fraction`` keeps the rows whose stable hash ``h(index)`` is below it; ``max_rows`` keeps the
``max_rows`` rows of the whole corpus with the smallest hashes. The hash is salted apart from the
drafter's held-out split, so a subset is not biased toward or away from held-out rows.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from dflash_assets.data.ranges import key_range
from dflash_assets.dflash.target.features import bytes_per_token
from dflash_assets.dflash.target.layers import resolve_target_layer_ids, text_config
from dflash_assets.orchestration.history import latest_metadata_by_partition
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.storage.stage_outputs import OUTPUTS

if TYPE_CHECKING:
    import dagster as dg

    from dflash_assets.stages.resources.storage import StorageResource
    from dflash_assets.stages.resources.target_model import TargetModelResource

SUBSET_SALT = "dflash-hidden-states-subset:"
MARGIN = 0.05  # head room on top of the planned bytes (safetensors headers, index files, rounding)


def subset_hash(index: int) -> float:
    """Stable number in [0, 1) for prompt ``index`` (SHA-256, first 8 bytes), salted apart from the eval split."""
    digest = hashlib.sha256(f"{SUBSET_SALT}{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def subset_hashes(corpus_indexes) -> np.ndarray:
    """``subset_hash`` of every index, float64, in the given order."""
    indexes = list(corpus_indexes)
    return np.fromiter((subset_hash(i) for i in indexes), dtype=np.float64, count=len(indexes))


def subset_threshold(
    corpus_indexes, max_rows: int | None, fraction: float | None, hashes: np.ndarray | None = None
) -> float:
    """Hash threshold: a row is in the subset when ``subset_hash(index) < threshold`` (1.0 = every row).

    ``max_rows`` wins over ``fraction`` when both are set (the stricter of the two is used).
    """
    threshold = 1.0 if fraction is None else float(fraction)
    if max_rows is not None:
        hashes = np.sort(subset_hashes(corpus_indexes) if hashes is None else hashes)
        if max_rows < len(hashes):
            threshold = min(threshold, float(np.nextafter(hashes[max_rows - 1], 2.0)) if max_rows > 0 else 0.0)
    return threshold


def in_subset(index: int, threshold: float) -> bool:
    """Whether prompt ``index`` is in the subset of ``threshold`` (see :func:`subset_threshold`)."""
    return threshold >= 1.0 or subset_hash(index) < threshold


def target_shape(model_dir: str | os.PathLike, layer_ids: list[int] | None) -> tuple[list[int], int]:
    """``(target_layer_ids, hidden_size)`` from the target's config.json (ids: :func:`resolve_target_layer_ids`)."""
    text = text_config(model_dir)
    return resolve_target_layer_ids(text, layer_ids, 5), int(text["hidden_size"])


class PlanSettings(Protocol):
    """What the plan reads of the hidden-state settings (``ops.hidden_states.config``, a ``HiddenStatesConfig``)."""

    target_layer_ids: list[int]
    storage_budget_gb: float | None
    max_rows: int | None
    fraction: float | None


@dataclass
class StoragePlan:
    """What storing the selected rows' features takes (bytes, tokens, rows) and whether it fits.

    ``bytes_needed``: all selected rows; ``bytes_stored``: hidden-state bytes already written (latest
    materialization of each partition); ``bytes_to_write = bytes_needed - bytes_stored``. ``free_bytes``
    is measured at ``root`` for local storage (None for S3); ``budget_bytes`` is the configured budget
    (None = none). ``fits`` is False when ``bytes_to_write * 1.05 > free_bytes`` or ``bytes_needed >
    budget_bytes``; with neither known (S3 without a budget) the plan is reported, not enforced.
    """

    rows_total: int
    rows_selected: int
    tokens: int
    tokens_estimated: int
    bytes_per_token: int
    bytes_needed: int
    bytes_stored: int
    bytes_to_write: int
    free_bytes: int | None
    budget_bytes: int | None
    root: str
    fits: bool
    subset: dict = field(default_factory=dict)
    target_layer_ids: list[int] = field(default_factory=list)
    hidden_size: int = 0
    rows_that_fit: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line: rows, tokens, bytes, against what."""
        against = []
        if self.free_bytes is not None:
            against.append(f"{gb(self.free_bytes)} free at {self.root}")
        if self.budget_bytes is not None:
            against.append(f"budget {gb(self.budget_bytes)}")
        est = f" ({self.tokens_estimated:,} of them estimated)" if self.tokens_estimated else ""
        sub = f", subset {self.subset}" if self.subset else ""
        return (
            f"{self.rows_selected:,} of {self.rows_total:,} rows{sub}, {self.tokens:,} tokens{est} x "
            f"{self.bytes_per_token:,} B/token = {gb(self.bytes_needed)} ({gb(self.bytes_stored)} already stored) vs "
            f"{' and '.join(against) or 'no free-space figure (S3) and no storage_budget_gb: not enforced'}"
        )

    def failure_message(self) -> str:
        """The error text when the plan does not fit: figures and both ways out."""
        fit = f" (about {self.rows_that_fit:,} rows fit)" if self.rows_that_fit is not None else ""
        return (
            f"hidden-state storage plan does not fit: {self.describe()}. Nothing was written. Ways out: (1) train "
            "online, storing nothing: set ops.dflash_drafter.config.features: online (the main job then skips "
            f"hidden_states); (2) store a subset: set ops.hidden_states.config.max_rows: N{fit} or fraction: F (0..1); "
            "or free space / raise ops.hidden_states.config.storage_budget_gb."
        )


def gb(n: int | float | None) -> str:
    """Bytes as a short decimal string (``12.3 GB``)."""
    if n is None:
        return "?"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def free_space(path: str) -> int:
    """Bytes available to this user on the filesystem of ``path`` (nearest existing ancestor)."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def compute_plan(
    *,
    corpus_indexes,
    partitions: dict[str, dict],
    hidden_state_bytes: dict[str, int],
    layer_ids: list[int],
    hidden_size: int,
    max_rows: int | None,
    fraction: float | None,
    budget_bytes: int | None,
    local_root: str | None,
    fallback_tokens_per_row: float,
    exact: dict[str, tuple[int, int]] | None = None,
) -> StoragePlan:
    """The plan from plain figures (no Dagster).

    Args:
        corpus_indexes: every prompt index of the corpus.
        partitions: partition key -> tokenized metadata (``rows``, ``total_tokens``; ``{}`` = not tokenized).
        hidden_state_bytes: partition key -> bytes already stored for it.
        exact: partition key -> (selected rows, selected tokens) known exactly (the partition being extracted).
        local_root: directory whose free space counts (None: S3, no free-space figure).
        fallback_tokens_per_row: tokens per row when no partition is tokenized yet (the generation cap).
    """
    indexes = np.sort(np.asarray(list(corpus_indexes), dtype=np.int64))
    # one hash per row, once (903 partitions x 1,000 rows: searchsorted, not a scan per partition)
    hashes = subset_hashes(indexes.tolist()) if (max_rows is not None or fraction is not None) else None
    threshold = subset_threshold(indexes.tolist(), max_rows, fraction, hashes)
    chosen_mask = hashes < threshold if threshold < 1.0 else np.ones(len(indexes), dtype=bool)
    per_token = bytes_per_token(len(layer_ids), hidden_size, 2)
    tokenized = [m for m in partitions.values() if m.get("rows")]
    mean = (
        (sum(m.get("total_tokens", 0) for m in tokenized) / max(1, sum(m["rows"] for m in tokenized)))
        if tokenized
        else fallback_tokens_per_row
    )
    exact = exact or {}
    rows_selected = tokens = estimated = 0
    for pk, meta in partitions.items():
        lo, hi = key_range(pk)
        a, b = np.searchsorted(indexes, lo, "left"), np.searchsorted(indexes, hi, "right")
        in_range = indexes[a:b]
        chosen = int(chosen_mask[a:b].sum())
        if pk in exact:
            n, t = exact[pk]
            rows_selected += n
            tokens += t
        elif meta.get("rows"):
            share = chosen / max(1, len(in_range))
            n = round(meta["rows"] * share)
            t = round(meta.get("total_tokens", 0) * share)
            rows_selected += n
            tokens += t
            if share < 1.0:
                estimated += t
        else:
            t = round(chosen * mean)
            rows_selected += chosen
            tokens += t
            estimated += t
    needed = tokens * per_token
    stored = sum(hidden_state_bytes.values())
    to_write = max(0, needed - stored)
    free = free_space(local_root) if local_root else None
    fits = True
    room = None
    if free is not None:
        fits = fits and to_write * (1 + MARGIN) <= free
        room = free / (1 + MARGIN) + stored
    if budget_bytes is not None:
        fits = fits and needed <= budget_bytes
        room = budget_bytes if room is None else min(room, budget_bytes)
    rows_that_fit = int(room / (mean * per_token)) if room is not None and mean > 0 else None
    subset = {k: v for k, v in (("max_rows", max_rows), ("fraction", fraction)) if v is not None}
    return StoragePlan(
        rows_total=len(indexes),
        rows_selected=rows_selected,
        tokens=int(tokens),
        tokens_estimated=int(estimated),
        bytes_per_token=per_token,
        bytes_needed=int(needed),
        bytes_stored=int(stored),
        bytes_to_write=int(to_write),
        free_bytes=free,
        budget_bytes=budget_bytes,
        root=local_root or "(object storage)",
        fits=fits,
        subset=subset,
        target_layer_ids=list(layer_ids),
        hidden_size=hidden_size,
        rows_that_fit=rows_that_fit,
    )


def resolve_features(mode: str, plan: StoragePlan | None) -> str:
    """``offline`` / ``online`` for a drafter ``features`` setting: ``auto`` = online when the plan does not fit."""
    if mode in ("offline", "online"):
        return mode
    if mode != "auto":
        raise ValueError(f"features must be auto, offline or online, got {mode!r}")
    return "offline" if plan is None or plan.fits else "online"


def storage_plan(
    instance: dg.DagsterInstance,
    storage: StorageResource,
    target_model: TargetModelResource,
    config: PlanSettings,
    *,
    exact: dict[str, tuple[int, int]] | None = None,
    fallback_tokens_per_row: float = 0.0,
    indexes: list[int] | None = None,
) -> StoragePlan:
    """The storage plan of ``config`` (``ops.hidden_states.config``) over every partition: tokens from
    tokenized_sequences metadata, bytes stored from hidden_states metadata (partitions in ``exact`` excluded:
    they are being rewritten), free space at the local root or scratch; ``indexes``: the corpus's prompt
    indexes when the caller has read them (else read here)."""
    keys = instance.get_dynamic_partitions(prompt_ranges.name)
    exact = exact or {}
    # two instance queries per asset whatever the partition count (a run per partition would make ~1,800 at 903)
    tokenized = latest_metadata_by_partition(instance, "tokenized_sequences", keys)
    partitions = {pk: tokenized.get(pk, {}) for pk in keys}
    hidden = latest_metadata_by_partition(instance, "hidden_states", [pk for pk in keys if pk not in exact])
    stored = {pk: int(hidden.get(pk, {}).get("bytes") or 0) for pk in keys if pk not in exact}
    model_dir = target_model.resolved_path()
    layer_ids, hidden = target_shape(model_dir, config.target_layer_ids or None)
    budget = int(config.storage_budget_gb * 1e9) if config.storage_budget_gb else None
    root = None if storage.is_remote else storage.root.removeprefix("file://")
    return compute_plan(
        corpus_indexes=indexes if indexes is not None else corpus_indexes(storage.open()),
        partitions=partitions,
        hidden_state_bytes=stored,
        layer_ids=layer_ids,
        hidden_size=hidden,
        max_rows=config.max_rows,
        fraction=config.fraction,
        budget_bytes=budget,
        local_root=root,
        fallback_tokens_per_row=fallback_tokens_per_row,
        exact=exact,
    )


def corpus_indexes(store) -> list[int]:
    """Every prompt index of the corpus (only the ``index`` column chunks are read)."""
    return store.read_parquet(*OUTPUTS["prompt_corpus"], columns=["index"])["index"].to_list()


def feature_source(
    instance: dg.DagsterInstance,
    storage: StorageResource,
    target_model: TargetModelResource,
    setting: str,
    config: PlanSettings,
    fallback_tokens_per_row: float = 0.0,
) -> tuple[str, str]:
    """``(offline | online, why)``: where the drafter's target features come from for its ``features`` setting
    (``ops.dflash_drafter.config.features``), decided here for the main job, ``dflash_drafter`` and
    ``drafter_evaluation`` alike. ``auto`` computes the storage plan of ``config`` (``ops.hidden_states.config``):
    online when storing every selected row's features does not fit; without a plan yet (no corpus, no target
    config), offline (``hidden_states`` then plans, and fails, itself)."""
    if setting in ("offline", "online"):
        return setting, f"features: {setting} (configured)"
    try:
        plan = storage_plan(instance, storage, target_model, config, fallback_tokens_per_row=fallback_tokens_per_row)
    except (OSError, KeyError, ValueError) as exc:
        return "offline", f"features: auto -> offline (no storage plan yet: {type(exc).__name__}: {exc})"
    chosen = resolve_features(setting, plan)
    why = "fits" if plan.fits else "does not fit"
    return chosen, f"features: auto -> {chosen} (storage plan {why}: {plan.describe()})"
