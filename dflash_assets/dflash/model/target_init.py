"""Initialise a DFlash drafter from its target's own last decoder layers instead of at random (plain torch; no
Dagster imports): the ``init_from_target`` training setting.

The drafter's ``n`` layers have the target's hidden size, and with the target's attention shape (the default: the
drafter config's shape keys unset) its layers have the target's tensor shapes. :func:`init_from_target_layers`
copies:

* draft layer ``j`` <- target decoder layer ``L - n + j`` (the last ``n`` of the target's ``L``): attention
  ``q/k/v/o_proj``, MLP ``gate/up/down_proj``, ``input_layernorm`` and ``post_attention_layernorm``, and
  ``q_norm`` / ``k_norm`` when the target has them (Qwen3; a Llama target has none: they stay at ones);
* ``fc`` [H, n_feat*H] <- the identity on the slot of the feature layer ``s``, the deepest of
  ``target_layer_ids`` below the first copied layer, zero elsewhere; ``hidden_norm`` <- the first copied
  layer's ``input_layernorm``. So draft layer 0's context keys/values are ``k/v_proj(input_layernorm(h_s))``:
  with ``s = L - n - 1`` (SmolLM2-135M, 30 layers, features [1, 8, 14, 20, 27], 2 draft layers) exactly what
  target layer 28 attends to over the context (up to the drafter's ``k_norm``);
* ``norm`` <- the target's final norm (the LM head, shared, reads the same normalised stream).

A tensor whose shape differs (a drafter narrower than the target: ``intermediate_size``, heads, ``head_dim``) is
copied in part when the target's is at least as large in every dim: the leading block (``target[:rows, :cols]``),
e.g. the first ``intermediate_size`` MLP channels; otherwise it keeps its random init. A layer of another kind (a
Gated DeltaNet layer of a hybrid target) has no ``self_attn`` tensors: its attention stays random. The report says
what was copied.

Why: initialising the draft head from the target's last layer is what EAGLE's and Medusa-style heads do (EAGLE,
arXiv 2401.15077: the draft decoder layer has the target's layer shape). Here it is an option the learning-curve
bench (``bench/bench_learning_curve.py``) measures, off by default; the DFlash recipe trains from random init.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_assets.dflash.model.draft_model import DFlashDraftModel

__all__ = ["init_from_target_layers", "target_layer_prefix"]

_LAYER_TENSORS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
_PREFIXES = ("model.layers.", "model.language_model.layers.", "language_model.model.layers.", "layers.")


def target_layer_prefix(names: list[str]) -> str:
    """The prefix of the target's decoder layers in its tensor names: ``model.layers.`` (a causal LM),
    ``model.language_model.layers.`` (a multimodal wrapper) and the like; the one whose ``0.input_layernorm.weight``
    exists.

    Raises:
        KeyError: no decoder layer tensors found.
    """
    for prefix in _PREFIXES:
        if f"{prefix}0.input_layernorm.weight" in names:
            return prefix
    raise KeyError("no decoder layers (…layers.0.input_layernorm.weight) in the target's tensors")


def _tensor_names(model_dir: str | Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def _read(model_dir: str | Path, wanted: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict: keys() is its only listing
                if key in wanted:
                    out[key] = f.get_tensor(key)
    return out


def _copy_into(param: torch.Tensor, src: torch.Tensor | None) -> str:
    """Copy ``src`` into ``param`` whole (``"copied"``), its leading block (``"partial"``) or not (``"skipped"``)."""
    if src is None:
        return "skipped"
    src = src.to(dtype=param.dtype, device=param.device)
    if tuple(src.shape) == tuple(param.shape):
        param.copy_(src)
        return "copied"
    if src.dim() == param.dim() and src.dim() in (1, 2) and all(a >= b for a, b in zip(src.shape, param.shape)):
        param.copy_(src[tuple(slice(0, n) for n in param.shape)])
        return "partial"
    return "skipped"


def _feature_slot(model: DFlashDraftModel, first_source: int) -> tuple[int, int]:
    """``(feature layer, its slot in target_layer_ids)``: the deepest feature layer below ``first_source`` (the
    deepest of all when none is below)."""
    ids = list(model.config.target_layer_ids)
    below = [i for i in ids if i < first_source]
    layer = max(below) if below else max(ids)
    return layer, ids.index(layer)


@torch.no_grad()
def init_from_target_layers(model: DFlashDraftModel, target_model_dir: str | Path) -> dict:
    """Overwrite ``model``'s weights with its target's last layers as the module docstring says (in place).

    Args:
        model: the drafter (any dtype / device; the target's tensors are cast to its parameters').
        target_model_dir: the target's HF directory (``*.safetensors``).

    Returns:
        ``{"source_layers": [L-n .. L-1], "feature_layer": s, "feature_slot": k, "copied": [names],
        "partial": [names], "skipped": [names]}`` (drafter parameter names).

    Raises:
        FileNotFoundError: no safetensors in ``target_model_dir``. KeyError: no decoder layers there.
    """
    names = _tensor_names(target_model_dir)
    if not names:
        raise FileNotFoundError(f"no *.safetensors in {target_model_dir}")
    prefix = target_layer_prefix(names)
    final_norm = f"{prefix[: -len('layers.')]}norm.weight"
    n, total = model.config.num_hidden_layers, model.config.num_target_layers
    sources = [total - n + j for j in range(n)]
    wanted = {f"{prefix}{src}.{t}" for src in sources for t in _LAYER_TENSORS} | {final_norm}
    tensors = _read(target_model_dir, wanted)
    own = dict(model.named_parameters())
    report: dict = {"source_layers": sources, "copied": [], "partial": [], "skipped": []}
    plan = [
        (f"layers.{j}.{t}", f"{prefix}{src}.{t}")
        for j, src in enumerate(sources)
        for t in _LAYER_TENSORS
        if f"layers.{j}.{t}" in own
    ]
    plan += [("norm.weight", final_norm), ("hidden_norm.weight", f"{prefix}{sources[0]}.input_layernorm.weight")]
    for dst, src in plan:
        report[_copy_into(own[dst], tensors.get(src))].append(dst)
    layer, slot = _feature_slot(model, sources[0])
    h = model.config.hidden_size
    model.fc.weight.zero_()
    model.fc.weight[:, slot * h : (slot + 1) * h] = torch.eye(h, dtype=model.fc.weight.dtype)
    report["copied"].append("fc.weight")
    report["feature_layer"], report["feature_slot"] = layer, slot
    return report
