"""The project config file's root schema: every key the file may hold, in one place. Each name is given with the
type that declares its keys, their defaults and their descriptions (docs/configuration.md lists them all):

    resources:                   RESOURCE_CLASSES: resource name -> its resource class
      storage                      StorageResource
      inference                    InferenceServerResource (sections local, sglang, vllm, external, client)
      generation                   GenerationResource
      target_model                 TargetModelResource
      cost                         CostResource
    ops:                         OP_CONFIGS: asset -> the type of its ``ops.<asset>.config`` (None: it takes none)
      prompt_corpus                PromptCorpusConfig
      completions                  CompletionsConfig
      tokenized_sequences          TokenizeConfig
      hidden_states                HiddenStatesConfig
      dflash_drafter               DrafterConfig
      drafter_evaluation           EvaluationConfig
      truncation_report            None

The file itself is read, strictly, by :mod:`dflash_assets.common.config`; here are the checks that need this
schema or more than one section: the ops section against the assets' config types (:func:`validate_ops`), and
the resources against each other (:func:`check_local_model`, :func:`check_seed`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import dagster as dg

from dflash_assets.common.config import ConfigError, check_known_keys, config_path, project_config, unknown_key
from dflash_assets.stages.completions.config import CompletionsConfig
from dflash_assets.stages.drafter.config import DrafterConfig
from dflash_assets.stages.evaluation.config import EvaluationConfig
from dflash_assets.stages.hidden_states import HiddenStatesConfig
from dflash_assets.stages.prompts import PromptCorpusConfig
from dflash_assets.stages.resources.cost import CostResource
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets.stages.tokenized import TokenizeConfig

#: ``resources.<name>``: the class whose fields are the section's keys.
RESOURCE_CLASSES: dict[str, type[dg.ConfigurableResource]] = {
    "storage": StorageResource,
    "inference": InferenceServerResource,
    "generation": GenerationResource,
    "target_model": TargetModelResource,
    "cost": CostResource,
}
#: ``ops.<asset>.config``: the asset's config type, whose fields are its keys; None for an asset that takes none.
OP_CONFIGS: dict[str, type[dg.Config] | None] = {
    "prompt_corpus": PromptCorpusConfig,
    "completions": CompletionsConfig,
    "truncation_report": None,
    "tokenized_sequences": TokenizeConfig,
    "hidden_states": HiddenStatesConfig,
    "dflash_drafter": DrafterConfig,
    "drafter_evaluation": EvaluationConfig,
}


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
        ConfigError: an op name that is no asset, a key other than ``config`` in an op's section, a key its config
            class does not have (naming the closest one and all of them), config Dagster's config type for that
            asset rejects (wrong type), or a value its config class rejects (a bound such as ``partition_size: 0``,
            an enumerated word such as ``truncated: Keep``, which Dagster's types do not check and the step would
            only refuse when it starts, issue 50); the message names the file and ``ops.<asset>.config[.<key>]``.
    """
    # checks one op's config against its config field, as a run would; dagster exports only whole-job validation
    from dagster._config import validate_config

    path = config_path()
    schemas, schemas_class = {}, {}
    for assets_def in assets_defs:
        field = assets_def.op.config_field
        for key in assets_def.keys:
            schemas[key.to_user_string()] = field
            schemas_class[key.to_user_string()] = _config_class(assets_def)
    for name, section in project_config()["ops"].items():
        if name not in schemas:
            raise unknown_key(str(path), "ops", "op", str(name), schemas)
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: ops.{name}: must be a mapping with key 'config', got {type(section).__name__}")
        for key in section:
            if key != "config":
                raise unknown_key(str(path), f"ops.{name}", "key", str(key), ["config"])
        field = schemas[name]
        config = section.get("config")
        if field is None:
            if config:
                raise ConfigError(f"{path}: ops.{name}.config: this asset takes no config; remove the section")
            continue
        cls = schemas_class.get(name)
        if cls is not None and isinstance(config, dict):  # Dagster's own message lists the schema, not the fix
            check_known_keys(str(path), f"ops.{name}.config", cls, config)
        result = validate_config(field.config_type, config if config is not None else {})
        if not result.success:
            messages = "; ".join(e.message for e in result.errors)
            raise ConfigError(f"{path}: ops.{name}.config: {messages}")
        _check_bounds(str(path), name, schemas_class.get(name), config or {})


def _config_class(assets_def: Any) -> type | None:
    """The ``dagster.Config`` class of an asset's ``config`` argument (None when it takes none)."""
    import typing

    function = getattr(getattr(assets_def.op, "compute_fn", None), "decorated_fn", None)
    try:
        hints = typing.get_type_hints(function) if function is not None else {}
    except Exception:  # an annotation that does not resolve: Dagster's own check at run time stays
        return None
    cls = hints.get("config")
    return cls if isinstance(cls, type) and hasattr(cls, "model_fields") else None


def _check_bounds(path: str, name: str, cls: type | None, config: Mapping[str, Any]) -> None:
    """Build ``cls`` from ``config`` as the step will: every pydantic bound and enumerated word is checked now.

    Raises:
        ConfigError: naming ``ops.<name>.config.<key>``, the value's problem and the file.
    """
    from pydantic import ValidationError

    if cls is None:
        return
    try:
        cls(**config)
    except ValidationError as exc:
        problems = []
        for error in exc.errors()[:3]:
            key = ".".join(str(part) for part in error.get("loc", ()))
            value = error.get("input")
            said = f" (got {value!r})" if isinstance(value, (int, float, str)) and len(repr(value)) <= 80 else ""
            problems.append(f"ops.{name}.config.{key}: {error.get('msg')}{said}")
        raise ConfigError(f"{path}: {'; '.join(problems)}") from None
