"""Shared pytest fixtures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dflash_assets.common.stop_signals import restore_stop_signals

# One torch thread per process: the tests run a model server and the pipeline in separate processes on a
# 2-core machine, and two processes each spinning two OpenMP threads were several times slower (40 greedy
# tokens from SmolLM2 took 28 s with 2 threads against 5 s with 1 while another process was busy). Set
# before any server is spawned, so its processes inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Started in the background of a shell without job control (`nohup pytest &`, some CI runners), the suite inherits
# SIGINT ignored and Dagster copies that to SIGTERM: a test's Ctrl-C or SIGTERM to its child was lost and every
# threaded run's log capture waited 60 s (two false failures and test_status at 125 s instead of 8, 2026-12-07).
restore_stop_signals()

ROOT = Path(__file__).resolve().parents[1]


# The inner loop's subset is `pytest -m "not slow"` (docs/design.md, "Tests"); CI runs everything. These modules
# each took over 10 s in a whole-suite run on the 2-core machine (seconds, --durations=0, one process,
# 2026-12-03): real servers, real engines, a browser, torchrun, training, main jobs. Their tests are marked
# slow as they are collected, and run first, longest first: pytest-xdist (`-n 2 --dist loadfile
# --no-loadscope-reorder` in pyproject) hands out modules in collection order, so the longest module starts at
# once instead of ending the run alone.
SLOW_MODULE_SECONDS = {
    "test_drafter_quality": 650,
    "test_vllm_completions": 280,
    "test_agentic_vllm": 200,
    # vLLM's CPU server start (~1 min), two on-policy runs of 2 BFCL tasks (~10 turns each), one killed, then
    # tokenized + hidden_states (SmolLM2) and 2 drafter steps on the turns: 168 s beside another test module
    "test_on_policy_vllm": 170,
    # the daemon ticking the backfill schedule every minute over two Celery workers, a node killed and back, then the
    # later stages: 231 s on an idle machine, 333 s and 439 s beside a CI run; minute ticks and run processes starting
    "test_cluster_daemon": 440,
    # PostgreSQL, Redis, moto, two Celery workers, one range run on each: 50 s idle, 130 s beside a CI run
    "test_cluster_celery": 135,
    # Redis, PostgreSQL, Celery workers, three two-node torchrun launches (one trains, one fails, one interrupted),
    # then a Dagster run of dflash_drafter over two workers (~32 s of it): 95 s at load 3 on 2 cores
    "test_train_nodes_celery": 130,
    "test_gpu_install": 140,  # pip dry runs against PyPI: 63 s at load 2-4, 140 s at load 11-16
    # issue 50: five on-policy runs through a stand-in server (one waits out a 2 s tool time-out), the sandbox
    "test_on_policy_faults": 75,
    # 40 s (issue 49 added SGLang's chat processing, the router's parser, replies with prompt ids), and ~2 min more
    # where its SGLang environment (sglang and sglang-router wheels, --no-deps) is not made yet
    "test_sglang_contract": 120,
    "test_engine_env": 120,
    "test_server_trust": 73,
    "test_ui": 69,
    "test_backfill_schedule": 68,
    "test_kill_resume": 66,
    # one judge run: vLLM's parser and request models, and its own renderer on every body (issue 49): 30-50 s
    "test_vllm_contract": 50,
    # two completions + tokenized runs on the GPU-node simulator rendering with the SmolLM2 tokenizer: 35 s
    "test_tokens_of_record": 40,
    "test_ui_backfill": 60,
    "test_s3_storage": 58,
    "test_truncation_memory": 52,
    "test_orphan_servers": 51,
    "test_speculative": 49,
    "test_hybrid_standin_main_job": 46,
    "test_corpus_edits": 46,
    "test_cap_change": 43,
    "test_dflash_train": 40,
    "test_distributed_train": 37,
    "test_tokenized": 36,
    "test_completions_asset": 36,
    "test_prompt_length": 35,
    "test_node_scale": 34,
    "test_vllm_hybrid_target": 32,
    # three vLLM servers (DFlash, n-gram, plain) on 5 prompts and a drafter overfit for it: 688 s at load 8-10
    "test_vllm_ngram": 300,
    "test_engine_replay": 20,  # a drafter overfit on a tiny target, then replays: 47 s at load 8
    "test_continuation": 29,
    "test_vllm_rules": 28,
    "test_main_job_failed_check": 26,
    "test_cost": 25,
    "test_automation_ticks": 24,
    "test_truncation_report": 23,
    "test_tail_chunks": 23,
    "test_status_cap_change": 23,
    "test_target_features": 21,
    "test_storage_plan": 21,
    "test_speculative_hybrid": 15,
    "test_shared_store": 14,
    "test_cli_output": 14,
    "test_hidden_states_s3": 13,
    "test_key_redaction_and_failed_partitions": 12,
    "test_engine_evaluation": 12,
    "test_servers": 11,
    "test_summary": 10,
}


def pytest_collection_modifyitems(config, items):
    """Mark every test of a :data:`SLOW_MODULE_SECONDS` module, or one using the shared model server, ``slow``;
    order the modules longest first (a stable sort: tests keep their order within a module)."""
    for item in items:
        shared_server = "local_server" in item.fixturenames or "local_inference" in item.fixturenames
        if _module_name(item) in SLOW_MODULE_SECONDS or shared_server:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: -SLOW_MODULE_SECONDS.get(_module_name(item), 0))


def _module_name(item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1] if item.module else ""


@pytest.fixture(scope="session")
def local_server(tmp_path_factory):
    """ONE ``transformers serve`` over the local SmolLM2 model for the whole session (~20 s to start).

    Greedy decoding (the model's defaults; its continuous batcher keeps them for life), so replies are
    deterministic. Yields a started
    :class:`~dflash_assets.generation.servers.transformers_server.LocalTransformersServer`:
    use ``.base_url``, ``.model_name``, ``.pool()``. The log is ``<tmp>/local_server/transformers_serve.log``.
    """
    from dflash_assets.generation.engines.local_model import ensure_local_model
    from dflash_assets.generation.servers.transformers_server import LocalTransformersServer

    log_path = tmp_path_factory.mktemp("local_server") / "transformers_serve.log"
    with LocalTransformersServer(ensure_local_model(), log_path=log_path, startup_timeout_s=300) as server:
        yield server


@pytest.fixture(scope="session")
def local_inference(local_server):
    """An ``InferenceServerResource`` in external mode pointed at the shared ``local_server`` (greedy)."""
    from dflash_assets.generation.engines.local_model import ensure_local_model
    from dflash_assets.stages.resources.inference import InferenceServerResource

    return InferenceServerResource(
        mode="external",
        external={
            "base_urls": [local_server.base_url],
            "served_model_name": local_server.model_name,
            "backend": "transformers",
            "tokenizer_path": str(ensure_local_model()),
        },
        max_running_requests=8,
    )


@dataclass
class MainJob:
    """The main job of one project: its DAGSTER_HOME (``home``, with the repository's dagster.yaml), storage
    root (``data``), config file and environment."""

    home: Path
    data: Path
    config: Path
    env: dict

    def run(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """``python -m dflash_assets run --config <config>`` once, in a subprocess; its output captured."""
        return subprocess.run(
            [sys.executable, "-m", "dflash_assets", "run", "--config", str(self.config)],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.fixture
def main_job(tmp_path):
    """Make the main job answer ``prompts`` from a stand-in server: the setup of the tests whose partitions
    fail. ``main_job(url, prompts, partition_size=2, inference={...}, resources={...}, env={...})`` writes the
    prompt file and a config whose ``resources.inference`` is the OpenAI-shaped server at ``url`` (external
    mode, 10 s to answer the probe; ``inference`` adds fields, ``resources`` other resources) and returns
    the :class:`MainJob`."""

    def make(url: str, prompts: list[str], *, partition_size=2, inference=None, resources=None, env=None) -> MainJob:
        home, data = tmp_path / "home", tmp_path / "data"
        home.mkdir(exist_ok=True)
        shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
        source = tmp_path / "prompts.jsonl"
        source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        server = {"mode": "external", "base_urls": [url], "served_model_name": "fake", "external_backend": "openai"}
        config = tmp_path / "config.yaml"
        config.write_text(
            json.dumps(
                {
                    "resources": {
                        "inference": {**server, "startup_timeout_s": 10, **(inference or {})},
                        **(resources or {}),
                    },
                    "ops": {"prompt_corpus": {"config": {"sources": [str(source)], "partition_size": partition_size}}},
                }
            )
        )
        job_env = {**os.environ, "DAGSTER_HOME": str(home), "DFLASH_STORAGE_ROOT": str(data), **(env or {})}
        return MainJob(home, data, config, job_env)

    return make
