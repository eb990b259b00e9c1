"""Which training run the data and the settings call for: fingerprints, the run id and its outcome."""

import hashlib
import json
import os

STATE_FILE = "state.json"  # dflash_drafter/state.json in local scratch: the run the export came from


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# settings that leave the trained weights unchanged: the process layout (the same global batch per step) and the
# feature source (online features equal offline ones; the data fingerprint says which source was used)
RESULT_NEUTRAL = {"nproc", "nnodes", "rdzv_endpoint", "rdzv_id", "features"}


# settings added after runs were recorded: left out of the fingerprint while unset, so a run made before they
# existed keeps its id (its drafter had the target's shape, which is what unset means)
ADDED_LATER = {"num_attention_heads", "num_key_value_heads", "head_dim"}
# likewise, settings added later whose unset value is not None: left out while they hold it
ADDED_LATER_DEFAULTS = {"init_from_target": False, "distill_weight": 0.0, "loss_positions": "generated"}


def config_fingerprint(config) -> str:
    """SHA-256 (16 hex) of the settings that shape the result (:data:`RESULT_NEUTRAL` excluded, and
    :data:`ADDED_LATER` ones while None, :data:`ADDED_LATER_DEFAULTS` ones while at that default)."""
    values = config.model_dump(exclude=RESULT_NEUTRAL)
    for key in ADDED_LATER:
        if values.get(key) is None:
            values.pop(key, None)
    for key, default in ADDED_LATER_DEFAULTS.items():
        if key in values and values[key] == default:
            values.pop(key)
    return _sha(values)[:16]


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
