"""Export a trained drafter as the HF directory SGLang (``--speculative-algorithm DFLASH``) and vLLM load.

Layout (matches z-lab's released DFlash drafters and SGLang's ``models/dflash.py`` loader):

* ``config.json``: Qwen3-style fields (``model_type: "qwen3"``, hidden_size, heads, head_dim,
  intermediate_size, rms_norm_eps, rope_theta / rope_parameters, vocab_size, max_position_embeddings,
  ...) plus ``architectures: ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers``,
  ``num_hidden_layers``, ``layer_types`` (one of ``full_attention`` / ``sliding_attention`` per draft
  layer: SGLang's ``get_dflash_layer_types`` reads it, full layers run non-causal, sliding ones causal
  with ``sliding_window``, which SGLang's ``get_dflash_attention_sliding_window_size`` reads, HF
  convention: the window counts the query) and
  ``dflash_config: {mask_token_id, target_layer_ids, block_size}``. SGLang resolves
  ``dflash_config.target_layer_ids`` first, ``dflash_config.block_size`` before the top-level one,
  and uses ``dflash_config.mask_token_id`` instead of looking up its ``<|MASK|>`` string when given.
* ``model.safetensors``: ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``...q_norm/k_norm.weight``,
  ``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
  ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``; never the embedding or LM head (the target's
  are used at inference).

Replacing an export is atomic from a reader's view: each export is written to a temporary directory
under ``<out>.versions/``, renamed to its version name there, and ``<out>`` is a symlink switched to it by
one ``rename(2)`` of a new link over the old one. ``<out>`` stays a directory path SGLang and
``from_pretrained`` load as before; a reader that resolves it once (:func:`resolve_export`) reads one
version whole even while the next one is switched in. The version the link pointed to before is kept
(a reader may still be on it), older ones are removed. An export that is a plain directory (written
before this layout) is moved under ``<out>.versions/`` first, the one moment ``<out>`` is absent.

Crash safety: the files are fsynced, then their directory, before the version is renamed into place, and
the directories are fsynced after each rename, so after a power loss ``<out>`` points at a whole export
(the new one or the one before), never at empty or partial files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.model.draft_model import DFlashDraftModel
from dflash_assets.storage.atomic import fsync_dir, fsync_file

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
FORBIDDEN_TENSOR_MARKERS = ("embed_tokens", "lm_head", "target_")


def hf_config_dict(config: DFlashConfig, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The ``config.json`` content for ``config`` (see module docstring for the fields' readers)."""
    n = config.num_hidden_layers
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": n,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "rope_scaling": None,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": "sliding_attention" in config.layer_types,
        "sliding_window": config.sliding_window if "sliding_attention" in config.layer_types else None,
        "max_window_layers": n,
        "layer_types": list(config.layer_types),
        "initializer_range": 0.02,
        "dtype": _DTYPE_NAMES[dtype],
        "torch_dtype": _DTYPE_NAMES[dtype],
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
            "block_size": config.block_size,
        },
    }


def config_from_hf_dict(d: dict) -> DFlashConfig:
    """Inverse of :func:`hf_config_dict` (also reads z-lab/SGLang drafter configs).

    Raises:
        ValueError: ``dflash_config.target_layer_ids`` or ``mask_token_id`` missing.
    """
    dfc = d.get("dflash_config") or {}
    layer_ids = dfc.get("target_layer_ids", d.get("target_layer_ids"))
    mask = dfc.get("mask_token_id", d.get("mask_token_id"))
    if layer_ids is None or mask is None:
        raise ValueError("config lacks dflash_config.target_layer_ids / mask_token_id")
    rope = d.get("rope_parameters") or {}
    return DFlashConfig(
        hidden_size=d["hidden_size"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        intermediate_size=d["intermediate_size"],
        vocab_size=d["vocab_size"],
        mask_token_id=int(mask),
        target_layer_ids=list(layer_ids),
        num_target_layers=int(d.get("num_target_layers") or max(layer_ids) + 1),
        num_hidden_layers=d["num_hidden_layers"],
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
        block_size=int(dfc.get("block_size", d.get("block_size", 16))),
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        attention_bias=d.get("attention_bias", False),
        hidden_act=d.get("hidden_act", "silu"),
        layer_types=d.get("layer_types"),
        sliding_window=d.get("sliding_window") if "sliding_attention" in (d.get("layer_types") or []) else None,
    )


def export_drafter(model: DFlashDraftModel, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (tensors cast to ``dtype``) into ``out_dir``.

    Replaces an existing ``out_dir`` atomically for readers (a new version directory, then one rename of
    the ``out_dir`` symlink; see the module docstring).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: a tensor name that must not be exported (embedding / LM head) slipped in.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    module = getattr(model, "module", model)  # unwrap DDP
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in module.trainable_state_dict().items()}
    bad = [k for k in tensors if any(m in k for m in FORBIDDEN_TENSOR_MARKERS)]
    if bad:
        raise ValueError(f"refusing to export target tensors {bad}")
    versions = out.with_name(f"{out.name}.versions")
    versions.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=versions, prefix=".tmp-"))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(module.config, dtype), indent=2) + "\n")
        # on disk before any rename: a crash after the link switch must not leave empty files behind it
        for name in ("model.safetensors", "config.json"):
            fsync_file(tmp / name)
        fsync_dir(tmp)
        version = versions / f"{time.time_ns()}-{os.getpid()}"
        os.replace(tmp, version)
        fsync_dir(versions)
        previous = _switch_link(out, version)
        fsync_dir(out.parent)  # the link switch itself survives a crash
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in versions.iterdir():  # keep this version and the one readers may still be on
        if not old.name.startswith(".tmp-") and old.name not in (version.name, previous):
            shutil.rmtree(old, ignore_errors=True)
    return out


def _switch_link(out: Path, version: Path) -> str | None:
    """Point symlink ``out`` at ``version`` with one rename; returns the version name it pointed to before.
    A plain directory at ``out`` (the layout before versions) is first moved into the versions directory."""
    previous = None
    if out.is_symlink():
        previous = Path(os.readlink(out)).name
    elif out.exists():
        legacy = version.with_name(f"{time.time_ns() - 1}-legacy")
        os.replace(out, legacy)
        previous = legacy.name
    link = out.with_name(f".{out.name}.link-{uuid.uuid4().hex[:8]}")
    os.symlink(os.path.join(version.parent.name, version.name), link)  # relative: the tree can move
    try:
        os.replace(link, out)
    except BaseException:
        link.unlink(missing_ok=True)
        raise
    return previous


def resolve_export(model_dir: str | os.PathLike) -> Path:
    """The version directory an export path points at now: read every file of one export from it, so a
    switch to the next export in between cannot mix the two."""
    return Path(os.path.realpath(model_dir))


def _read_version(d: Path) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """config.json and every tensor of one export version directory ``d``."""
    config = config_from_hf_dict(json.loads((d / "config.json").read_text()))
    state = {}
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open is not a dict: keys() is its only listing
            state[k] = f.get_tensor(k)
    return config, state


def load_exported(
    model_dir: str | os.PathLike,
    *,
    embed_weight: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    overrides: dict | None = None,
) -> DFlashDraftModel:
    """Load an exported drafter directory into :class:`DFlashDraftModel` (parameters in ``dtype``).

    Optionally attaches the target's embedding / LM head. Strict: missing or unexpected tensors raise.
    ``overrides`` replaces :class:`DFlashConfig` fields of the export's config.json (the evaluation decodes the
    drafter with the ``target_layer_ids``, ``block_size`` and ``mask_token_id`` it trained with, so an export
    that wrote other ones shows as an engine that disagrees).

    Raises:
        FileNotFoundError: no config.json / model.safetensors. RuntimeError: tensor names/shapes differ.
    """
    # Two exports after the one a reader resolved, its version is pruned; a reader that loses that race
    # resolves the link again rather than failing (a version directory given directly is read once).
    attempts = 5 if Path(model_dir).is_symlink() else 1
    for attempt in range(attempts):
        d = resolve_export(model_dir)
        try:
            config, state = _read_version(d)
            break
        except FileNotFoundError:
            if attempt == attempts - 1 or d == resolve_export(model_dir):
                raise
    if overrides:
        config = dataclasses.replace(config, **overrides)
    model = DFlashDraftModel(config)
    model.load_state_dict(state, strict=True)
    model.to(dtype)
    if embed_weight is not None:
        model.attach_target(embed_weight.to(dtype), None if lm_head_weight is None else lm_head_weight.to(dtype))
    return model


__all__ = ["config_from_hf_dict", "export_drafter", "hf_config_dict", "load_exported", "resolve_export"]
