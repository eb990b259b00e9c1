"""Shared pytest fixtures."""

from __future__ import annotations

import os

import pytest
import torch

# One torch thread per process: the tests run a model server and the pipeline in separate processes on a
# 2-core machine, and two processes each spinning two OpenMP threads were several times slower (40 greedy
# tokens from SmolLM2 took 28 s with 2 threads against 5 s with 1 while another process was busy). Set
# before any server is spawned, so its processes inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def local_server(tmp_path_factory):
    """ONE ``transformers serve`` over the local SmolLM2 model for the whole session (~20 s to start).

    Greedy decoding (the model's defaults; its continuous batcher keeps them for life), so replies are
    deterministic. Yields a started :class:`~dflash_assets.generation.transformers_server.LocalTransformersServer`:
    use ``.base_url``, ``.model_name``, ``.pool()``. The log is ``<tmp>/local_server/transformers_serve.log``.
    """
    from dflash_assets.generation.local_model import ensure_local_model
    from dflash_assets.generation.transformers_server import LocalTransformersServer

    log_path = tmp_path_factory.mktemp("local_server") / "transformers_serve.log"
    with LocalTransformersServer(ensure_local_model(), log_path=log_path, startup_timeout_s=300) as server:
        yield server


@pytest.fixture(scope="session")
def local_inference(local_server):
    """An ``InferenceServerResource`` in external mode pointed at the shared ``local_server`` (greedy)."""
    from dflash_assets.generation.local_model import ensure_local_model
    from dflash_assets.resources.inference import InferenceServerResource

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
