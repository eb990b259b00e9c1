"""Would SGLang load this export as a DFlash drafter? The loader's rules, checked before any server starts.

One place for the rules, shared by ``drafter_evaluation``'s engine mode (which refuses before it spends
GPU time) and the GPU-node simulator (:mod:`dflash_simulators.sglang_dflash`, which refuses at
start-up as SGLang would). Stdlib only: the simulator imports it without torch.

Read from SGLang 0.5.23's source (the PyPI wheel; its ``_version.py`` records no commit):

* ``models/dflash.py`` ``DFlashDraftModel``: the class is chosen by ``config.json`` ``architectures``;
  parameters ``layers.{i}.self_attn.{qkv_proj,o_proj,q_norm,k_norm}``, ``layers.{i}.mlp.{gate_up_proj,
  down_proj}``, ``layers.{i}.{input,post_attention}_layernorm``, ``norm``, ``fc`` (``K * hidden ->
  hidden``), ``hidden_norm``; ``load_weights`` maps ``q/k/v_proj`` onto ``qkv_proj`` and
  ``gate/up_proj`` onto ``gate_up_proj``, strips a ``model.`` prefix, **skips every other name
  silently** ("Ignore unexpected weights") and checks neither that every parameter was loaded nor any
  shape but ``fc.weight``'s (the default weight loader asserts equal sizes). Domino projector tensors
  (``prefix_gru.`` / ``embed_proj.``) without ``projector_type: domino`` are refused.
* ``speculative/dflash_utils.py``: ``layer_types`` (one per draft layer, ``full_attention`` /
  ``sliding_attention``), ``sliding_window`` required when a layer slides, ``dflash_config.{
  target_layer_ids, mask_token, mask_token_id, block_size, num_target_layers}`` and their checks;
  ``DFlashMLP``: ``hidden_act`` silu (or swigluoai), ``intermediate_size > 0``; ``DFlashAttention``:
  heads divisible by ``--tp-size``.
* ``speculative/dflash_worker_v2.py``: ``mask_token_id`` must lie below the *target's* vocab size and
  agree with the target tokenizer's id of ``mask_token`` (default ``<|MASK|>``) when it has one.
* ``model_runner_components/spec_aux_hidden_state.py``: ``target_layer_ids`` within the target's
  ``num_hidden_layers`` (a different ``num_target_layers`` is only a warning there); the target's features
  enter ``fc``, so the draft's ``hidden_size`` must be the target's (else a runtime shape error).
* ``arg_groups/speculative_hook.py`` ``_handle_dflash``: ``--speculative-draft-window-size`` at least
  the number of draft tokens; a ``--speculative-num-draft-tokens`` other than the block size is a warning.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any

from dflash_assets.dflash.export.files import safetensors_header, tokenizer_vocabulary

SGLANG_SOURCE = "SGLang 0.5.23 (PyPI wheel)"
DRAFT_ARCHITECTURE = "DFlashDraftModel"
DEFAULT_MASK_TOKEN = "<|MASK|>"  # dflash_utils.DEFAULT_DFLASH_MASK_TOKEN
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "swigluoai")
DOMINO_PREFIXES = ("prefix_gru.", "embed_proj.")
_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class ExportRefused(ValueError):
    """SGLang would refuse the export (or load it wrongly without saying so); the message lists every reason."""


@dataclass
class ExportCheck:
    """What :func:`check_dflash_export` found.

    Attributes:
        refusals: one line per rule broken: the field or tensor, what SGLang does with it, the fix.
        warnings: what SGLang accepts but logs (e.g. a block size other than the draft tokens).
        tensors: tensor name -> shape, from the safetensors header (no weight is read).
    """

    refusals: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    tensors: dict[str, list[int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.refusals

    def raise_if_refused(self, where: str) -> None:
        """Raise :class:`ExportRefused` naming ``where`` (the export directory) and every reason."""
        if self.refusals:
            lines = "\n".join(f"  - {r}" for r in self.refusals)
            raise ExportRefused(f"{where}: SGLang would not load this DFlash drafter ({SGLANG_SOURCE}):\n{lines}")


def text_config(config: dict) -> dict:
    """The decoder's config: ``text_config`` of a multimodal wrapper (Qwen3.6), else the config itself."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def is_hybrid_target(target_config: dict) -> bool:
    """Whether the target has linear-attention (recurrent-state) layers: ``layer_types`` holds
    ``linear_attention`` (Qwen3.5/3.6) or ``mamba``. SGLang needs a mamba radix-cache strategy for them."""
    types = text_config(target_config).get("layer_types") or []
    return any(t in ("linear_attention", "mamba") for t in types)


def json_int(value: Any) -> int | None:
    """``value`` as an ``int`` when it is an integer of JSON (a bool is not), else None."""
    return int(value) if isinstance(value, Integral) and not isinstance(value, bool) else None


def expected_parameters(config: dict) -> dict[str, list[int]]:
    """SGLang's ``DFlashDraftModel`` parameters for ``config`` and their shapes (unfused names as a checkpoint
    writes them: ``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``). Assumes the sizes are valid ints."""
    h, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or h // heads)
    inter = int(config["intermediate_size"])
    dfc = config.get("dflash_config") or {}
    k = len(dfc.get("target_layer_ids") or config.get("target_layer_ids") or []) or layers
    bias = bool(config.get("attention_bias", False))
    out: dict[str, list[int]] = {"norm.weight": [h], "hidden_norm.weight": [h], "fc.weight": [h, k * h]}
    for i in range(layers):
        p = f"layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": [h],
                p + "post_attention_layernorm.weight": [h],
                p + "self_attn.q_proj.weight": [heads * hd, h],
                p + "self_attn.k_proj.weight": [kv * hd, h],
                p + "self_attn.v_proj.weight": [kv * hd, h],
                p + "self_attn.o_proj.weight": [h, heads * hd],
                p + "self_attn.q_norm.weight": [hd],
                p + "self_attn.k_norm.weight": [hd],
                p + "mlp.gate_proj.weight": [inter, h],
                p + "mlp.up_proj.weight": [inter, h],
                p + "mlp.down_proj.weight": [h, inter],
            }
        )
        if bias:
            out.update(
                {
                    p + "self_attn.q_proj.bias": [heads * hd],
                    p + "self_attn.k_proj.bias": [kv * hd],
                    p + "self_attn.v_proj.bias": [kv * hd],
                    p + "self_attn.o_proj.bias": [h],
                }
            )
    return out


def _fused(expected: dict[str, list[int]]) -> dict[str, list[str]]:
    """SGLang's fused parameter name -> the unfused names it covers (``...qkv_proj.weight`` -> q/k/v)."""
    fused: dict[str, list[str]] = {}
    for name in expected:
        for part, (target, _) in _STACKED.items():
            if f".{part}." in name:
                fused.setdefault(name.replace(part, target), []).append(name)
    return fused


def _check_config(config: dict, check: ExportCheck) -> bool:
    """Config rules; returns whether the sizes are valid enough to derive the expected tensors."""
    refuse = check.refusals.append
    arch = config.get("architectures")
    if not isinstance(arch, list) or not arch or arch[0] != DRAFT_ARCHITECTURE:
        refuse(
            f"config.json architectures = {arch!r}: SGLang picks the draft model class by architectures[0], and "
            f'this export is a {DRAFT_ARCHITECTURE}; fix: set architectures: ["{DRAFT_ARCHITECTURE}"] '
            "(dflash.export.directory.hf_config_dict writes it)"
        )
    sizes_ok = _check_sizes(config, refuse)
    act = config.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        refuse(
            f"config.json hidden_act = {act!r}: SGLang's DFlashMLP supports {list(ACTIVATIONS)} only; fix: train with "
            "silu"
        )
    _check_layer_types(config, refuse)
    heads, kv = json_int(config.get("num_attention_heads")), json_int(config.get("num_key_value_heads"))
    if sizes_ok and heads and kv and heads % kv:
        refuse(
            f"config.json num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}; fix: a head count "
            "that the KV heads divide"
        )
    return _check_dflash_config(config, refuse) and sizes_ok


def _check_sizes(config: dict, refuse) -> bool:
    """The draft layers' sizes are positive integers; returns whether they all are."""
    sizes_ok = True
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if json_int(config.get(key)) is None or int(config[key]) < 1:
            refuse(
                f"config.json {key} = {config.get(key)!r}: SGLang's DFlash layers need a positive integer; fix: export "
                "the drafter's DFlashConfig again"
            )
            sizes_ok = False
    for key in ("num_key_value_heads", "head_dim"):
        if config.get(key) is not None and (json_int(config[key]) is None or int(config[key]) < 1):
            refuse(
                f"config.json {key} = {config[key]!r}: must be a positive integer; fix: export the drafter's "
                "DFlashConfig again"
            )
            sizes_ok = False
    return sizes_ok


def _check_layer_types(config: dict, refuse) -> None:
    """``layer_types``: a list of the attention types SGLang's draft supports, one per layer, with a sliding
    window when any layer slides."""
    layers = json_int(config.get("num_hidden_layers")) or 0
    types = config.get("layer_types")
    if types is not None:
        if isinstance(types, str) or not isinstance(types, list):
            refuse(
                f"config.json layer_types = {types!r}: SGLang wants a list of attention type strings; fix: one per "
                "draft layer"
            )
        else:
            if len(types) < layers:
                refuse(
                    f"config.json layer_types has {len(types)} entries for num_hidden_layers {layers}: SGLang raises "
                    "'layer_types must contain one entry per draft layer'; fix: one entry per layer"
                )
            bad = sorted({str(t) for t in types} - set(LAYER_TYPES))
            if bad:
                refuse(
                    f"config.json layer_types {bad}: SGLang's DFlash draft supports {list(LAYER_TYPES)} only; fix: "
                    "train with those layer types"
                )
            if "sliding_attention" in types:
                window = config.get("sliding_window")
                if window is None:
                    refuse(
                        "config.json sliding_window is missing while layer_types has sliding_attention layers: SGLang "
                        "raises 'DFLASH sliding_attention layers require config.sliding_window'; fix: export "
                        "sliding_window (tokens a query sees, itself included)"
                    )
                elif json_int(window) is None or int(window) < 1:
                    refuse(
                        f"config.json sliding_window = {window!r}: must be a positive integer; fix: tokens a query "
                        "sees, itself included"
                    )


def _check_dflash_config(config: dict, refuse) -> bool:
    """``dflash_config``: the target layers and mask token the drafter trained with, its block size, no Domino
    projector; returns whether the target layer ids are valid."""
    layers_ok = True
    dfc = config.get("dflash_config")
    if dfc is not None and not isinstance(dfc, dict):
        refuse(f"config.json dflash_config = {dfc!r}: must be a mapping; fix: export the drafter again")
        dfc = {}
    dfc = dfc or {}
    ids = dfc.get("target_layer_ids", config.get("target_layer_ids"))
    if ids is None:
        refuse(
            "config.json dflash_config.target_layer_ids is missing: SGLang would pick its default layers, not the ones "
            "this drafter trained on; fix: export dflash_config.target_layer_ids"
        )
    elif not isinstance(ids, list) or not ids or any(json_int(i) is None or int(i) < 0 for i in ids):
        refuse(
            f"config.json dflash_config.target_layer_ids = {ids!r}: SGLang wants a non-empty list of non-negative "
            "ints; fix: export the layers the drafter trained on"
        )
        layers_ok = False
    mask = dfc.get("mask_token_id", config.get("mask_token_id"))
    if mask is None:
        refuse(
            "config.json dflash_config.mask_token_id is missing: SGLang would look mask_token up in the target "
            "tokenizer (or add it), not use the id the drafter trained with; fix: export dflash_config.mask_token_id"
        )
    elif json_int(mask) is None or int(mask) < 0:
        refuse(
            f"config.json dflash_config.mask_token_id = {mask!r}: SGLang wants a non-negative integer; fix: export the "
            "drafter's mask_token_id"
        )
    mask_token = dfc.get("mask_token", config.get("mask_token", DEFAULT_MASK_TOKEN))
    if not isinstance(mask_token, str) or not mask_token:
        refuse(
            f"config.json dflash_config.mask_token = {mask_token!r}: SGLang wants a non-empty string; fix: remove it "
            f"(default {DEFAULT_MASK_TOKEN!r}) or name the token"
        )
    block = dfc.get("block_size", config.get("block_size"))
    if block is not None and (json_int(block) is None or int(block) < 1):
        refuse(
            f"config.json block_size = {block!r}: SGLang wants a positive integer; fix: export the drafter's block_size"
        )
    if dfc.get("projector_type") == "domino":
        refuse(
            "config.json dflash_config.projector_type = 'domino': this project's drafter has no Domino projector; fix: "
            "remove projector_type"
        )
    return layers_ok


def _check_tensors(config: dict, tensors: dict[str, list[int]], dtypes: dict[str, str], check: ExportCheck) -> None:
    refuse = check.refusals.append
    expected = expected_parameters(config)
    fused = _fused(expected)
    covered: set[str] = set()
    skipped, wrong = [], []
    for name, shape in sorted(tensors.items()):
        bare = name[len("model.") :] if name.startswith("model.") else name
        if bare.startswith(DOMINO_PREFIXES):
            refuse(
                f"tensor {name}: SGLang refuses Domino projector weights without projector_type: domino; fix: do not "
                "export it"
            )
            continue
        if bare in expected:
            covered.add(bare)
            if list(shape) != expected[bare]:
                wrong.append(f"{name} {list(shape)} (config says {expected[bare]})")
        elif bare in fused:
            parts = fused[bare]
            covered.update(parts)
            want = [sum(expected[p][0] for p in parts), *expected[parts[0]][1:]]
            if list(shape) != want:
                wrong.append(f"{name} {list(shape)} (config says {want})")
        else:
            skipped.append(name)
        if dtypes.get(name) not in ("F32", "BF16", "F16"):
            refuse(
                f"tensor {name} has dtype {dtypes.get(name)}: a DFlash drafter is stored in bf16/fp16/fp32; fix: "
                "export in bfloat16"
            )
    if skipped:
        shown = ", ".join(skipped[:8]) + (f" and {len(skipped) - 8} more" if len(skipped) > 8 else "")
        refuse(
            f"tensors SGLang would skip silently (no DFlashDraftModel parameter of that name): {shown}; fix: export "
            "only layers.*, fc.weight, hidden_norm.weight and norm.weight under SGLang's names (embedding and LM head "
            "are the target's)"
        )
    missing = sorted(set(expected) - covered)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        refuse(
            f"tensors missing: {shown}; SGLang does not check that every parameter was loaded and would run with "
            "uninitialised weights; fix: export the whole drafter"
        )
    if wrong:
        refuse(
            f"tensor shapes that disagree with config.json (SGLang's weight loader raises): {'; '.join(wrong[:6])}; "
            "fix: export config.json and the weights from the same drafter"
        )


def _check_target(config: dict, target: dict, tokenizer_vocab: dict[str, int] | None, check: ExportCheck) -> None:
    refuse, warn = check.refusals.append, check.warnings.append
    tc = text_config(target)
    dfc = config.get("dflash_config") or {}
    vocab = json_int(tc.get("vocab_size", target.get("vocab_size")))
    mask = json_int(dfc.get("mask_token_id", config.get("mask_token_id")))
    if vocab is not None and mask is not None and mask >= vocab:
        refuse(
            f"dflash_config.mask_token_id {mask} >= the target's vocab_size {vocab}: SGLang raises 'mask_token_id is "
            "outside the target vocab size' (it cannot resize the target's embedding); fix: use an id below "
            f"{vocab}, e.g. a special token the model never generates (set the drafter's mask_token_id)"
        )
    mask_token = dfc.get("mask_token", config.get("mask_token", DEFAULT_MASK_TOKEN))
    if tokenizer_vocab is not None and mask is not None and isinstance(mask_token, str):
        known = tokenizer_vocab.get(mask_token)
        if known is not None and int(known) != mask:
            refuse(
                f"dflash_config.mask_token_id {mask} differs from the target tokenizer's id {known} of mask_token "
                f"{mask_token!r}: SGLang raises 'mask_token_id conflicts with tokenizer vocab id'; fix: set "
                f"mask_token_id to {known}, or name the token you use in dflash_config.mask_token"
            )
    layers = json_int(tc.get("num_hidden_layers"))
    ids = dfc.get("target_layer_ids", config.get("target_layer_ids"))
    if layers is not None and isinstance(ids, list):
        out = [i for i in ids if json_int(i) is not None and not 0 <= int(i) < layers]
        if out:
            refuse(
                f"dflash_config.target_layer_ids {out} lie outside the target's {layers} layers: SGLang raises "
                "'target_layer_ids contains an out-of-range layer id'; fix: train on this target's layers"
            )
    trained = json_int(dfc.get("num_target_layers", config.get("num_target_layers")))
    if layers is not None and trained is not None and trained != layers:
        warn(
            f"num_target_layers {trained} differs from the target's num_hidden_layers {layers} (SGLang warns and goes "
            "on)"
        )
    hidden, th = json_int(config.get("hidden_size")), json_int(tc.get("hidden_size"))
    if hidden is not None and th is not None and hidden != th:
        refuse(
            f"config.json hidden_size {hidden} differs from the target's {th}: the target's features enter fc "
            "(K x hidden) and its embedding feeds the draft layers, so SGLang fails at the first forward; fix: "
            "train the drafter at the target's hidden size"
        )


def _check_flags(
    config: dict, check: ExportCheck, *, tp_size: int, num_draft_tokens: int | None, draft_window_size: int | None
) -> None:
    refuse, warn = check.refusals.append, check.warnings.append
    heads, kv = (
        json_int(config.get("num_attention_heads")),
        json_int(config.get("num_key_value_heads")) or json_int(config.get("num_attention_heads")),
    )
    if heads and heads % tp_size:
        refuse(
            f"num_attention_heads {heads} is not divisible by --tp-size {tp_size} (SGLang's DFlashAttention asserts "
            "it); fix: a --tp-size that divides the heads"
        )
    if kv and (kv % tp_size if kv >= tp_size else tp_size % kv):
        refuse(
            f"num_key_value_heads {kv} and --tp-size {tp_size}: one must divide the other (SGLang's DFlashAttention "
            "asserts it); fix: another --tp-size"
        )
    dfc = config.get("dflash_config") or {}
    block = json_int(dfc.get("block_size", config.get("block_size")))
    if num_draft_tokens is not None:
        if num_draft_tokens < 1:
            refuse(f"--speculative-num-draft-tokens {num_draft_tokens} must be positive; fix: the drafter's block size")
        elif block is not None and num_draft_tokens != block:
            warn(
                f"--speculative-num-draft-tokens {num_draft_tokens} differs from the drafter's block_size {block}: "
                "SGLang warns and verifies blocks of the flag's size, not the ones the drafter trained on"
            )
    tokens = num_draft_tokens if num_draft_tokens is not None else (block or 16)
    if draft_window_size is not None and draft_window_size < tokens:
        refuse(
            f"--speculative-draft-window-size {draft_window_size} < the {tokens} draft tokens: SGLang raises; fix: a "
            "window of at least the block size"
        )


def read_export_config(export_dir: Path, check: ExportCheck) -> dict | None:
    """``export_dir/config.json`` as a dict, or None with the reason added to ``check.refusals``."""
    try:
        config = json.loads((export_dir / "config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        check.refusals.append(f"config.json unreadable ({type(exc).__name__}: {exc}); fix: export the drafter again")
        return None
    return config


def check_dflash_export(
    export_dir: str | os.PathLike,
    *,
    target_dir: str | os.PathLike | None = None,
    tp_size: int = 1,
    num_draft_tokens: int | None = None,
    draft_window_size: int | None = None,
) -> ExportCheck:
    """Check an exported drafter directory the way SGLang's DFLASH loader would take it (module docstring).

    Reads ``export_dir/config.json``, the header of ``export_dir/model.safetensors`` (no weights), and, when
    ``target_dir`` is given, its ``config.json`` (``text_config`` of a wrapper: vocab, layers, hidden size) and
    its ``tokenizer.json`` vocabulary (for the mask token). Never raises on a bad export: every problem is a
    line in ``refusals``; call :meth:`ExportCheck.raise_if_refused`.

    Args:
        export_dir: the drafter directory passed as ``--speculative-draft-model-path``.
        target_dir: the target model directory (``--model-path``); None skips the target's rules.
        tp_size: ``--tp-size``; num_draft_tokens: ``--speculative-num-draft-tokens`` (None: the block size);
        draft_window_size: ``--speculative-draft-window-size`` (None: not set).
    """
    check = ExportCheck()
    d = Path(export_dir)
    config = read_export_config(d, check)
    if config is None:
        return check
    sizes_ok = _check_config(config, check)
    try:
        header = safetensors_header(d / "model.safetensors")
    except (OSError, ValueError) as exc:
        check.refusals.append(
            f"model.safetensors unreadable ({type(exc).__name__}: {exc}); fix: export the drafter again"
        )
        header = None
    if header is not None:
        entries = {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
        check.tensors = {k: list(v.get("shape") or []) for k, v in entries.items()}
        if sizes_ok:
            _check_tensors(config, check.tensors, {k: str(v.get("dtype")) for k, v in entries.items()}, check)
    if target_dir is not None:
        try:
            target = json.loads((Path(target_dir) / "config.json").read_text())
        except (OSError, ValueError) as exc:
            check.refusals.append(
                f"target config {Path(target_dir) / 'config.json'} unreadable ({type(exc).__name__}: {exc}): "
                "SGLang could not load the target either; fix: point the model path at the target's directory"
            )
        else:
            _check_target(config, target, tokenizer_vocabulary(target_dir), check)
    _check_flags(config, check, tp_size=tp_size, num_draft_tokens=num_draft_tokens, draft_window_size=draft_window_size)
    return check


__all__ = [
    "ExportCheck",
    "ExportRefused",
    "check_dflash_export",
    "expected_parameters",
    "is_hybrid_target",
    "text_config",
]
