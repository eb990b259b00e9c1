"""The steps of one drafter training run: its data, its run directory and state, training (in this process
or with torchrun) and publishing the export. The ``dflash_drafter`` asset calls them in order."""

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dflash_assets.common.progress import StageProgressBar
from dflash_assets.dflash.export.directory import export_drafter
from dflash_assets.dflash.target.layers import default_target_layer_ids, num_target_layers
from dflash_assets.dflash.training.config import TrainConfig
from dflash_assets.dflash.training.train import train
from dflash_assets.stages.drafter.identity import STATE_FILE, choose_run, data_fingerprint, file_sha256
from dflash_assets.stages.drafter.launcher import TrainingRunError, run_torchrun
from dflash_assets.stages.stored_inputs import complete_shards, tokenized_inputs
from dflash_assets.storage.atomic import atomic_write_bytes

DRAFTER_DIR = "dflash_drafter"
EXPORT_DIR = (DRAFTER_DIR, "export")


@dataclass
class TrainingData:
    """What a run trains on: ``mode`` (offline | online) and why, the shard or tokenized parquet paths, the
    partitions used and skipped, and ``indexes`` (partition key -> what identifies its data)."""

    mode: str
    reason: str
    shards: list[str]
    tokenized: list[str]
    used: list[str]
    skipped: list[str]
    indexes: dict[str, dict]
    held: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return (
            f"{len(self.shards)} shards"
            if self.mode == "offline"
            else "tokenized rows, features computed online by the frozen target"
        )


def gather_training_data(
    storage,
    target_model,
    keys: list[str],
    mode: str,
    mode_reason: str,
    features: str,
    layer_ids: list[int],
    log,
    held_for: Callable[[str], Mapping[str, str]] | None = None,
) -> TrainingData:
    """The training data of partitions ``keys`` for feature source ``mode`` (decided from the setting
    ``features``): offline, complete hidden-state shards (``auto`` falls back to online without any);
    online, tokenized rows identified by their files' content (and the target layers when not the default).
    ``held_for(mode)``: ``{pk: why}`` of the partitions a blocking check holds for that mode
    (:func:`~dflash_assets.orchestration.check_gate.held_partitions`); they are never trained on (warned, and
    in ``held``), however the run was launched.

    Raises:
        TrainingRunError: no data for the mode, saying what to materialize.
        ShardIntegrityError: a stored shard fails verification.
    """
    indexes: dict[str, dict] = {}
    held = dict(held_for(mode)) if held_for is not None else {}
    shards, used, skipped = (
        complete_shards(storage, [k for k in keys if k not in held], indexes) if mode == "offline" else ([], [], [])
    )
    if mode == "offline" and not shards and features == "auto":
        mode, mode_reason = "online", mode_reason + "; no complete hidden_states partition: online"
        held = dict(held_for(mode)) if held_for is not None else {}
    log.info(mode_reason)
    if held:
        shown = "; ".join(f"{pk} ({why})" for pk, why in sorted(held.items())[:5])
        log.warning(
            f"training without {len(held)} partitions held by a blocking check: {shown}; materialize that stage "
            "again (it must pass), then the drafter"
        )
    held_note = f" ({len(held)} more held by a blocking check)" if held else ""
    tokenized = []
    if mode == "online":
        tokenized, used = tokenized_inputs(storage, [k for k in keys if k not in held])
        if not tokenized:
            raise TrainingRunError(
                f"features: online, but no tokenized_sequences partition among {len(keys) - len(held)}{held_note}: "
                "materialize it first"
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
        raise TrainingRunError(
            f"no complete hidden_states partition among {len(keys) - len(held)}{held_note}: materialize "
            "hidden_states first (or set ops.dflash_drafter.config.features: online)"
        )
    if skipped:
        log.warning(f"training without {len(skipped)} partitions that have no complete hidden states: {skipped[:5]}")
    return TrainingData(mode, mode_reason, shards, tokenized, used, skipped, indexes, held)


@dataclass
class RunPlan:
    """The run chosen (:func:`~dflash_assets.stages.drafter.identity.choose_run`) and where it lives in local
    scratch."""

    run: dict
    run_dir: str
    export_dir: str
    state_path: str
    data_fp: str
    config_fp: str
    reused: bool
    init_from: str | None

    @property
    def run_id(self) -> str:
        return self.run["run_id"]

    @property
    def export_weights(self) -> str:
        return os.path.join(self.export_dir, "model.safetensors")


def plan_run(storage, indexes: dict[str, dict], config_fp: str, warm_start: bool) -> RunPlan:
    """Choose the run for this data and config; unless it is reused, record it (not complete) in
    ``dflash_drafter/state.json``. A complete run is reused when its export is still in place."""
    export_dir = os.path.dirname(storage.local_scratch(*EXPORT_DIR, "x"))
    export_weights = os.path.join(export_dir, "model.safetensors")
    state_path = storage.local_scratch(DRAFTER_DIR, STATE_FILE)
    state = json.loads(Path(state_path).read_text()) if os.path.exists(state_path) else None
    data_fp = data_fingerprint(indexes)
    export_sha = file_sha256(export_weights)
    run = choose_run(state, data_fp, config_fp, warm_start, export_sha)
    run_dir = os.path.dirname(storage.local_scratch(DRAFTER_DIR, "runs", run["run_id"], "x"))
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
    return RunPlan(run, run_dir, export_dir, state_path, data_fp, config_fp, reused, init_from)


def train_run(plan: RunPlan, cfg: TrainConfig, config, data: TrainingData, log) -> dict:
    """Train (or reuse) the planned run and return its summary: in this process when ``nproc`` and ``nnodes``
    are 1, else with torchrun; the export is written to ``plan.export_dir``. A run that finished is recorded
    complete in the state file.

    Raises:
        TrainingRunError: see :func:`~dflash_assets.stages.drafter.launcher.run_torchrun`.
    """
    what = data.describe()
    if plan.reused:
        log.info(f"run {plan.run_id} is complete and its export is in place: reused, no training step")
        summary = json.loads(Path(plan.run_dir, "summary.json").read_text())
    elif config.nproc == 1 and config.nnodes == 1:
        start_note = f"warm start from the export {plan.run['parent'][:12]}" if plan.run["parent"] else "from scratch"
        log.info(f"training on {what} from {len(data.used)} partitions ({start_note}); run dir {plan.run_dir}")

        bar = StageProgressBar("dflash_drafter training", None, unit="step")

        def progress(rec: dict) -> None:
            loss, tok_s = f"{rec['loss']:.3f}", f"{rec['tokens_per_s']:.0f}"
            bar.update_to(rec["step"], rec["total_steps"], loss=loss, tok_s=tok_s)
            if rec["step"] % 20 == 0 or rec["step"] == rec["total_steps"]:
                eta = (rec["total_steps"] - rec["step"]) * rec["elapsed_s"] / max(rec["step"], 1)
                log.info(
                    f"step {rec['step']}/{rec['total_steps']} loss {rec['loss']:.3f} {rec['tokens_per_s']:.0f} "
                    f"tok/s ETA {eta:.0f}s"
                )

        with bar:
            result = train(cfg, progress_callback=progress)
        export_drafter(result.model, plan.export_dir)
        summary = result.summary
    else:
        log.info(
            f"training on {what} from {len(data.used)} partitions with {config.nproc} processes x "
            f"{config.nnodes} node(s); run dir {plan.run_dir}"
        )
        run_torchrun(log, cfg, config, plan.export_dir)
        summary = json.loads(Path(plan.run_dir, "summary.json").read_text())
    if not plan.reused and not summary.get("stopped_early"):
        atomic_write_bytes(
            plan.state_path,
            json.dumps(
                dict(plan.run, complete=True, export_sha256=file_sha256(plan.export_weights)), indent=1
            ).encode(),
        )
    return summary


def publish_export(store, export_dir: str, png: bytes) -> str:
    """Write the loss curve (when any) and, to remote storage, the export files (streamed); return the path of
    the export's ``model.safetensors`` (GBs at the recipe's size: hash or count it streamed, never read whole)."""
    if png:
        store.write_bytes(png, DRAFTER_DIR, "loss_curve.png")
    if not store.is_local:
        for name in sorted(os.listdir(export_dir)):
            store.upload(os.path.join(export_dir, name), *EXPORT_DIR, name)
    return os.path.join(export_dir, "model.safetensors")
