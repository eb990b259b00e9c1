"""The project config file, read: resources and per-asset run config, one YAML for the UI, the shell and the CLI.
Its root schema, every key it may hold in one place, is :mod:`dflash_assets.stages.config_schema`.

``$DFLASH_CONFIG`` names the file; without it the bundled ``configs/local_demo.yaml`` (the embedded
default) is used. ``resources`` holds the resource fields; ``ops`` is Dagster run config for the
assets, used as the default config of the project's jobs and by ``python -m dflash_assets run``.

Nothing in the file is ignored: an unknown top-level key, resource name, resource field, op name or
op config key is a :class:`ConfigError` naming the key, where it is, the valid keys and the file, and so
is invalid YAML and every value the resource classes or Dagster's config types reject (the ops section is
checked against the assets' config types by :func:`~dflash_assets.stages.config_schema.validate_ops`).

Secrets never come from the file: a resource field marked ``json_schema_extra={SECRET_ENV: "NAME"}``
(the server API key, the S3 credentials) given a value there is a :class:`ConfigError` naming the key
and the environment variable to set instead. Dagster shows every resource value that is not an
``EnvVar`` in the UI and over GraphQL; values from the environment reach it as ``EnvVar`` references.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

BUNDLED = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = BUNDLED / "local_demo.yaml"
TOP_LEVEL_KEYS = ("resources", "ops")
#: Key of a pydantic field's ``json_schema_extra`` naming the environment variable a secret field comes from.
SECRET_ENV = "secret_env"


class ConfigError(ValueError):
    """The config file cannot be used; the message names the file, the key and its place, and the fix."""


def config_path() -> Path:
    """The active config file. Raises FileNotFoundError when ``$DFLASH_CONFIG`` names no file."""
    path = Path(os.environ.get("DFLASH_CONFIG") or DEFAULT_CONFIG)
    if not path.is_file():
        raise FileNotFoundError(f"DFLASH_CONFIG={path}: no such file (see dflash_assets/configs/ for examples)")
    return path


def unknown_key(path: str, where: str, what: str, key: str, valid: Iterable[str]) -> ConfigError:
    """The error for ``key``, a ``what`` (key, resource, op) the file gives at ``where`` that is none of ``valid``:
    naming the file, the place, the closest valid one (did you mean) and all of them."""
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{path}: {where}: unknown {what} {key!r}{hint}; valid {what}s: {', '.join(valid) or 'none'}")


@lru_cache(maxsize=4)
def _load(path: str, mtime: float) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the file must be a mapping with keys {' and '.join(TOP_LEVEL_KEYS)}, got {type(data).__name__}"
        )
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise unknown_key(path, "top level", "key", str(key), TOP_LEVEL_KEYS)
    for section in TOP_LEVEL_KEYS:
        if not isinstance(data.get(section) or {}, dict):
            raise ConfigError(
                f"{path}: {section}: must be a mapping of names to settings, got {type(data[section]).__name__}"
            )
    return data


def project_config() -> dict:
    """``{"resources": {...}, "ops": {...}}`` from the active config file."""
    path = config_path()
    data = _load(str(path), path.stat().st_mtime)
    return {"resources": dict(data.get("resources") or {}), "ops": dict(data.get("ops") or {})}


def resource_fields(name: str) -> dict:
    """The config file's fields for resource ``name`` (empty when absent)."""
    fields = project_config()["resources"].get(name) or {}
    if not isinstance(fields, dict):
        raise ConfigError(
            f"{config_path()}: resources.{name}: must be a mapping of field: value, got {type(fields).__name__}"
        )
    return dict(fields)


def build_resources(
    classes: Mapping[str, type], extra: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """Instantiate each resource from its config section, after checking every name and field.

    Args:
        classes: resource name -> ``dagster.ConfigurableResource`` subclass (the project's resources).
        extra: resource name -> fields that do not come from the file (``EnvVar`` secrets).

    Raises:
        ConfigError: an unknown resource name or field (which Dagster's ConfigurableResource would
            silently accept), a secret field given a value in the file (:func:`secret_env`), a key of an earlier
            release given with its new key, or a value the class rejects; the message names the file and the key.

    A resource class with a ``migrate_config(fields, where)`` classmethod (``inference``) first moves the keys of
    an earlier release to their new place, warning about each (a ``FutureWarning`` naming the new key).
    """
    path = config_path()
    sections = project_config()["resources"]
    for name in sections:
        if name not in classes:
            raise unknown_key(str(path), "resources", "resource", str(name), classes)
    built = {}
    for name, cls in classes.items():
        fields = resource_fields(name)
        if hasattr(cls, "migrate_config"):  # keys of an earlier release moved to their new place, with a warning
            try:
                fields = cls.migrate_config(fields, f"resources.{name}")
            except ValueError as exc:
                raise ConfigError(f"{path}: {exc}") from None
        _check_keys(str(path), f"resources.{name}", cls, fields)
        try:
            built[name] = cls(**fields, **dict((extra or {}).get(name) or {}))
        except Exception as exc:  # pydantic ValidationError, Dagster config errors
            raise ConfigError(f"{path}: resources.{name}: {_first_lines(exc)}") from None
    return built


def check_known_keys(path: str, where: str, cls: type, fields: Mapping[str, Any]) -> None:
    """Every key of ``fields`` is a field of ``cls`` (a pydantic model: a resource or an op's config class).

    Raises:
        ConfigError: the first unknown key, naming the file, its place, the closest field and all of them.
    """
    valid = [f for f in cls.model_fields if not f.startswith("_")]
    for key in fields:
        if key not in valid:
            raise unknown_key(path, where, "key", str(key), valid)


def _check_keys(path: str, where: str, cls: type, fields: Mapping[str, Any]) -> None:
    """Every key of ``fields`` is a field of ``cls`` and no secret; a section (a field whose type is a pydantic
    model, e.g. ``inference.vllm``) given as a mapping is checked the same way, key by key, then its values.

    Raises:
        ConfigError: an unknown key (naming its place, the valid keys and the closest one), a secret, or a value
            the section's class rejects.
    """
    check_known_keys(path, where, cls, fields)
    for key in fields:
        if env := secret_env(cls, key):
            raise ConfigError(
                f"{path}: {where}.{key}: a secret cannot be set in the config file (Dagster would show "
                f"it in the UI and over GraphQL); remove the key and set the environment variable {env} instead"
            )
        section = section_class(cls, key)
        if section is not None and isinstance(fields[key], Mapping):
            _check_keys(path, f"{where}.{key}", section, fields[key])
            try:  # Dagster drops a section's value equal to its default before pydantic sees it (YAML true == 1)
                section(**fields[key])
            except Exception as exc:  # pydantic ValidationError
                raise ConfigError(f"{path}: {where}.{key}: {_first_lines(exc)}") from None


def section_class(cls: type, field: str) -> type | None:
    """The pydantic model class of field ``field`` of ``cls`` when it is a section (a nested config such as
    ``inference.vllm``), else None."""
    from pydantic import BaseModel

    annotation = getattr(getattr(cls, "model_fields", {}).get(field), "annotation", None)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def secret_env(cls: type, field: str) -> str | None:
    """The environment variable secret field ``field`` of resource class ``cls`` comes from, or None
    when the field is no secret (see :data:`SECRET_ENV`)."""
    info = getattr(cls, "model_fields", {}).get(field)
    extra = getattr(info, "json_schema_extra", None)
    return extra.get(SECRET_ENV) if isinstance(extra, dict) else None


def _first_lines(exc: BaseException, n: int = 6) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip() and "errors.pydantic.dev" not in line]
    return " | ".join(line.strip() for line in lines[:n])


def op_config(*assets: str) -> dict:
    """Dagster run config (``{"ops": {...}}``) for the given assets, from the config file."""
    ops = project_config()["ops"]
    return {"ops": {a: ops[a] for a in assets if a in ops}}


def completions_mode() -> str:
    """``ops.completions.config.mode`` of the config file (``regenerate`` when unset)."""
    section = project_config()["ops"].get("completions") or {}
    return (section.get("config") or {}).get("mode") or "regenerate"
