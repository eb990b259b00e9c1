"""Stage 6: ``dflash_drafter``: train the DFlash drafter on every materialized hidden-state partition and export it."""

import hashlib
import json
import os
import time
from typing import Literal

import dagster as dg
from pydantic import Field

from dflash_assets.assets.hidden_states import ShardIntegrityError, fetch_shards
from dflash_assets.atomic import atomic_write_bytes
from dflash_assets.dflash.export import export_drafter
from dflash_assets.dflash.model import DRAFT_SHAPE_FIELDS, DFlashConfig
from dflash_assets.dflash.shards import INDEX_NAME
from dflash_assets.dflash.target_layers import (
    default_target_layer_ids,
    num_target_layers,
    resolve_target_layer_ids,
    text_config,
)
from dflash_assets.dflash.train import TrainConfig, train
from dflash_assets.feature_sources import decide_mode, hidden_states_config, tokenized_inputs
from dflash_assets.figures import figure_png_bytes, new_figure
from dflash_assets.generation.processes import run_streaming
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
    mask_token_id: int | None = Field(
        default=None,
        ge=0,
        description="MASK token filling block positions 1..: an id below the target's vocab_size that it never generates; "
        "None = chosen from the tokenizer (see dflash.model.default_mask_token_id).",
    )
    epochs: int = Field(default=6, ge=1)
    max_steps: int | None = Field(default=None, ge=1, description="Overrides epochs when set.")
    batch_size: int = Field(default=1, ge=1, description="Sequences per rank per step.")
    lr: float = 6e-4
    max_length: int = 3072
    max_anchors: int = Field(default=512, ge=1, description="Anchors sampled per sequence.")
    eval_fraction: float = Field(
        default=0.1, ge=0.0, lt=1.0, description="Held-out share of rows (stable hash of prompt index)."
    )
    checkpoint_every: int = Field(default=200, ge=0, description="Steps between checkpoints (0 = end only).")
    nproc: int = Field(
        default=1,
        ge=1,
        description="Processes per node (torchrun, gloo on CPU / nccl on GPU); 1 with nnodes 1 = in this process.",
    )
    nnodes: int = Field(
        default=1,
        ge=1,
        description="Nodes (torchrun --nnodes); >1: run dflash_drafter/runs/<id>/launch_other_nodes.sh on each other node.",
    )
    rdzv_endpoint: str = Field(
        default="", description="HOST:PORT of the c10d rendezvous, reachable from every node (nnodes > 1)."
    )
    rdzv_id: str = Field(default="dflash", description="Rendezvous id, the same on every node.")
    features: Literal["auto", "offline", "online"] = Field(
        default="auto",
        description="offline: train on hidden_states shards; online: the frozen target computes each batch's features from "
        "tokenized_sequences (nothing stored); auto: online when the hidden-state storage plan does not fit.",
    )
    seed: int = 0
    # the drafter's shape (dflash.model.DRAFT_SHAPE_FIELDS); None = the target's. hidden_size is always the target's.
    num_attention_heads: int | None = Field(
        default=None, ge=1, description="Draft attention query heads (default: the target's)."
    )
    num_key_value_heads: int | None = Field(
        default=None,
        ge=1,
        description="Draft attention KV heads, dividing num_attention_heads (default: the target's).",
    )
    head_dim: int | None = Field(
        default=None, ge=2, description="Draft attention head size, even (RoPE) (default: the target's)."
    )
    intermediate_size: int | None = Field(
        default=None, ge=1, description="Override the drafter MLP width (default: the target's)."
    )
    layer_types: list[str] | None = Field(
        default=None,
        description="Attention of each draft layer: full_attention (non-causal) or sliding_attention (causal, sliding_window "
        "tokens); None = all full. Exported in config.json as SGLang reads it.",
    )
    sliding_window: int | None = Field(
        default=None, ge=1, description="Window of sliding_attention layers (tokens, the query included)."
    )
    warm_start: bool = Field(
        default=False,
        description="When the training data changed: continue from the last export (dflash_drafter/export) on the new "
        "data instead of training from scratch.",
    )


def complete_shards(
    storage: StorageResource, keys: list[str], indexes: dict | None = None
) -> tuple[list[str], list[str], list[str]]:
    """``(shard paths, partitions used, partitions without a complete index)`` from local hidden-state dirs
    (for S3 storage, the index and any shard missing or of another size locally are downloaded first).
    ``indexes``, when given, receives ``{partition key: index.json content}`` of the partitions used."""
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
        if indexes is not None:
            indexes[pk] = index
        try:
            shards += fetch_shards(storage, pk, index)[0]  # S3: downloaded, checked by size and sha256
        except ShardIntegrityError as exc:
            raise dg.Failure(str(exc)) from exc
    return shards, used, skipped


STATE_FILE = "state.json"  # dflash_drafter/state.json in local scratch: the run the export came from


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# settings that leave the trained weights unchanged: the process layout (the same global batch per step) and the
# feature source (online features equal offline ones; the data fingerprint says which source was used)
RESULT_NEUTRAL = {"nproc", "nnodes", "rdzv_endpoint", "rdzv_id", "features"}


# settings added after runs were recorded: left out of the fingerprint while unset, so a run made before they
# existed keeps its id (its drafter had the target's shape, which is what unset means)
ADDED_LATER = {"num_attention_heads", "num_key_value_heads", "head_dim"}


def config_fingerprint(config: dg.Config) -> str:
    """SHA-256 (16 hex) of the settings that shape the result (:data:`RESULT_NEUTRAL` excluded, and
    :data:`ADDED_LATER` ones while None)."""
    values = config.model_dump(exclude=RESULT_NEUTRAL)
    for key in ADDED_LATER:
        if values.get(key) is None:
            values.pop(key, None)
    return _sha(values)[:16]


def config_changed_since_last(instance: dg.DagsterInstance, key: str, config: dg.Config) -> bool:
    """Whether ``config`` differs from the settings recorded (``config_fingerprint``) by the last
    materialization of asset ``key`` (False when there is none or it recorded none)."""
    event = instance.get_latest_materialization_event(dg.AssetKey(key))
    recorded = (
        event.asset_materialization.metadata.get("config_fingerprint")
        if event and event.asset_materialization
        else None
    )
    return recorded is not None and recorded.value != config_fingerprint(config)


def data_fingerprint(indexes: dict[str, dict]) -> str:
    """SHA-256 (16 hex) of the training data by content: every used partition's hidden-state ``index.json``
    (per-shard ``rows_sha256`` of row ids, tokens and loss masks; target layers; model; dtype)."""
    return _sha(sorted(indexes.items()))[:16]


def file_sha256(path: str) -> str | None:
    """Hex SHA-256 of a file, None when it does not exist."""
    if not os.path.exists(path):
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def choose_run(state: dict | None, data_fp: str, config_fp: str, warm_start: bool, export_sha: str | None) -> dict:
    """Which training run the data and config call for.

    The run id is ``sha256(data fingerprint, config fingerprint, parent)`` where ``parent`` is the export
    a warm start continues from (None from scratch). When ``state`` (the run the last export came from, or
    the run under way) has the same data and config, its id is kept: the run resumes at its last checkpoint
    or, if complete, is reused. Otherwise a new run starts: from scratch, or with ``warm_start`` from the
    current export (``export_sha``, SHA-256 of its model.safetensors) when there is one.

    Returns:
        ``{"run_id", "data", "config", "parent": export sha256 or None, "complete", "export_sha256"}``.
    """
    if state and state.get("data") == data_fp and state.get("config") == config_fp:
        return dict(state)
    parent = export_sha if warm_start and export_sha else None
    return {
        "run_id": _sha([data_fp, config_fp, parent])[:12],
        "data": data_fp,
        "config": config_fp,
        "parent": parent,
        "complete": False,
        "export_sha256": None,
    }


def outcome_of(summary: dict, reused: bool) -> tuple[str, str]:
    """``(outcome, sentence)`` for metadata and the summary: trained / resumed / reused."""
    steps, start, tokens = summary["step"], summary.get("resumed_from_step", 0), summary["train_tokens"]
    if reused or (start and start >= steps):
        return "reused", f"reused because nothing changed ({steps} steps on {tokens} tokens)"
    if start:
        return "resumed", f"resumed at step {start} of the same run, trained to step {steps} on {tokens} tokens"
    return "trained", f"trained {steps} steps on {tokens} tokens"


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


def draft_overrides(config: DrafterConfig) -> dict:
    """The drafter-shape settings given (:data:`~dflash_assets.dflash.model.DRAFT_SHAPE_FIELDS`, None = the target's)."""
    values = {k: getattr(config, k) for k in DRAFT_SHAPE_FIELDS if getattr(config, k) is not None}
    if "layer_types" in values:
        values["layer_types"] = list(values["layer_types"])
    return values


def resolved_settings(config: DrafterConfig, target_model: TargetModelResource) -> tuple[list[int], dict]:
    """``(target_layer_ids, draft overrides)`` of a run, checked against the target's config.json (no model loaded).

    ``target_layer_ids`` are ``ops.hidden_states.config.target_layer_ids`` resolved once
    (:func:`~dflash_assets.dflash.target_layers.resolve_target_layer_ids`) for offline and online training
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
        shards=shards,
        out_dir=out_dir,
        features=mode,
        tokenized=tokenized,
        target_dtype=target_model.dtype,
        target_model_path=str(model_path),
        num_hidden_layers=config.num_hidden_layers,
        num_context_features=len(layer_ids),
        target_layer_ids=layer_ids,
        block_size=config.block_size,
        mask_token_id=config.mask_token_id,
        draft_overrides=overrides,
        max_length=config.max_length,
        max_anchors=config.max_anchors,
        eval_fraction=config.eval_fraction,
        batch_size=config.batch_size,
        lr=config.lr,
        epochs=config.epochs,
        max_steps=config.max_steps,
        seed=config.seed,
        checkpoint_every=config.checkpoint_every,
        device=target_model.device,
        init_from=init_from,
    )


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
        "`dflash_drafter/runs/<run id>/` (a rerun resumes); exports dflash_drafter/export/ (config.json with "
        "architectures [DFlashDraftModel], block_size, dflash_config; model.safetensors) for SGLang/vLLM."
    ),
)
def dflash_drafter(
    context: dg.AssetExecutionContext,
    config: DrafterConfig,
    storage: StorageResource,
    target_model: TargetModelResource,
) -> dg.MaterializeResult:
    keys = context.instance.get_dynamic_partitions(prompt_ranges.name)
    if config.nproc > 1 or config.nnodes > 1:
        from dflash_assets.dflash.distributed import torchrun_argv

        try:  # a bad process layout is a config error even when the run would be reused
            torchrun_argv(
                [],
                nproc_per_node=config.nproc,
                nnodes=config.nnodes,
                rdzv_endpoint=config.rdzv_endpoint,
                rdzv_id=config.rdzv_id,
            )
        except ValueError as exc:
            raise dg.Failure(str(exc)) from exc
    try:  # settings checked against the target before any work
        layer_ids, _ = resolved_settings(config, target_model)
    except ValueError as exc:
        raise dg.Failure(str(exc)) from exc
    mode, mode_reason = decide_mode(context.instance, storage, target_model, config.features)
    indexes: dict[str, dict] = {}
    shards, used, skipped = complete_shards(storage, keys, indexes) if mode == "offline" else ([], [], [])
    if mode == "offline" and not shards and config.features == "auto":
        mode, mode_reason = "online", mode_reason + "; no complete hidden_states partition: online"
    context.log.info(mode_reason)
    tokenized = []
    if mode == "online":
        tokenized, used = tokenized_inputs(storage, keys)
        if not tokenized:
            raise dg.Failure(
                f"features: online, but no tokenized_sequences partition among {len(keys)}: materialize it first"
            )
        # online, the training data is the tokenized rows: identified by their files' content
        indexes = {
            pk: {"features": "online", "tokenized_sha256": file_sha256(path)} for pk, path in zip(used, tokenized)
        }
        if layer_ids != default_target_layer_ids(num_target_layers(target_model.resolved_path()), 5):
            # online, the layers are not in the data: a change of them is a change of the training data (the
            # default ones are left out, so runs recorded before the layers were configurable keep their id)
            indexes = {pk: dict(index, target_layer_ids=layer_ids) for pk, index in indexes.items()}
    elif not shards:
        raise dg.Failure(
            f"no complete hidden_states partition among {len(keys)}: materialize hidden_states first "
            "(or set ops.dflash_drafter.config.features: online)"
        )
    if skipped:
        context.log.warning(
            f"training without {len(skipped)} partitions that have no complete hidden states: {skipped[:5]}"
        )
    export_dir = os.path.dirname(storage.local_scratch(*EXPORT_DIR, "x"))
    export_weights = os.path.join(export_dir, "model.safetensors")
    state_path = storage.local_scratch(DRAFTER_DIR, STATE_FILE)
    state = json.load(open(state_path)) if os.path.exists(state_path) else None
    data_fp, config_fp = data_fingerprint(indexes), config_fingerprint(config)
    export_sha = file_sha256(export_weights)
    run = choose_run(state, data_fp, config_fp, config.warm_start, export_sha)
    fingerprint = run["run_id"]
    run_dir = os.path.dirname(storage.local_scratch(DRAFTER_DIR, "runs", fingerprint, "x"))
    reused = bool(
        run["complete"]
        and export_sha
        and export_sha == run.get("export_sha256")
        and os.path.exists(os.path.join(run_dir, "summary.json"))
    )
    if not reused:
        atomic_write_bytes(state_path, json.dumps(dict(run, complete=False), indent=1).encode())
    # a warm run not yet checkpointed starts from its parent export (still in place until this run exports)
    init_from = export_dir if run["parent"] and export_sha == run["parent"] else None
    try:
        cfg = train_config_for(
            config, target_model, mode=mode, shards=shards, tokenized=tokenized, out_dir=run_dir, init_from=init_from
        )
    except ValueError as exc:
        raise dg.Failure(str(exc)) from exc
    started = time.monotonic()
    what = (
        f"{len(shards)} shards"
        if mode == "offline"
        else "tokenized rows, features computed online by the frozen target"
    )
    if reused:
        context.log.info(f"run {fingerprint} is complete and its export is in place: reused, no training step")
        summary = json.load(open(os.path.join(run_dir, "summary.json")))
    elif config.nproc == 1 and config.nnodes == 1:
        start_note = f"warm start from the export {run['parent'][:12]}" if run["parent"] else "from scratch"
        context.log.info(f"training on {what} from {len(used)} partitions ({start_note}); run dir {run_dir}")

        def progress(rec: dict) -> None:
            if rec["step"] % 20 == 0 or rec["step"] == rec["total_steps"]:
                eta = (rec["total_steps"] - rec["step"]) * rec["elapsed_s"] / max(rec["step"], 1)
                context.log.info(
                    f"step {rec['step']}/{rec['total_steps']} loss {rec['loss']:.3f} {rec['tokens_per_s']:.0f} tok/s ETA {eta:.0f}s"
                )

        result = train(cfg, progress_callback=progress)
        export_drafter(result.model, export_dir)
        summary = result.summary
    else:
        context.log.info(
            f"training on {what} from {len(used)} partitions with {config.nproc} processes x "
            f"{config.nnodes} node(s); run dir {run_dir}"
        )
        _run_torchrun(context, cfg, config, export_dir)
        summary = json.load(open(os.path.join(run_dir, "summary.json")))
    if not reused and not summary.get("stopped_early"):
        atomic_write_bytes(
            state_path,
            json.dumps(dict(run, complete=True, export_sha256=file_sha256(export_weights)), indent=1).encode(),
        )
    outcome, outcome_text = outcome_of(summary, reused)
    context.log.info(f"drafter {outcome_text} (run {fingerprint})")
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
            "outcome": outcome,
            "outcome_text": outcome_text,
            "run_id": fingerprint,
            "resumed_from_step": summary.get("resumed_from_step", 0),
            "steps_this_run": 0 if reused else summary["step"] - summary.get("resumed_from_step", 0),
            "warm_start_from": run["parent"],
            "data_fingerprint": data_fp,
            "config_fingerprint": config_fp,
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
            "target_kernels": summary.get("target_kernels") or "",
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
        data_version=dg.DataVersion(
            hashlib.sha256(weights).hexdigest()[:20]
        ),  # same weights, same version: evaluation reuses
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
        json.dump(
            {
                k: v
                for k, v in dataclasses.asdict(cfg).items()
                if k not in ("shards", "tokenized", "out_dir", "target_model_path")
            },
            f,
        )
    train_args = [
        "--shards",
        *cfg.shards,
        "--tokenized",
        *cfg.tokenized,
        "--features",
        cfg.features,
        "--out",
        cfg.out_dir,
        "--target-model",
        cfg.target_model_path,
        "--export",
        export_dir,
        "--config-json",
        cfg_path,
    ]
    try:
        argv = torchrun_argv(
            train_args,
            nproc_per_node=config.nproc,
            nnodes=config.nnodes,
            rdzv_endpoint=config.rdzv_endpoint,
            rdzv_id=config.rdzv_id,
        )
    except ValueError as exc:
        raise dg.Failure(str(exc)) from exc
    if config.nnodes > 1:
        script = write_node_script(
            os.path.join(cfg.out_dir, "launch_other_nodes.sh"),
            argv,
            {"PYTHONPATH": os.environ.get("PYTHONPATH", "")} if os.environ.get("PYTHONPATH") else None,
        )
        context.log.info(
            f"waiting for {config.nnodes - 1} more node(s) at {config.rdzv_endpoint}: on each, run {script} "
            "(same paths on a shared filesystem)"
        )
    context.log.info("launching " + " ".join(argv[:9]) + " ...")
    tail: list[str] = []

    def on_line(line: str) -> None:
        tail[:] = (tail + [line])[-40:]
        if "step" in line or "error" in line.lower():
            context.log.info(line)

    # its own process group, stopped whole when the step is interrupted or fails (workers included)
    code = run_streaming(argv, on_line)
    if code != 0:
        raise dg.Failure(f"torchrun exited with {code}", metadata={"log_tail": "\n".join(tail)})
