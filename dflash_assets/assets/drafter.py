"""Stage 6: ``dflash_drafter``: train the DFlash drafter on every materialized hidden-state partition and export it."""

import hashlib
import json
import os
import subprocess
import sys
import time

from typing import Literal

import dagster as dg
from pydantic import Field

from dflash_assets.assets.hidden_states import ShardIntegrityError, fetch_shards
from dflash_assets.dflash.export import export_drafter
from dflash_assets.dflash.shards import INDEX_NAME
from dflash_assets.dflash.train import TrainConfig, train
from dflash_assets.feature_sources import decide_mode, tokenized_inputs
from dflash_assets.figures import figure_png_bytes, new_figure
from dflash_assets.metadata import png_markdown
from dflash_assets.partitions import prompt_ranges
from dflash_assets.resources.storage import StorageResource
from dflash_assets.resources.target_model import TargetModelResource
from dflash_assets.status import GPU_POOL

DRAFTER_DIR = "dflash_drafter"
EXPORT_DIR = (DRAFTER_DIR, "export")


class DrafterConfig(dg.Config):
    """Training settings (defaults follow the DFlash recipe: 5 layers, block 16, lr 6e-4, 6 epochs, max length 3072)."""

    num_hidden_layers: int = Field(default=5, ge=1, description="Draft decoder layers.")
    block_size: int = Field(default=16, ge=2)
    mask_token_id: int | None = Field(default=None, description="None = a token the target never produces (see dflash.model).")
    epochs: int = Field(default=6, ge=1)
    max_steps: int | None = Field(default=None, ge=1, description="Overrides epochs when set.")
    batch_size: int = Field(default=1, ge=1, description="Sequences per rank per step.")
    lr: float = 6e-4
    max_length: int = 3072
    max_anchors: int = Field(default=512, ge=1, description="Anchors sampled per sequence.")
    eval_fraction: float = Field(default=0.1, ge=0.0, lt=1.0, description="Held-out share of rows (stable hash of prompt index).")
    checkpoint_every: int = Field(default=200, ge=0, description="Steps between checkpoints (0 = end only).")
    nproc: int = Field(default=1, ge=1, description="Processes per node (torchrun, gloo on CPU / nccl on GPU); 1 with nnodes 1 = in this process.")
    nnodes: int = Field(default=1, ge=1, description="Nodes (torchrun --nnodes); >1: run dflash_drafter/runs/<id>/launch_other_nodes.sh on each other node.")
    rdzv_endpoint: str = Field(default="", description="HOST:PORT of the c10d rendezvous, reachable from every node (nnodes > 1).")
    rdzv_id: str = Field(default="dflash", description="Rendezvous id, the same on every node.")
    features: Literal["auto", "offline", "online"] = Field(
        default="auto",
        description="offline: train on hidden_states shards; online: the frozen target computes each batch's features from "
                    "tokenized_sequences (nothing stored); auto: online when the hidden-state storage plan does not fit.",
    )
    seed: int = 0
    intermediate_size: int | None = Field(default=None, description="Override the drafter MLP width (default: the target's).")


def complete_shards(storage: StorageResource, keys: list[str]) -> tuple[list[str], list[str], list[str]]:
    """``(shard paths, partitions used, partitions without a complete index)`` from local hidden-state dirs
    (for S3 storage, the index and any shard missing or of another size locally are downloaded first)."""
    shards, used, skipped = [], [], []
    for pk in keys:
        index_path = storage.ensure_local("hidden_states", pk, INDEX_NAME, refresh=True)
        if not os.path.exists(index_path):
            skipped.append(pk)
            continue
        with open(index_path) as f:
            index = json.load(f)
        if not index.get("complete"):
            skipped.append(pk)
            continue
        used.append(pk)
        try:
            shards += fetch_shards(storage, pk, index)[0]  # S3: downloaded, checked by size and sha256
        except ShardIntegrityError as exc:
            raise dg.Failure(str(exc)) from exc
    return shards, used, skipped


def loss_curve_png(records: list[dict]) -> bytes:
    """PNG bytes of training loss per step (and held-out loss where logged)."""
    fig, ax = new_figure(figsize=(7, 3.5), dpi=100)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss")
    ev = [r for r in records if "eval_loss" in r]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("decay-weighted CE")
    ax.legend()
    fig.tight_layout()
    return figure_png_bytes(fig)


def read_log(path: str) -> list[dict]:
    """Records of a train_log.jsonl (a torn last line is ignored)."""
    records = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return records


@dg.asset(
    deps=["hidden_states", "tokenized_sequences"],  # offline reads the first, online only the second
    group_name="drafter",
    kinds={"pytorch", "safetensors"},
    owners=["team:dflash"],
    op_tags={"dflash/gpu": "train"},
    pool=GPU_POOL,
    description=(
        "Trains the DFlash drafter (fc + hidden_norm over 5 target layers, draft decoder layers, frozen target embedding "
        "and LM head) on the hidden-state shards of every complete partition, with a held-out split; checkpoints under "
        "dflash_drafter/runs/<run id>/ (a rerun resumes); exports dflash_drafter/export/ (config.json with "
        "architectures [DFlashDraftModel], block_size, dflash_config; model.safetensors) for SGLang/vLLM."
    ),
)
def dflash_drafter(context: dg.AssetExecutionContext, config: DrafterConfig, storage: StorageResource, target_model: TargetModelResource) -> dg.MaterializeResult:
    keys = context.instance.get_dynamic_partitions(prompt_ranges.name)
    mode, mode_reason = decide_mode(context.instance, storage, target_model, config.features)
    shards, used, skipped = complete_shards(storage, keys) if mode == "offline" else ([], [], [])
    if mode == "offline" and not shards and config.features == "auto":
        mode, mode_reason = "online", mode_reason + "; no complete hidden_states partition: online"
    context.log.info(mode_reason)
    tokenized = []
    if mode == "online":
        tokenized, used = tokenized_inputs(storage, keys)
        if not tokenized:
            raise dg.Failure(f"features: online, but no tokenized_sequences partition among {len(keys)}: materialize it first")
    elif not shards:
        raise dg.Failure(f"no complete hidden_states partition among {len(keys)}: materialize hidden_states first "
                         "(or set ops.dflash_drafter.config.features: online)")
    if skipped:
        context.log.warning(f"training without {len(skipped)} partitions that have no complete hidden states: {skipped[:5]}")
    inputs = sorted(shards) if mode == "offline" else [mode] + sorted(tokenized)
    fingerprint = hashlib.sha256(json.dumps([config.model_dump(exclude={"nproc", "features", "nnodes", "rdzv_endpoint", "rdzv_id"}), inputs], sort_keys=True).encode()).hexdigest()[:12]
    run_dir = os.path.dirname(storage.local_scratch(DRAFTER_DIR, "runs", fingerprint, "x"))
    export_dir = os.path.dirname(storage.local_scratch(*EXPORT_DIR, "x"))
    overrides = {"intermediate_size": config.intermediate_size} if config.intermediate_size else {}
    cfg = TrainConfig(
        shards=shards, out_dir=run_dir, features=mode, tokenized=tokenized, target_dtype=target_model.dtype, target_model_path=str(target_model.resolved_path()),
        num_hidden_layers=config.num_hidden_layers, block_size=config.block_size, mask_token_id=config.mask_token_id,
        draft_overrides=overrides, max_length=config.max_length, max_anchors=config.max_anchors,
        eval_fraction=config.eval_fraction, batch_size=config.batch_size, lr=config.lr, epochs=config.epochs,
        max_steps=config.max_steps, seed=config.seed, checkpoint_every=config.checkpoint_every, device=target_model.device,
    )
    what = f"{len(shards)} shards" if mode == "offline" else f"tokenized rows, features computed online by the frozen target"
    context.log.info(f"training on {what} from {len(used)} partitions; run dir {run_dir}")
    started = time.monotonic()
    if config.nproc == 1 and config.nnodes == 1:
        def progress(rec: dict) -> None:
            if rec["step"] % 20 == 0 or rec["step"] == rec["total_steps"]:
                eta = (rec["total_steps"] - rec["step"]) * rec["elapsed_s"] / max(rec["step"], 1)
                context.log.info(f"step {rec['step']}/{rec['total_steps']} loss {rec['loss']:.3f} {rec['tokens_per_s']:.0f} tok/s ETA {eta:.0f}s")

        result = train(cfg, progress_callback=progress)
        export_drafter(result.model, export_dir)
        summary = result.summary
    else:
        _run_torchrun(context, cfg, config, export_dir)
        summary = json.load(open(os.path.join(run_dir, "summary.json")))
    wall = time.monotonic() - started
    records = read_log(os.path.join(run_dir, "train_log.jsonl"))
    png = loss_curve_png(records) if records else b""
    store = storage.open()
    if png:
        store.write_bytes(png, DRAFTER_DIR, "loss_curve.png")
    if not store.is_local:
        for name in sorted(os.listdir(export_dir)):
            store.upload(os.path.join(export_dir, name), *EXPORT_DIR, name)
    weights = open(os.path.join(export_dir, "model.safetensors"), "rb").read()
    draft_cfg = summary["draft_config"]
    num_params = _count_params(weights)
    evaluation = summary.get("eval") or {}
    acc = evaluation.get("acc_per_position") or []
    return dg.MaterializeResult(
        metadata={
            "parameters": num_params,
            "train_rows": summary["train_rows"],
            "train_tokens": summary["train_tokens"],
            "steps": summary["step"],
            "final_loss": summary["final_loss"],
            "tokens_per_s": round(summary["tokens_per_s"], 1),
            "world_size": summary["world_size"],
            "heldout_loss": evaluation.get("loss"),
            "heldout_rows": evaluation.get("rows"),
            "heldout_acc_per_position": [None if a != a else round(a, 4) for a in acc],
            "heldout_tau_estimate": evaluation.get("tau_estimate"),
            "partitions_used": len(used),
            "features": mode,
            "features_reason": mode_reason,
            "target_forwards": summary.get("target_forwards", 0),
            "offline_subset": _offline_subset(context.instance, used) if mode == "offline" else {},
            "seed": config.seed,
            "eval_fraction": config.eval_fraction,
            "max_length": config.max_length,
            "block_size": draft_cfg.get("block_size"),
            "mask_token_id": draft_cfg.get("mask_token_id"),
            "target_layer_ids": draft_cfg.get("target_layer_ids"),
            "wall_s": round(wall, 1),
            "loss_curve": png_markdown(png, "loss") if png else "",
            "export_path": dg.MetadataValue.path(store.uri(*EXPORT_DIR)),
        },
        data_version=dg.DataVersion(hashlib.sha256(weights).hexdigest()[:20]),
    )


def _offline_subset(instance: dg.DagsterInstance, used: list[str]) -> dict:
    """Subset setting and rows stored by the hidden_states partitions trained on (their latest metadata)."""
    from dflash_assets.automation import latest_metadata

    stored = total = 0
    subset: dict = {}
    for pk in used:
        meta = latest_metadata(instance, dg.AssetKey("hidden_states"), pk) or {}
        stored += int(meta.get("rows") or 0)
        total += int(meta.get("rows_in_partition") or meta.get("rows") or 0)
        subset = meta.get("subset") or subset
    return {**subset, "rows_stored": stored, "rows_tokenized": total}


def _count_params(safetensors_bytes: bytes) -> int:
    from safetensors.torch import load

    return int(sum(t.numel() for t in load(safetensors_bytes).values()))


def _run_torchrun(context, cfg: TrainConfig, config: DrafterConfig, export_dir: str) -> None:
    """Train with ``torchrun`` (same code path as in-process), streaming its log. ``nnodes > 1``: this node
    joins the c10d rendezvous at ``rdzv_endpoint``; the command for the other nodes is written to
    ``<run dir>/launch_other_nodes.sh`` and logged (see :mod:`dflash_assets.dflash.distributed`)."""
    import dataclasses

    from dflash_assets.dflash.distributed import torchrun_argv, write_node_script

    cfg_path = os.path.join(cfg.out_dir, "train_config.json")
    os.makedirs(cfg.out_dir, exist_ok=True)
    with open(cfg_path, "w") as f:
        json.dump({k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("shards", "tokenized", "out_dir", "target_model_path")}, f)
    train_args = ["--shards", *cfg.shards, "--tokenized", *cfg.tokenized, "--features", cfg.features, "--out", cfg.out_dir,
                  "--target-model", cfg.target_model_path, "--export", export_dir, "--config-json", cfg_path]
    try:
        argv = torchrun_argv(train_args, nproc_per_node=config.nproc, nnodes=config.nnodes,
                             rdzv_endpoint=config.rdzv_endpoint, rdzv_id=config.rdzv_id)
    except ValueError as exc:
        raise dg.Failure(str(exc)) from exc
    if config.nnodes > 1:
        script = write_node_script(os.path.join(cfg.out_dir, "launch_other_nodes.sh"), argv,
                                   {"PYTHONPATH": os.environ.get("PYTHONPATH", "")} if os.environ.get("PYTHONPATH") else None)
        context.log.info(f"waiting for {config.nnodes - 1} more node(s) at {config.rdzv_endpoint}: on each, run {script} "
                         "(same paths on a shared filesystem)")
    context.log.info("launching " + " ".join(argv[:9]) + " ...")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-40:]
        if "step" in line or "error" in line.lower():
            context.log.info(line.rstrip())
    if proc.wait() != 0:
        raise dg.Failure(f"torchrun exited with {proc.returncode}", metadata={"log_tail": "\n".join(tail)})
