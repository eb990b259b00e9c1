"""Which kernels a hybrid target's linear-attention layers run: the GPU packages or transformers' reference path.

transformers (5.x, ``integrations/hub_kernels.use_kernel_func_from_hub_with_fallback``) binds each
linear-attention function of a model module when that module is imported: the implementation from
``flash-linear-attention`` (import name ``fla``: ``chunk_gated_delta_rule``,
``fused_recurrent_gated_delta_rule``) and ``causal-conv1d`` (``causal_conv1d_fn``,
``causal_conv1d_update``) when they import, else its own PyTorch code ("correct but much slower", it
warns). Nothing has to be switched on: installing the ``gpu`` extra is enough. This module reads back the
binding actually made, so a run can say which path it used.

Plain torch + transformers; no Dagster.
"""

from __future__ import annotations

import inspect
import sys

from torch import nn

__all__ = ["linear_attention_kernels"]

# transformers' names of the wrapped reference functions -> the kernel name and the package that provides it
_FUNCTIONS = {
    "torch_chunk_gated_delta_rule": ("chunk_gated_delta_rule", "fla"),
    "torch_recurrent_gated_delta_rule": ("fused_recurrent_gated_delta_rule", "fla"),
    "causal_conv1d_fn": ("causal_conv1d_fn", "causal_conv1d"),
    "causal_conv1d_update": ("causal_conv1d_update", "causal_conv1d"),
}


def _bound_package(function) -> str:
    """``fla`` / ``causal_conv1d`` / ``torch`` (the reference path) / ``unknown`` for one wrapped function."""
    try:
        closure = inspect.getclosurevars(function).nonlocals
    except (TypeError, ValueError):
        return "unknown"
    implementation = closure.get("implementation")
    if implementation is None or "is_new_implementation" not in closure:
        return "unknown"
    if not closure["is_new_implementation"]:
        return "torch"
    return (getattr(implementation, "__module__", "") or "unknown").split(".")[0]


def linear_attention_kernels(model: nn.Module) -> dict:
    """The kernels the linear-attention layers of ``model`` run.

    Returns:
        ``{"fast": bool | None, "functions": {kernel name: "fla" | "causal_conv1d" | "torch" | "unknown"},
        "summary": str}``; ``fast`` is True when every function found runs its GPU package, None (and
        ``functions`` empty) for a model without linear-attention layers (Llama, Qwen3).
    """
    modules = {
        type(m).__module__
        for m in model.modules()
        if type(m).__name__.endswith(("GatedDeltaNet", "LinearAttention")) or hasattr(m, "linear_attn")
    }
    functions: dict[str, str] = {}
    for module_name in sorted(modules):
        module = sys.modules.get(module_name)
        for attr, (kernel, _) in _FUNCTIONS.items():
            if module is not None and callable(getattr(module, attr, None)):
                functions[kernel] = _bound_package(getattr(module, attr))
    if not functions:
        return {"fast": None, "functions": {}, "summary": "no linear-attention layers"}
    fast = all(functions[kernel] == package for attr, (kernel, package) in _FUNCTIONS.items() if kernel in functions)
    slow = sorted(k for k, v in functions.items() if v == "torch")
    summary = (
        "linear attention: fast kernels (flash-linear-attention, causal-conv1d)"
        if fast
        else f"linear attention: transformers' reference PyTorch path for {', '.join(slow) or 'some functions'} "
        "(install the gpu extra: flash-linear-attention, causal-conv1d)"
    )
    return {"fast": fast, "functions": functions, "summary": summary}
