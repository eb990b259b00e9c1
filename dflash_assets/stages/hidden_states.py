"""The ``hidden_states`` stage, outside any Dagster run: its settings (:class:`HiddenStatesConfig`) and storage
plan over every partition; pick the rows of a partition, check the storage plan, run the target over them into
shards, upload, and re-read the shards for the checks. The asset turns the result into
a materialization and :class:`HiddenStatesError` into a failure."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import dagster as dg
import torch
from pydantic import Field

from dflash_assets.common.progress import StageProgressBar
from dflash_assets.data.ranges import key_range
from dflash_assets.data.row_context import CORPUS_INDEX
from dflash_assets.dflash.shards.extraction import extract_partition
from dflash_assets.dflash.shards.format import INDEX_NAME, read_shard, write_index
from dflash_assets.dflash.target.features import bytes_per_token
from dflash_assets.dflash.target.kernels import linear_attention_kernels
from dflash_assets.dflash.target.layers import resolve_target_layer_ids, text_config
from dflash_assets.generation.rows.records import PROMPT_TOO_LONG
from dflash_assets.stages.prompts import CORPUS_FILE
from dflash_assets.stages.storage_plan import StoragePlan, corpus_indexes, in_subset, subset_threshold
from dflash_assets.stages.stored_inputs import fetch_shards

if TYPE_CHECKING:
    from dflash_assets.stages.resources.storage import StorageResource
    from dflash_assets.stages.resources.target_model import TargetModelResource


class HiddenStatesError(Exception):
    """The stage cannot run for this partition; ``metadata`` (plain values) goes with the failure."""

    def __init__(self, message: str, metadata: dict[str, Any] | None = None):
        super().__init__(message)
        self.metadata = metadata or {}


class HiddenStatesConfig(dg.Config):
    """Which target layers to keep and how to shard them."""

    target_layer_ids: list[int] = Field(
        default_factory=list, description="Decoder layer ids; empty = DFlash rule for 5 layers."
    )
    rows_per_shard: int = Field(default=64, ge=1, description="Sequences per safetensors shard.")
    max_rows: int | None = Field(
        default=None,
        ge=0,
        description="Store features for at most this many rows of the corpus (stable-hash subset); None = all.",
    )
    fraction: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Store features for this share of the rows (stable-hash subset); None = all.",
    )
    storage_budget_gb: float | None = Field(
        default=None,
        gt=0.0,
        description=(
            "Bytes (GB, 1e9) all hidden states may take; needed to enforce the plan on S3, optional locally "
            "(free disk space is always checked)."
        ),
    )


@dataclass
class Extraction:
    """What one partition's extraction stored: ``index`` (as in index.json), the rows extracted, the local
    shard directory, the partition's storage ``uri``, the materialization ``metadata`` (plain values) and the
    ``data_version``."""

    index: dict
    rows: list[dict]
    out_dir: str
    uri: str
    metadata: dict[str, Any]
    data_version: str


def prompt_hashes(store, pk: str) -> dict[int, str]:
    """``{index: content_hash}`` of the corpus's prompts in partition ``pk``'s range (two columns read)."""
    frame = store.read_parquet(*CORPUS_FILE, columns=["index", "content_hash"], index_ranges=[key_range(pk)])
    return dict(zip(frame["index"].to_list(), frame["content_hash"].to_list()))


def layer_ids_or_error(config_ids: list[int], target) -> list[int]:
    """The target layers to store: :func:`~dflash_assets.dflash.target.layers.resolve_target_layer_ids` of
    ``config_ids`` (empty = the DFlash rule for 5 layers, arXiv 2602.06036) over ``target`` (model, config
    or directory; a multimodal wrapper counts its ``text_config`` layers).

    Raises:
        HiddenStatesError: an id outside ``0 .. L-1``, naming ``ops.hidden_states.config.target_layer_ids``.
    """
    try:
        return resolve_target_layer_ids(target, config_ids or None, 5)
    except ValueError as exc:
        raise HiddenStatesError(f"ops.hidden_states.config.target_layer_ids: {exc}") from exc


def partition_dir(storage: StorageResource, pk: str) -> str:
    """Local directory the shards are written to (the storage root itself for local storage)."""
    return os.path.dirname(storage.local_scratch("hidden_states", pk, INDEX_NAME))


def _rows_of_corpus_prompts(store, tokenized_path: tuple[str, str], pk: str, log) -> tuple[list[dict], list[int]]:
    """The tokenized rows whose prompt is the corpus's at their corpus row, and the indexes of the others (a table
    from before an edit is re-made upstream). A row's corpus row is its ``index``, or for an on-policy turn its
    ``corpus_index`` (the row its conversation started from: ``prompt_hash`` is that row's hash)."""
    hashes = prompt_hashes(store, pk)
    frame = store.read_parquet(*tokenized_path)
    on_policy = CORPUS_INDEX in frame.columns
    rows = [
        {
            "index": r["index"],
            "corpus_index": r[CORPUS_INDEX] if on_policy else r["index"],
            "input_ids": r["input_ids"],
            "loss_mask": r["loss_mask"],
            "prompt_hash": r.get("prompt_hash"),
        }
        for r in frame.iter_rows(named=True)
    ]
    other = [r["index"] for r in rows if r["prompt_hash"] is None or hashes.get(r["corpus_index"]) != r["prompt_hash"]]
    if other:
        log.warning(
            f"{pk}: {len(other)} tokenized rows answer another prompt than the corpus's at their index "
            f"(first {other[:5]}): not extracted; re-materialize completions and tokenized_sequences[{pk}]"
        )
        skip = set(other)
        rows = [r for r in rows if r["index"] not in skip]
    if not rows and not other and on_policy:
        log.info(f"{pk}: no on-policy conversation starts in this partition: no row, an empty index")
        return rows, other
    if not rows and (other or not _never_sent(store, pk)):
        raise HiddenStatesError(f"{pk}: tokenized_sequences has no row; nothing to extract (see its set-aside rows)")
    if not rows:
        log.info(f"{pk}: every prompt was set aside as {PROMPT_TOO_LONG} (never sent): no row, an empty index")
    return rows, other


def _never_sent(store, pk: str) -> bool:
    """Whether every completions row of ``pk`` was set aside as too long for the context (nothing to extract,
    rightly: the tokenized table is empty and its check passed)."""
    if not store.exists("completions", f"{pk}.parquet"):
        return False
    finish = store.read_parquet("completions", f"{pk}.parquet", columns=["finish_reason"])["finish_reason"]
    return finish.len() > 0 and bool(finish.eq_missing(PROMPT_TOO_LONG).all())


def extract_stage(
    pk: str,
    storage: StorageResource,
    target_model: TargetModelResource,
    config: HiddenStatesConfig,
    tokenized_path: tuple[str, str],
    plan_for: Callable[[list[int], dict[str, tuple[int, int]]], StoragePlan],
    log,
) -> Extraction:
    """Extract partition ``pk``'s hidden states into shards (kept, downloaded or written) and store them.

    ``plan_for(corpus_indexes, exact)`` is the storage plan with partition ``pk`` counted as ``exact``
    ``(rows, tokens)``; it is checked before the model loads or a byte is written. ``log`` has ``info`` and
    ``warning``.

    Raises:
        HiddenStatesError: no row to extract, the plan does not fit (metadata ``storage_plan``), or a
            configured layer id outside the model.
    """
    store = storage.open()
    rows, other = _rows_of_corpus_prompts(store, tokenized_path, pk, log)
    # the plan comes first: over budget, fail before loading the model or writing a byte
    indexes = corpus_indexes(store)
    threshold = subset_threshold(indexes, config.max_rows, config.fraction)
    all_rows = len(rows)
    # by corpus row: an on-policy conversation's turns are kept or left out together
    rows = [r for r in rows if in_subset(r["corpus_index"], threshold)]
    plan = plan_for(indexes, {pk: (len(rows), sum(len(r["input_ids"]) for r in rows))})
    log.info(f"{pk}: storage plan: {plan.describe()}")
    if not plan.fits:
        raise HiddenStatesError(plan.failure_message(), metadata={"storage_plan": plan.to_dict()})
    if len(rows) < all_rows:
        log.info(f"{pk}: subset {plan.subset}: storing {len(rows)} of {all_rows} rows")
    model = target_model.load_model()
    kernels = linear_attention_kernels(model)
    log.info(f"{pk}: target {type(model).__name__}: {kernels['summary']}")
    layer_ids = layer_ids_or_error(config.target_layer_ids, model)
    per_token = bytes_per_token(len(layer_ids), int(text_config(model).hidden_size), 2)
    num_tokens = sum(len(r["input_ids"]) for r in rows)
    corpus_estimate = per_token * num_tokens / max(1, len(rows)) * len(indexes)
    log.info(
        f"{pk}: {len(rows)} rows, {num_tokens} tokens, layers {layer_ids}: "
        f"~{per_token * num_tokens / 1e6:.1f} MB at {per_token} B/token; "
        f"the whole corpus ({len(indexes)} prompts) at this rate: ~{corpus_estimate / 1e9:.2f} GB"
    )
    started = time.monotonic()

    bar = StageProgressBar(f"hidden_states {pk}", None, unit="shard")
    out_dir = partition_dir(storage, pk)
    downloaded = _download_stored_shards(storage, store, pk, log)
    with bar, torch.inference_mode():  # inference_mode, not set_grad_enabled: training may follow here
        result = extract_partition(
            model,
            rows,
            out_dir,
            layer_ids,
            rows_per_shard=config.rows_per_shard,
            max_tokens_per_batch=target_model.max_tokens_per_batch,
            dtype=torch.bfloat16,
            progress_cb=_shard_progress(bar, pk, log),
            model_name=target_model.model_name(),
        )
    wall = time.monotonic() - started
    index = result.index
    # each row's prompt by content (row_index -> content_hash): the drafter's data fingerprint covers it
    index["prompt_hashes"] = {str(r["index"]): r["prompt_hash"] for r in rows}
    write_index(out_dir, index)
    _upload(store, pk, out_dir, index, downloaded, result.skipped_shards)
    metadata = {
        "rows": index["num_rows"],
        "rows_of_other_prompts": len(other),  # tokenized rows not extracted: their prompt is not the corpus's
        "tokens": index["num_tokens"],
        "bytes": index["total_bytes"],
        "bytes_per_token": round(index["total_bytes"] / max(index["num_tokens"], 1), 1),
        "bytes_per_token_expected": per_token,
        "estimated_corpus_bytes": int(corpus_estimate),
        "storage_plan": plan.to_dict(),
        "storage_plan_text": plan.describe(),
        "subset": plan.subset,
        "rows_in_partition": all_rows,
        "target_layer_ids": layer_ids,
        "linear_attention_kernels": kernels["summary"],
        "shards": len(index["shards"]),
        "shards_written": len(result.written_shards),
        "shards_kept": len(result.skipped_shards),
        "shards_downloaded": len(downloaded),
        "tokens_per_s": round(num_tokens / max(wall, 1e-9), 1) if result.written_shards else 0.0,
        "wall_s": round(wall, 2),
    }
    return Extraction(index, rows, out_dir, store.uri("hidden_states", pk), metadata, _data_version(index))


def _download_stored_shards(storage: StorageResource, store, pk: str, log) -> list[str]:
    """On a fresh machine with S3 storage, the shards stored earlier are downloaded (size + sha256 checked), not
    recomputed; extract_partition then keeps the ones that still match the tokenized rows. Returns their names."""
    downloaded = []
    if storage.is_remote and store.exists("hidden_states", pk, INDEX_NAME):
        _, downloaded = fetch_shards(storage, pk, store.read_json("hidden_states", pk, INDEX_NAME), on_bad="drop")
        if downloaded:
            log.info(f"{pk}: downloaded {len(downloaded)} stored shards instead of recomputing them")
    return downloaded


def _shard_progress(bar: StageProgressBar, pk: str, log) -> Callable[[dict], None]:
    """The extraction's per-shard callback: the progress bar and a line per shard."""

    def progress(p: dict) -> None:
        bar.update_to(p["shard_number"] + 1, p["num_shards"], tok_s=f"{p['tokens'] / max(p['seconds'], 1e-9):.0f}")
        log.info(
            f"{pk}: shard {p['shard_number'] + 1}/{p['num_shards']} {'kept' if p['skipped'] else 'written'}, "
            f"{p['tokens']} tokens in {p['seconds']:.1f}s ({p['tokens'] / max(p['seconds'], 1e-9):.0f} tok/s)"
        )

    return progress


def _upload(store, pk: str, out_dir: str, index: dict, downloaded: list[str], kept: list[str]) -> None:
    """Copy the shards storage does not hold yet, then the index (local storage: written in place)."""
    if store.is_local:
        return
    for shard in index["shards"]:  # streamed, not read into memory (shards can be GBs)
        if shard["name"] in downloaded or (
            shard["name"] in kept
            and store.exists("hidden_states", pk, shard["name"])
            and store.size("hidden_states", pk, shard["name"]) == shard["bytes"]
        ):
            continue  # storage already holds this very file
        store.upload(os.path.join(out_dir, shard["name"]), "hidden_states", pk, shard["name"])
    store.write_json(index, "hidden_states", pk, INDEX_NAME)  # last: readers trust only a complete index


def _data_version(index: dict) -> str:
    """What the stored features depend on: every shard's rows, the layers and the target."""
    parts = [s["rows_sha256"] for s in index["shards"]] + [index["target_layer_ids"], index["model_name"]]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def check_shards(out_dir: str, index: dict, rows: list[dict]) -> tuple[list[int], list[str]]:
    """Re-read every shard: the row indexes whose token ids differ from the tokenized rows', and the shards
    holding a NaN or Inf feature."""
    expected = {r["index"]: r["input_ids"] for r in rows}
    mismatched, nonfinite = [], []
    for shard in index["shards"]:
        data = read_shard(os.path.join(out_dir, shard["name"]))
        cu = data.cu_seqlens.tolist()
        for r, idx in enumerate(data.row_index.tolist()):
            if data.input_ids[cu[r] : cu[r + 1]].tolist() != expected.get(idx):
                mismatched.append(idx)
        if not torch.isfinite(data.hidden_states.float()).all():
            nonfinite.append(shard["name"])
    return mismatched, nonfinite
