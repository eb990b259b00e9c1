"""What vLLM's own kernels compute where a DFlash drafter depends on them, measured in the engine's environment
before its server starts, so that the step replay can compute the drafter the way the engine does.

vLLM 0.32.0 projects a DFlash drafter's context into keys for all its layers at once and normalises them in one
``rms_norm`` call, the per-layer ``k_norm`` weights stacked ``[num_layers, head_dim]``
(``qwen3_dflash.DFlashQwen3Model._normalize_context_k``). Its CPU kernel applies the first row to every layer
(measured here: layer 1's keys come out normalised with layer 0's weight, to float32 rounding), so on a CPU the
engine serves a drafter whose context keys differ from the trained one's wherever the layers' ``k_norm`` weights
differ. It moves the drafter's logits by tenths of a logit and its accepted count on ~1-3% of the verification
steps (issue 48: 80 of 2,542 steps on the main job's drafter, none once replayed as the engine computes it).
The probe runs the op on the device and dtype the server will use; :func:`context_k_norm` names the outcome.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from dflash_assets.storage.atomic import atomic_write_bytes

#: the engine normalises each layer's context keys with that layer's own k_norm weight (the model)
PER_LAYER = "per_layer"
#: the engine normalises every layer's context keys with layer 0's k_norm weight (vLLM 0.32.0's CPU kernel)
LAYER_0 = "layer_0"
UNKNOWN = "unknown"

_PROBE = """
import json, sys, torch
from vllm import _custom_ops as ops
device, dtype = sys.argv[1], getattr(torch, sys.argv[2])
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 5, 3, 64, generator=g).to(device, dtype)
w = (torch.rand(2, 64, generator=g) + 0.5).to(device, dtype)
out = torch.empty_like(x)
ops.rms_norm(out, x, w, 1e-6)
n = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
per_layer = (out.float() - n * w.float()[:, None, None, :]).abs().max().item()
layer_0 = (out.float() - n * w.float()[0]).abs().max().item()
print(json.dumps({"per_layer_error": per_layer, "layer_0_error": layer_0}))
"""


def grouped_rms_norm_probe(python: str | Path, device: str, dtype: str, timeout_s: float = 300.0) -> dict:
    """Run vLLM's ``rms_norm`` op with per-layer weights ``[2, 64]`` on keys ``[2, 5, 3, 64]`` in the engine's
    interpreter ``python``, on ``device`` (``cpu`` or ``cuda``) in ``dtype`` (``float32``, ``bfloat16``, ...).

    Returns:
        ``per_layer_error`` and ``layer_0_error`` (largest absolute difference from each layer normalised with its
        own weight, and with layer 0's), ``context_k_norm`` (:func:`context_k_norm`); when it could not run or
        printed no figures, ``context_k_norm`` :data:`UNKNOWN` and ``error`` (why, with the last line it printed).
    """
    try:
        proc = subprocess.run(
            [str(python), "-c", _PROBE, device, dtype], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"context_k_norm": UNKNOWN, "error": str(exc)[:300]}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"context_k_norm": UNKNOWN, "error": f"exit {proc.returncode}: {tail[:300]}"}
    try:
        figures = json.loads(lines[-1])
        figures = {k: float(figures[k]) for k in ("per_layer_error", "layer_0_error")}
    except (ValueError, TypeError, KeyError):
        return {"context_k_norm": UNKNOWN, "error": f"unreadable output: {lines[-1][:300]}"}
    return {**figures, "context_k_norm": context_k_norm(figures["per_layer_error"], figures["layer_0_error"])}


def cached_probe(python: str | Path, device: str, dtype: str, cache: Path | None) -> dict:
    """:func:`grouped_rms_norm_probe`, its outcome kept in ``cache`` (a directory: the engine environment this project
    made, whose packages never change in place; None: probe every time, an interpreter the user gave may change).
    An outcome of :data:`UNKNOWN` is not kept."""
    path = None if cache is None else Path(cache) / f"dflash_probe_{device}_{dtype}.json"
    if path is not None and path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass  # unreadable: probe again and rewrite it
    result = grouped_rms_norm_probe(python, device, dtype)
    if path is not None and result["context_k_norm"] != UNKNOWN:
        atomic_write_bytes(path, json.dumps(result).encode())
    return result


def context_k_norm(per_layer_error: float, layer_0_error: float) -> str:
    """:data:`PER_LAYER` or :data:`LAYER_0`, whichever reading the op's output matches at least ten times closer
    (and within 0.05, bf16's rounding of values of order 1); :data:`UNKNOWN` otherwise."""
    if per_layer_error <= 0.05 and per_layer_error * 10 <= layer_0_error:
        return PER_LAYER
    if layer_0_error <= 0.05 and layer_0_error * 10 <= per_layer_error:
        return LAYER_0
    return UNKNOWN


__all__ = ["LAYER_0", "PER_LAYER", "UNKNOWN", "cached_probe", "context_k_norm", "grouped_rms_norm_probe"]
