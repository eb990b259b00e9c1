"""The servers' chat template decides what every row was conditioned on, so rows record it: a change of
``target_model.chat_template`` makes the rows made under the old one stale (status, the settings sensor, the
completions asset), while rows made with the model's own template keep the fingerprint they had before templates
were recorded.

The asset test runs on the real CPU server (``transformers serve``, greedy) behind a counting proxy: the first
run sends each prompt once, a rerun with the same template sends nothing, an edited template makes the sensor
request the partition and the rerun send each prompt again.
"""

import hashlib
import json
from pathlib import Path

import dagster as dg
import polars as pl

from dflash_assets.assets.completions import completions
from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.rows.records import invalid_reason
from dflash_assets.orchestration import freshness
from dflash_assets.stages.resources.generation import GenerationResource, served_settings
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_simulators.cap_change_scenario import proxied_inference
from dflash_simulators.counting_proxy import CountingProxy

SHIPPED = Path(__file__).resolve().parents[1] / "dflash_assets" / "configs" / "chat_templates" / "smollm2_tools.jinja"
PROMPTS = ["What is 2 + 2?", "Name a colour."]


def test_the_template_joins_the_fingerprint_only_when_one_is_set():
    """No template: the fingerprint of the same settings before templates were recorded (rows made with the
    model's own template stay valid); a template: its SHA-256 (first 16 hex digits) joins it, and another text
    gives another fingerprint. The row's stored settings JSON never carries it."""
    base = GenerationSettings(max_output_tokens=16, temperature=0.0)
    payload = base.model_dump(exclude={"max_output_tokens"})
    before = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    assert base.sampling_fingerprint() == before
    assert base.with_template(None).sampling_fingerprint() == before == base.with_template("").sampling_fingerprint()

    text = SHIPPED.read_text()
    with_a = base.with_template(text)
    assert with_a.chat_template_sha256 == hashlib.sha256(text.encode()).hexdigest()[:16]
    expected = hashlib.sha256(
        json.dumps({**payload, "chat_template_sha256": with_a.chat_template_sha256}, sort_keys=True).encode()
    ).hexdigest()[:16]
    assert with_a.sampling_fingerprint() == expected != before
    assert base.with_template(text + "{# edited #}").sampling_fingerprint() not in (before, expected)
    assert with_a.settings_json == base.settings_json  # what a row stores as its settings: unchanged

    row = {"settings_fingerprint": with_a.sampling_fingerprint(), "finish_reason": "stop", "completion_tokens": 5}
    assert invalid_reason(row, with_a) is None
    assert invalid_reason(row, base) == "sampling or chat template changed"
    assert invalid_reason(row, base.with_template(text + "{# edited #}")) == "sampling or chat template changed"


def test_an_edited_template_makes_the_rows_stale_and_they_are_sent_again(tmp_path, local_server, local_inference):
    from dflash_assets.definitions import defs

    template = tmp_path / "template.jinja"
    template.write_text(SHIPPED.read_text())  # renders plain chats as SmolLM2's own (test_chat_templates)
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    root = tmp_path / "data"
    generation = GenerationResource(max_output_tokens=8, temperature=0.0)
    target_model = TargetModelResource(chat_template=str(template))
    sensor = defs.get_sensor_def("generation_settings_changed")

    with CountingProxy(local_server.base_url) as proxy, dg.instance_for_test() as instance:
        inference = proxied_inference(local_inference, proxy.base_url)
        resources = {
            "storage": StorageResource(root=str(root)),
            "inference": inference,
            "generation": generation,
            "target_model": target_model,
        }
        assert dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources={"storage": resources["storage"]},
            run_config={"ops": {"prompt_corpus": {"config": {"sources": [str(corpus)], "partition_size": 2}}}},
        ).success
        (pk,) = instance.get_dynamic_partitions("prompt_index_ranges")

        def run() -> pl.DataFrame:
            assert dg.materialize([completions], instance=instance, partition_key=pk, resources=resources).success
            return pl.read_parquet(next(root.rglob("completions/**/*.parquet")))

        def tick() -> list[dg.RunRequest]:
            result = sensor(
                dg.build_sensor_context(
                    instance=instance, resources={"generation": generation, "target_model": target_model}
                )
            )
            return [] if isinstance(result, dg.SkipReason) else list(result)

        def sent() -> dict[str, int]:  # requests per prompt (readiness probes left out)
            return {p: proxy.requested[p] for p in PROMPTS}

        first = run()
        assert sent() == {p: 1 for p in PROMPTS}
        settings_a = served_settings(generation, inference, target_model)
        assert set(first["settings_fingerprint"]) == {settings_a.sampling_fingerprint()}
        run()  # same template: every row still valid, nothing sent
        assert sent() == {p: 1 for p in PROMPTS}
        assert tick() == []

        template.write_text(SHIPPED.read_text() + "{# edited #}")
        settings_b = served_settings(generation, inference, target_model)
        assert settings_b.sampling_fingerprint() != settings_a.sampling_fingerprint()
        reasons = freshness.completions_reasons(instance, [pk], settings_b)
        assert reasons == {pk: "sampling or chat template changed"}
        (request,) = tick()
        assert request.tags["dflash/reason"] == "sampling or chat template changed"
        again = run()
        assert sent() == {p: 2 for p in PROMPTS}
        assert set(again["settings_fingerprint"]) == {settings_b.sampling_fingerprint()}
        assert again.height == 2
