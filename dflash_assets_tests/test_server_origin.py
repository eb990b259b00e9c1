"""What rows record of the servers, and a seed's fate in external mode (issue 49, items 1 and 5).

Each server here is a real socket answering what SGLang's ``/server_info`` or vLLM's ``/version`` answer (the
fields named in ``generation/servers/origin.py``, read from their code); the facts the project records, the run it
refuses and the summary's words are checked against them.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from dflash_assets.app.summary_lines import ids_source_text
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.engines.local_model import ensure_local_model
from dflash_assets.generation.servers.origin import seed_refusal, server_facts, server_origin, template_sha256
from dflash_assets.generation.servers.pool import ServerPool
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets_tests.engine_bodies import TOJSON_TEMPLATE
from dflash_simulators.behaviours import Raw
from dflash_simulators.stand_in_server import FakeServer


def serving(info: dict) -> FakeServer:
    return FakeServer(Raw(200, json.dumps(info).encode()))


def test_each_engine_says_its_version_and_whether_it_samples_with_the_seed():
    with serving({"version": "0.5.23", "enable_deterministic_inference": False}) as plain:
        assert server_facts("sglang", plain.url) == {"engine_version": "sglang 0.5.23", "seed_honoured": "no"}
    with serving({"version": "0.5.23", "enable_deterministic_inference": True}) as seeded:
        assert server_facts("sglang", seeded.url + "/v1")["seed_honoured"] == "yes"
    with serving({"version": "0.32.0"}) as vllm:
        assert server_facts("vllm", vllm.url) == {"engine_version": "vllm 0.32.0", "seed_honoured": "yes"}
    with serving({"object": "list"}) as openai:  # an OpenAI-compatible server that says nothing of either
        assert server_facts("openai", openai.url) == {"engine_version": "unknown", "seed_honoured": "unknown"}
    with FakeServer(Raw(404, b"no such route")) as silent:
        assert server_facts("sglang", silent.url) == {"engine_version": "unknown", "seed_honoured": "unknown"}


def test_the_template_hash_is_the_file_the_servers_render_with_else_the_models_own():
    model = ensure_local_model()
    assert template_sha256(TOJSON_TEMPLATE, model) == hashlib.sha256(TOJSON_TEMPLATE.read_bytes()).hexdigest()
    own = (model / "chat_template.jinja").read_bytes()
    assert template_sha256(None, model) == hashlib.sha256(own).hexdigest()
    assert template_sha256(None, None) == "unknown"


def test_an_external_sglang_that_drops_the_seed_is_refused_and_one_that_says_nothing_is_stated_unknowable():
    seeded = GenerationSettings(seed=3)
    with serving({"version": "0.5.23", "enable_deterministic_inference": False}) as server:
        inference = InferenceServerResource(
            mode="external", external={"base_urls": [server.url], "served_model_name": "m", "backend": "sglang"}
        )
        pool = ServerPool([server.url], "m", None, 4, "sglang")
        with pytest.raises(RuntimeError, match=r"without --enable-deterministic-inference.*remove"):
            inference.stamped(pool, None, seeded)
        stamped = inference.stamped(pool, None, GenerationSettings())  # no seed: nothing to refuse
        assert stamped.origin == {
            "engine": "sglang",
            "engine_version": "sglang 0.5.23",
            "seed_honoured": "no",
            "template_sha256": "unknown",  # someone else's servers: their template is theirs
        }
    with serving({}) as server:
        origin = server_origin("openai", [server.url])
        assert origin["seed_honoured"] == "unknown" and seed_refusal(origin, 3) is None  # used, and said so:
    line = ids_source_text({"tokenized_by_ids_source": {"rendered": 4}, "seed_honoured": ["unknown"]})
    assert line.startswith("; ids: rendered 4; seed: unknowable: the servers do not say whether they sample with it")
