"""Resumable extraction of a partition's hidden states into shards (the format:
:mod:`~dflash_assets.dflash.shards.format`, whose names are imported from here too)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_assets.dflash.shards.format import (  # the format lived here; imported from here by many
    DTYPE_NAMES,
    FORMAT,
    INDEX_NAME,
    file_sha256,
    read_index,
    rows_sha256,
    shard_metadata,
    shard_name,
    validate_shard,
    write_index,
    write_shard,
)
from dflash_assets.dflash.target.features import (
    TargetFeatureExtractor,
    bytes_per_token,
    check_free_space,
    estimate_bytes,
    iter_batches_by_token_budget,
)

__all__ = ["PartitionExtraction", "extract_partition", "plan_shards"]


@dataclass
class _PlannedShard:
    name: str
    rows: list[dict[str, Any]]
    row_index: torch.Tensor
    cu_seqlens: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    sha: str

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def plan_shards(rows: Sequence[dict[str, Any]], rows_per_shard: int) -> list[_PlannedShard]:
    """Sort rows by ``index`` and cut them into shards of ``rows_per_shard`` (the last may be shorter).

    Raises:
        ValueError: duplicate indices, empty ``input_ids``, or ``loss_mask`` length != ``input_ids`` length.
    """
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
    ordered = sorted(rows, key=lambda r: int(r["index"]))
    indices = [int(r["index"]) for r in ordered]
    if len(set(indices)) != len(indices):
        raise ValueError("rows have duplicate 'index' values")
    plans = []
    for k, start in enumerate(range(0, len(ordered), rows_per_shard)):
        chunk = ordered[start : start + rows_per_shard]
        ids = [torch.as_tensor(r["input_ids"], dtype=torch.int32).reshape(-1) for r in chunk]
        masks = [torch.as_tensor(r["loss_mask"], dtype=torch.int8).reshape(-1) for r in chunk]
        for r, i, m in zip(chunk, ids, masks):
            if i.numel() == 0:
                raise ValueError(f"row {r['index']} has no input_ids")
            if m.numel() != i.numel():
                raise ValueError(f"row {r['index']}: loss_mask has {m.numel()} entries, input_ids {i.numel()}")
        lengths = torch.tensor([0] + [i.numel() for i in ids], dtype=torch.int64)
        row_index = torch.tensor([int(r["index"]) for r in chunk], dtype=torch.int64)
        cu = lengths.cumsum(0)
        input_ids, loss_mask = torch.cat(ids), torch.cat(masks)
        plans.append(
            _PlannedShard(
                shard_name(k),
                list(chunk),
                row_index,
                cu,
                input_ids,
                loss_mask,
                rows_sha256(row_index, cu, input_ids, loss_mask),
            )
        )
    return plans


@dataclass
class PartitionExtraction:
    """What ``extract_partition`` did: the final ``index`` (as written), the shard names computed and
    written now, those found complete and kept, and the wall seconds spent."""

    index: dict[str, Any]
    written_shards: list[str]
    skipped_shards: list[str]
    seconds: float


def _model_device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def extract_partition(
    model: torch.nn.Module,
    rows: Sequence[dict[str, Any]],
    out_dir: str | os.PathLike,
    target_layer_ids: Sequence[int],
    rows_per_shard: int = 64,
    max_tokens_per_batch: int = 16384,
    dtype: torch.dtype = torch.bfloat16,
    progress_cb: Callable[[dict[str, Any]], None] | None = None,
    *,
    model_name: str | None = None,
    free_space_margin: float = 0.05,
) -> PartitionExtraction:
    """Extract target hidden states for one partition into ``out_dir``, resumably.

    Shard ``k`` holds the rows at positions ``[k * rows_per_shard, (k + 1) * rows_per_shard)`` of
    ``rows`` sorted by ``index``, so the plan depends only on the rows. A shard already on disk that
    ``validate_shard`` accepts for the same rows, tokens, layers, model name and dtype is kept
    untouched; a missing, truncated or stale one is recomputed. Stale temp files and shard files beyond
    the plan are removed. ``index.json`` is first rewritten with ``complete: false`` and, after every
    shard is on disk, with ``complete: true`` (last write). Within a shard, rows are batched by
    ``iter_batches_by_token_budget`` and right-padded, so a rerun recomputes a shard from exactly the
    same batches: on the same hardware and thread count a resumed run is byte-identical to an
    uninterrupted one. One writer per ``out_dir`` at a time.

    Args:
        model: HF decoder-only target (``TargetFeatureExtractor``); set to ``eval()`` here.
        rows: dicts ``{index: int, input_ids: list[int], loss_mask: list[int]}``.
        out_dir: local directory of the partition (created).
        target_layer_ids: 0-based decoder layer ids (``default_target_layer_ids``).
        rows_per_shard: rows per shard file.
        max_tokens_per_batch: padded tokens (``B * max_len``) per forward pass.
        dtype: stored hidden-state dtype (bf16 by the format).
        progress_cb: called after each shard with ``{shard, shard_number, num_shards, rows, tokens,
            bytes, skipped, seconds}``.
        model_name: recorded in the metadata; default ``model.config._name_or_path``.
        free_space_margin: fraction added to the estimated bytes before the disk-space check.

    Returns:
        ``PartitionExtraction``.

    Raises:
        InsufficientDiskSpaceError: the shards still to write do not fit (checked before any write).
        ValueError: malformed rows (see ``plan_shards``) or an unsupported ``dtype``.
    """
    started = time.perf_counter()
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {dtype}")
    job = _ShardJob(model, rows, Path(out_dir), target_layer_ids, rows_per_shard, dtype, model_name)
    job.remove_strays()
    valid = job.valid_shards()
    job.check_free_space(valid, free_space_margin)
    write_index(job.out, job.index(complete=False))
    written, skipped = [], []
    for number, plan in enumerate(job.plans):
        shard_started = time.perf_counter()
        if plan.name in valid:
            job.keep(plan)
            skipped.append(plan.name)
        else:
            job.write(plan, job.features(plan, max_tokens_per_batch))
            written.append(plan.name)
        if progress_cb is not None:
            progress_cb(
                {
                    "shard": plan.name,
                    "shard_number": number,
                    "num_shards": len(job.plans),
                    "rows": len(plan.rows),
                    "tokens": plan.num_tokens,
                    "bytes": job.sizes[plan.name],
                    "skipped": plan.name in valid,
                    "seconds": time.perf_counter() - shard_started,
                }
            )
    index = job.index(complete=True)
    write_index(job.out, index)
    return PartitionExtraction(index, written, skipped, time.perf_counter() - started)


class _ShardJob:
    """One partition's extraction (:func:`extract_partition`), phase by phase: the plan (``plans``, each shard's
    expected metadata), stray files removed, the shards already valid, the free space, then each shard kept or
    computed (:meth:`features`) and written, and the index that lists them."""

    def __init__(
        self,
        model: torch.nn.Module,
        rows: Sequence[dict[str, Any]],
        out: Path,
        target_layer_ids: Sequence[int],
        rows_per_shard: int,
        dtype: torch.dtype,
        model_name: str | None,
    ) -> None:
        out.mkdir(parents=True, exist_ok=True)
        if model_name is None:
            model_name = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
        model.eval()
        self.out, self.model_name, self.dtype = out, model_name, dtype
        self.target_layer_ids, self.rows_per_shard = target_layer_ids, rows_per_shard
        self.extractor = TargetFeatureExtractor(model, target_layer_ids)
        self.hidden_size, self.n_layers = self.extractor.hidden_size, len(self.extractor.target_layer_ids)
        self.device = _model_device(model)
        self.plans = plan_shards(rows, rows_per_shard)
        self.expected_meta = {
            p.name: shard_metadata(
                target_layer_ids, self.hidden_size, model_name, dtype, len(p.rows), p.num_tokens, p.sha
            )
            for p in self.plans
        }
        self.sizes: dict[str, int] = {}
        self.hashes: dict[str, str] = {}  # file SHA-256 per shard: a copy elsewhere (S3) is verified against it
        self.previous: dict[str, dict] = {}

    def remove_strays(self) -> None:
        """Stale temp files, shard files beyond the plan and temporary index files go."""
        planned_names = {p.name for p in self.plans}
        for entry in self.out.iterdir():
            stale_tmp = entry.name.startswith(".shard-") and entry.name.endswith(".tmp")
            extra_shard = (
                entry.name.startswith("shard-")
                and entry.name.endswith(".safetensors")
                and entry.name not in planned_names
            )
            if entry.is_file() and (stale_tmp or extra_shard or entry.name.startswith(f".{INDEX_NAME}.")):
                entry.unlink(missing_ok=True)

    def valid_shards(self) -> set[str]:
        """The planned shards on disk that ``validate_shard`` accepts for the same rows, tokens and metadata (the
        previous index is read for their recorded hashes)."""
        self.previous = {e["name"]: e for e in (read_index(self.out) or {}).get("shards", [])}
        return {
            p.name
            for p in self.plans
            if validate_shard(
                self.out / p.name, len(p.rows), p.row_index.tolist(), expected_metadata=self.expected_meta[p.name]
            )
        }

    def check_free_space(self, valid: set[str], margin: float) -> None:
        """Raise InsufficientDiskSpaceError when the shards still to write do not fit (before any write)."""
        todo = [p for p in self.plans if p.name not in valid]
        dtype_bytes = torch.tensor([], dtype=self.dtype).element_size()
        needed = estimate_bytes(
            sum(p.num_tokens for p in todo),
            self.n_layers,
            self.hidden_size,
            dtype_bytes,
            sum(len(p.rows) for p in todo),
            len(todo),
        )
        if todo:
            check_free_space(self.out, needed, margin)

    def index(self, complete: bool) -> dict[str, Any]:
        """``index.json``: the format, the plan, and each shard's size and hash as known (sizes only when
        complete)."""
        sizes = self.sizes if complete else {}
        hidden_size, n_layers, dtype = self.hidden_size, self.n_layers, self.dtype
        return {
            "format": FORMAT,
            "complete": complete,
            "target_layer_ids": [int(i) for i in self.target_layer_ids],
            "hidden_size": hidden_size,
            "feature_size": n_layers * hidden_size,
            "dtype": DTYPE_NAMES[dtype],
            "model_name": self.model_name,
            "rows_per_shard": self.rows_per_shard,
            "num_rows": sum(len(p.rows) for p in self.plans),
            "num_tokens": sum(p.num_tokens for p in self.plans),
            "bytes_per_token": bytes_per_token(n_layers, hidden_size, torch.tensor([], dtype=dtype).element_size()),
            "total_bytes": sum(sizes.values()) if complete else None,
            "shards": [
                {
                    "name": p.name,
                    "rows": len(p.rows),
                    "tokens": p.num_tokens,
                    "bytes": sizes.get(p.name),
                    "first_index": int(p.row_index[0]),
                    "last_index": int(p.row_index[-1]),
                    "rows_sha256": p.sha,
                    "sha256": self.hashes.get(p.name),
                }
                for p in self.plans
            ],
        }

    def keep(self, plan: _PlannedShard) -> None:
        """A valid shard stays untouched: its size, and its hash from the previous index when that one recorded
        the same rows and size (else hashed again)."""
        path = self.out / plan.name
        self.sizes[plan.name] = path.stat().st_size
        old = self.previous.get(plan.name) or {}
        known = (
            old.get("sha256")
            if old.get("rows_sha256") == plan.sha and old.get("bytes") == self.sizes[plan.name]
            else None
        )
        self.hashes[plan.name] = known or file_sha256(path)

    def features(self, plan: _PlannedShard, max_tokens_per_batch: int) -> torch.Tensor:
        """The shard's target features ``[tokens, n_layers * hidden]``: its rows batched by token budget,
        right-padded (any pad id: padding is masked and never attended to by real tokens)."""
        pad_id = 0
        hidden = torch.empty(plan.num_tokens, self.extractor.feature_size, dtype=self.dtype)
        lengths = plan.cu_seqlens.diff().tolist()
        for batch in iter_batches_by_token_budget(lengths, max_tokens_per_batch):
            max_len = max(lengths[p] for p in batch)
            input_ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), max_len), dtype=torch.long)
            for b, p in enumerate(batch):
                start, end = int(plan.cu_seqlens[p]), int(plan.cu_seqlens[p + 1])
                input_ids[b, : end - start] = plan.input_ids[start:end]
                attention_mask[b, : end - start] = 1
            features = self.extractor(input_ids.to(self.device), attention_mask.to(self.device), dtype=self.dtype).cpu()
            for b, p in enumerate(batch):
                start, end = int(plan.cu_seqlens[p]), int(plan.cu_seqlens[p + 1])
                hidden[start:end] = features[b, : end - start]
            del features
        return hidden

    def write(self, plan: _PlannedShard, hidden: torch.Tensor) -> None:
        """Write the shard (atomically, byte-identical for the same inputs); record its size and hash."""
        digest: dict = {}
        self.sizes[plan.name] = write_shard(
            self.out / plan.name,
            hidden,
            plan.input_ids,
            plan.loss_mask,
            plan.cu_seqlens,
            plan.row_index,
            target_layer_ids=self.target_layer_ids,
            hidden_size=self.hidden_size,
            model_name=self.model_name,
            digest_out=digest,
        )
        self.hashes[plan.name] = digest["sha256"]
