"""GPU check, step ``vllm-hybrid``: the engine parity check on the user's architecture, in the CUDA vLLM.

vLLM's CPU build cannot load the Qwen3.6 stand-in (its Qwen3.5/3.6 classes import torchvision; docs/evaluation.md,
"The target's architecture"), so the parity check on Gated DeltaNet targets runs here: the main job on the
stand-in (``configs/local_qwen36_hybrid.yaml``, reduced), the target on the GPU in float32, the drafter trained and
exported, then ``drafter_evaluation`` with ``engine: vllm`` from an interpreter that already has the CUDA vLLM
(``--vllm-python``; the GPU machine has no network, so nothing is installed). Prints the in-process and engine
taus per dataset, the ``engine_parity`` and ``lossless`` checks, HEADLINE lines and one JSON line.

Skipped (exit 0, saying why) when no interpreter with vLLM is found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from headline import headline

from dflash_assets.common.config import BUNDLED


def find_vllm_python(given: str | None) -> tuple[str | None, str]:
    """An interpreter that imports vLLM: ``given``, else ``$DFLASH_VLLM_PYTHON``, else this one.

    Returns ``(path or None, what was tried)``."""
    tried = []
    for candidate in (given, os.environ.get("DFLASH_VLLM_PYTHON"), sys.executable):
        if not candidate:
            continue
        tried.append(candidate)
        try:
            ok = subprocess.run([candidate, "-c", "import vllm"], capture_output=True, timeout=300).returncode == 0
        except (OSError, subprocess.TimeoutExpired):  # not an interpreter here, or one that hangs: try the next
            ok = False
        if ok:
            return candidate, ", ".join(tried)
    return None, ", ".join(tried)


def hybrid_config(out: Path, vllm_python: str, device: str) -> Path:
    """The bundled hybrid config, reduced to ~5 minutes, with the target on ``device`` and ``engine: vllm``."""
    config = yaml.safe_load((BUNDLED / "local_qwen36_hybrid.yaml").read_text())
    ops, resources = config["ops"], config["resources"]
    resources["target_model"]["device"] = device  # float32 (the bundled dtype): no bf16 tie passes for a rollback
    ops["prompt_corpus"]["config"].update(max_prompts=48)
    ops["dflash_drafter"]["config"].update(max_steps=300)
    ops["drafter_evaluation"]["config"].update(
        engine="vllm",
        engine_python=vllm_python,
        vllm_remove_packages=[],
        engine_memory_fraction=0.3 if device.startswith("cuda") else None,
    )
    path = out / "hybrid_vllm.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run(vllm_python: str | None, device: str, timeout_s: float) -> dict:
    """Run the reduced hybrid main job with ``engine: vllm`` and read its evaluation report.

    Returns a dict: ``skipped`` (why) or ``exit_code``, ``wall_s``, ``datasets`` (the ``engine_parity`` check's
    figures per dataset: in-process and engine tau, lossless, first mismatch), ``checks`` (the report's check
    results), ``log_tail`` when no report was written."""
    python, tried = find_vllm_python(vllm_python)
    if python is None:
        return {"skipped": f"no interpreter imports vllm (tried {tried}); pass --vllm-python or DFLASH_VLLM_PYTHON"}
    with tempfile.TemporaryDirectory(prefix="gpu-check-vllm-") as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "home").mkdir()
        env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "DFLASH_STORAGE_ROOT": str(tmp_path / "data")}
        started = time.perf_counter()
        command = [
            sys.executable,
            "-m",
            "dflash_assets",
            "run",
            "--config",
            str(hybrid_config(tmp_path, python, device)),
        ]
        try:
            proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            output = (exc.stdout or b"") + (exc.stderr or b"")
            output = output.decode(errors="replace") if isinstance(output, bytes) else output
            return {"exit_code": "timeout", "wall_s": round(timeout_s), "log_tail": output[-3000:]}
        result: dict = {"exit_code": proc.returncode, "wall_s": round(time.perf_counter() - started, 1)}
        report_path = tmp_path / "data" / "drafter_evaluation" / "report.json"
        if not report_path.exists():
            result["log_tail"] = (proc.stdout + proc.stderr)[-3000:]
            return result
        report = json.loads(report_path.read_text())
    checks = report.get("checks") or {}
    result["engine_label"] = (report.get("engine") or {}).get("label")
    result["datasets"] = ((checks.get("engine_parity") or {}).get("by_dataset")) or {}
    result["checks"] = report.get("checks")
    return result


def print_result(r: dict, gpu: str) -> bool:
    """Print the step's figures and HEADLINE lines; True when it passed (or was skipped)."""
    if "skipped" in r:
        print(f"  vllm-hybrid: skipped: {r['skipped']}")
        return True
    print(f"  vllm-hybrid: main job on the Qwen3.6 stand-in, exit {r['exit_code']} after {r['wall_s']} s")
    if "log_tail" in r:
        print(r["log_tail"])
        return False
    for name, d in r["datasets"].items():
        print(
            f"    {name}: in-process tau {d.get('in_process_tau')}, vLLM tau {d.get('engine_tau')} "
            f"({r['engine_label']}), lossless {d.get('lossless')}, first mismatch {d.get('first_mismatch')}"
        )
    checks = r.get("checks") or {}
    passed = {name: bool((c or {}).get("passed")) for name, c in checks.items()}
    for name, ok in passed.items():
        print(f"    check {name}: {'passed' if ok else 'FAILED'}")
    ok = r["exit_code"] == 0 and bool(passed) and all(passed.values())
    headline(f"{gpu}, Qwen3.6 stand-in in vLLM: engine_parity and lossless", "yes" if ok else "no", "yes", ok)
    return ok
