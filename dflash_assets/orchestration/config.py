"""The project config file: resources and per-asset run config, one YAML for the UI, the shell and the CLI.

``$DFLASH_CONFIG`` names the file; without it the bundled ``configs/local_demo.yaml`` (the embedded
default) is used. ``resources`` holds the resource fields; ``ops`` is Dagster run config for the
assets, used as the default config of the project's jobs and by ``python -m dflash_assets run``.

Nothing in the file is ignored: an unknown top-level key, resource name, resource field, op name or
op config key is a :class:`ConfigError` naming the key, where it is, the valid keys and the file, and so
is invalid YAML and every value the resource classes or Dagster's config types reject.

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


def _unknown(path: str, where: str, what: str, key: str, valid: Iterable[str]) -> ConfigError:
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
            raise _unknown(path, "top level", "key", str(key), TOP_LEVEL_KEYS)
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
            raise _unknown(str(path), "resources", "resource", str(name), classes)
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


def _check_keys(path: str, where: str, cls: type, fields: Mapping[str, Any]) -> None:
    """Every key of ``fields`` is a field of ``cls`` and no secret; a section (a field whose type is a pydantic
    model, e.g. ``inference.vllm``) given as a mapping is checked the same way, key by key, then its values.

    Raises:
        ConfigError: an unknown key (naming its place, the valid keys and the closest one), a secret, or a value
            the section's class rejects.
    """
    valid = [f for f in cls.model_fields if not f.startswith("_")]
    for key in fields:
        if key not in valid:
            raise _unknown(path, where, "key", str(key), valid)
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


def check_local_model(built: Mapping[str, Any]) -> None:
    """The local server and the target model must be the same local model (the tokenizer, hidden states and
    evaluation would otherwise read another model than the one that wrote the completions).

    Raises:
        ConfigError: ``inference`` serves a local model (``local.model``, or ``vllm.local_model`` without
            ``vllm.model_path``), ``target_model.model_path`` is empty and ``target_model.local_model`` names another
            one; the message names both keys and the file.
    """
    inference, target = built.get("inference"), built.get("target_model")
    if inference is None or target is None or target.model_path:
        return
    served = inference.local_model_name()
    if served is not None and served != target.local_model:
        key = "local.model" if inference.mode == "local" else "vllm.local_model"
        raise ConfigError(
            f"{config_path()}: resources.inference.{key} is {served!r} but "
            f"resources.target_model.local_model is {target.local_model!r}: the local server and the target model "
            "must be the same model; set both to one name"
        )


#: The SGLang server flag without which it ignores a request's ``seed`` (SGLang 0.5.23: batch-invariant kernels).
SGLANG_DETERMINISTIC_FLAG = "--enable-deterministic-inference"


def check_seed(built: Mapping[str, Any]) -> None:
    """A configured ``generation.seed`` must take effect: SGLang drops a request's ``seed`` unless its servers
    run with ``--enable-deterministic-inference`` (issue 38), and every row would record a seed no sampling used.

    Raises:
        ConfigError: ``inference.mode`` is ``sglang``, ``generation.seed`` is set and
            ``inference.sglang.extra_args`` lacks the flag; the message names both keys, the file and the fix.
    """
    inference, generation = built.get("inference"), built.get("generation")
    if inference is None or generation is None or generation.seed is None or inference.mode != "sglang":
        return
    if SGLANG_DETERMINISTIC_FLAG in inference.sglang.extra_args:
        return
    raise ConfigError(
        f"{config_path()}: resources.generation.seed is {generation.seed} but SGLang ignores a request's seed unless "
        f"its servers run with {SGLANG_DETERMINISTIC_FLAG}, so no row would be sampled with it: add "
        f"{SGLANG_DETERMINISTIC_FLAG} to resources.inference.sglang.extra_args (its cost: PyTorch's sampler, another "
        "attention backend and, except with --attention-backend fa3/fa4/triton, no radix cache, so continuations and "
        "conversation turns lose prefix reuse: docs/configuration.md), or remove resources.generation.seed"
    )


def validate_ops(assets_defs: Iterable[Any]) -> None:
    """Check the ``ops`` section against the project's assets and their config schemas.

    Raises:
        ConfigError: an op name that is no asset, a key other than ``config`` in an op's section, or
            config Dagster's config type for that asset rejects (unknown key, wrong type); the
            message names the file and ``ops.<asset>.config``.
    """
    # checks one op's config against its config field, as a run would; dagster exports only whole-job validation
    from dagster._config import validate_config

    path = config_path()
    schemas = {}
    for assets_def in assets_defs:
        field = assets_def.op.config_field
        for key in assets_def.keys:
            schemas[key.to_user_string()] = field
    for name, section in project_config()["ops"].items():
        if name not in schemas:
            raise _unknown(str(path), "ops", "op", str(name), schemas)
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: ops.{name}: must be a mapping with key 'config', got {type(section).__name__}")
        for key in section:
            if key != "config":
                raise _unknown(str(path), f"ops.{name}", "key", str(key), ["config"])
        field = schemas[name]
        config = section.get("config")
        if field is None:
            if config:
                raise ConfigError(f"{path}: ops.{name}.config: this asset takes no config; remove the section")
            continue
        result = validate_config(field.config_type, config if config is not None else {})
        if not result.success:
            messages = "; ".join(e.message for e in result.errors)
            raise ConfigError(f"{path}: ops.{name}.config: {messages}")


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
