"""The project config file: resources and per-asset run config, one YAML for the UI, the shell and the CLI.

``$DFLASH_CONFIG`` names the file; without it the bundled ``configs/local_demo.yaml`` (the embedded
default) is used. ``resources`` holds the resource fields; ``ops`` is Dagster run config for the
assets, used as the default config of the project's jobs and by ``python -m dflash_assets run``.
"""

import os
from functools import lru_cache
from pathlib import Path

import yaml

BUNDLED = Path(__file__).parent / "configs"
DEFAULT_CONFIG = BUNDLED / "local_demo.yaml"


def config_path() -> Path:
    """The active config file. Raises FileNotFoundError when ``$DFLASH_CONFIG`` names no file."""
    path = Path(os.environ.get("DFLASH_CONFIG") or DEFAULT_CONFIG)
    if not path.is_file():
        raise FileNotFoundError(f"DFLASH_CONFIG={path}: no such file (see dflash_assets/configs/ for examples)")
    return path


@lru_cache(maxsize=4)
def _load(path: str, mtime: float) -> dict:
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    unknown = set(data) - {"resources", "ops"}
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {sorted(unknown)}; expected 'resources' and 'ops'")
    return data


def project_config() -> dict:
    """``{"resources": {...}, "ops": {...}}`` from the active config file."""
    path = config_path()
    data = _load(str(path), path.stat().st_mtime)
    return {"resources": dict(data.get("resources") or {}), "ops": dict(data.get("ops") or {})}


def resource_fields(name: str) -> dict:
    """The config file's fields for resource ``name`` (empty when absent)."""
    return dict(project_config()["resources"].get(name) or {})


def op_config(*assets: str) -> dict:
    """Dagster run config (``{"ops": {...}}``) for the given assets, from the config file."""
    ops = project_config()["ops"]
    return {"ops": {a: ops[a] for a in assets if a in ops}}
