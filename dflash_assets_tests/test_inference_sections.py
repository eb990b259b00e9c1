"""``resources.inference`` in sections per mode (issue 33 item 3): launch settings apart from client settings,
the flat keys of the earlier release still accepted for one release with a warning naming the new key."""

from __future__ import annotations

import warnings

import dagster as dg
import pytest

from dflash_assets.common import config as cfg
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.inference_sections import FLAT_KEYS, ConfigKeyDeprecationWarning

# a value for every flat key of the earlier release, and where it must land
FLAT = {
    "local_model": ("qwen3.6-hybrid-standin", "local", "model"),
    "model_path": ("/models/m", "sglang", "model_path"),
    "num_servers": (3, "sglang", "num_servers"),
    "gpu_ids": ([0, 1, 2], "sglang", "gpu_ids"),
    "port_base": (31000, "sglang", "port_base"),
    "host": ("0.0.0.0", "sglang", "host"),
    "max_mamba_cache_size": (200, "sglang", "max_mamba_cache_size"),
    "mem_fraction_static": (0.85, "sglang", "mem_fraction_static"),
    "context_length": (16384, "sglang", "context_length"),
    "tp_size": (1, "sglang", "tp_size"),
    "reasoning_parser": ("deepseek-r1", "sglang", "reasoning_parser"),
    "use_router": (True, "sglang", "use_router"),
    "extra_args": (["--enable-metrics"], "sglang", "extra_args"),
    "launch_module": ("dflash_simulators.sglang_stub", "sglang", "launch_module"),
    "base_urls": (["http://h:1/v1"], "external", "base_urls"),
    "served_model_name": ("m", "external", "served_model_name"),
    "external_tokenizer_path": ("/tok", "external", "tokenizer_path"),
    "external_backend": ("vllm", "external", "backend"),
    "request_timeout_s": (60.0, "client", "request_timeout_s"),
    "max_reply_mb": (2.0, "client", "max_reply_mb"),
    "max_attempts": (2, "client", "max_attempts"),
    "backoff_base_s": (0.5, "client", "backoff_base_s"),
    "max_consecutive_failures": (7, "client", "max_consecutive_failures"),
    "stall_timeout_s": (120.0, "client", "stall_timeout_s"),
    "continue_truncated": (False, "client", "continue_truncated"),
    "tail_chunk_tokens": (512, "client", "tail_chunk_tokens"),
    "tail_prompts_per_slot": (2.0, "client", "tail_prompts_per_slot"),
}


def test_every_flat_key_of_the_earlier_release_is_covered():
    assert set(FLAT) == set(FLAT_KEYS)


def test_flat_keys_warn_naming_the_new_key_and_land_in_their_section():
    with pytest.warns(ConfigKeyDeprecationWarning) as record:
        r = InferenceServerResource(mode="sglang", **{k: v for k, (v, _, _) in FLAT.items()})
    messages = [str(w.message) for w in record]
    assert len(messages) == len(FLAT)
    for old, (value, section, new) in FLAT.items():
        assert getattr(getattr(r, section), new) == value, old
        assert (
            f"inference.{old} is deprecated and will be removed in the next release; use inference.{section}.{new}"
            in (messages)
        )
    assert issubclass(ConfigKeyDeprecationWarning, FutureWarning)  # shown by default, to the config's author


def test_keys_several_modes_have_go_to_the_configured_modes_section():
    with pytest.warns(ConfigKeyDeprecationWarning, match=r"use inference\.vllm\.num_servers"):
        r = InferenceServerResource(
            mode="vllm", num_servers=2, context_length=4096, local_model="smollm2-135m-instruct"
        )
    assert (r.vllm.num_servers, r.vllm.max_model_len, r.sglang.num_servers) == (2, 4096, 1)
    with pytest.warns(ConfigKeyDeprecationWarning, match=r"use inference\.local\.extra_args"):
        local = InferenceServerResource(extra_args=["--log-level", "debug"])
    assert local.local.extra_args == ["--log-level", "debug"] and local.sglang.extra_args == []


def test_a_flat_key_merges_into_a_section_given_in_part_and_conflicts_with_the_same_key():
    with pytest.warns(ConfigKeyDeprecationWarning):
        r = InferenceServerResource(mode="sglang", num_servers=2, sglang={"model_path": "/m", "tp_size": 2})
    assert (r.sglang.num_servers, r.sglang.tp_size, r.sglang.model_path) == (2, 2, "/m")
    with pytest.raises(ValueError, match=r"inference\.num_servers \(deprecated\) and inference\.sglang\.num_servers"):
        InferenceServerResource(mode="sglang", num_servers=2, sglang={"num_servers": 3})


def test_unknown_keys_stay_errors_at_the_top_and_in_a_section():
    with pytest.raises(ValueError, match="num_serverz"):
        InferenceServerResource(num_serverz=2)
    with pytest.raises(Exception, match="num_serverz"):
        InferenceServerResource(sglang={"num_serverz": 2})
    with pytest.raises(Exception, match="valid integer"):
        InferenceServerResource(sglang={"num_servers": True})  # YAML true is not 1, in a section too


def _file(tmp_path, monkeypatch, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    monkeypatch.setenv("DFLASH_CONFIG", str(path))
    return path


def test_the_config_file_takes_flat_keys_with_a_warning_and_refuses_both_ways(tmp_path, monkeypatch):
    _file(tmp_path, monkeypatch, "resources:\n  inference: {mode: sglang, num_servers: 4, request_timeout_s: 30.0}\n")
    with pytest.warns(ConfigKeyDeprecationWarning) as record:
        built = cfg.build_resources({"inference": InferenceServerResource})
    assert {str(w.message) for w in record} == {
        "resources.inference.num_servers is deprecated and will be removed in the next release; use "
        "resources.inference.sglang.num_servers",
        "resources.inference.request_timeout_s is deprecated and will be removed in the next release; use "
        "resources.inference.client.request_timeout_s",
    }
    assert built["inference"].sglang.num_servers == 4 and built["inference"].client.request_timeout_s == 30.0
    path = _file(tmp_path, monkeypatch, "resources:\n  inference: {num_servers: 4, sglang: {num_servers: 2}}\n")
    with pytest.raises(cfg.ConfigError) as err:
        cfg.build_resources({"inference": InferenceServerResource})
    assert str(err.value).startswith(f"{path}: resources.inference.num_servers (deprecated) and ")
    path = _file(tmp_path, monkeypatch, "resources:\n  inference: {client: {max_atempts: 2}}\n")
    with pytest.raises(cfg.ConfigError) as err:
        cfg.build_resources({"inference": InferenceServerResource})
    assert f"{path}: resources.inference.client: unknown key 'max_atempts' (did you mean 'max_attempts'?)" in str(
        err.value
    )


def test_the_bundled_configs_use_the_sections(monkeypatch):
    from dflash_assets.stages.resources.cost import CostResource
    from dflash_assets.stages.resources.generation import GenerationResource
    from dflash_assets.stages.resources.storage import StorageResource
    from dflash_assets.stages.resources.target_model import TargetModelResource

    classes = {
        "storage": StorageResource,
        "inference": InferenceServerResource,
        "generation": GenerationResource,
        "target_model": TargetModelResource,
        "cost": CostResource,
    }
    for path in sorted(cfg.BUNDLED.glob("*.yaml")):
        monkeypatch.setenv("DFLASH_CONFIG", str(path))
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConfigKeyDeprecationWarning)
            cfg.build_resources(classes)


def test_a_resource_from_flat_keys_runs_in_dagster_with_the_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("DFLASH_SERVER_API_KEY", "k-from-env-123")
    with pytest.warns(ConfigKeyDeprecationWarning):
        inference = InferenceServerResource(
            mode="external",
            base_urls=["http://h:1/v1"],
            served_model_name="m",
            max_attempts=2,
            api_key=dg.EnvVar("DFLASH_SERVER_API_KEY"),
        )

    @dg.asset
    def probe(inference: InferenceServerResource) -> tuple:
        return (inference.external.base_urls, inference.client.max_attempts, inference.api_key)

    defs = dg.Definitions(assets=[probe], resources={"inference": inference})
    dg.Definitions.validate_loadable(defs)
    result = dg.materialize([probe], resources={"inference": inference})
    assert result.output_for_node("probe") == (["http://h:1/v1"], 2, "k-from-env-123")


@pytest.mark.parametrize("mode", ["sglang", "vllm"])
def test_a_port_block_past_65535_is_refused_at_config_time_naming_the_key(tmp_path, monkeypatch, mode):
    # issue 40, suspected item: `port_base: 65535` with two servers was accepted (server 1 on port 65536, no TCP
    # port), found only when the servers start
    template = "resources:\n  inference: {{mode: {mode}, {mode}: {{port_base: {base}, num_servers: 2}}}}\n"
    path = _file(tmp_path, monkeypatch, template.format(mode=mode, base=65535))
    with pytest.raises(cfg.ConfigError) as err:
        cfg.build_resources({"inference": InferenceServerResource})
    text = str(err.value)
    assert text.startswith(f"{path}: resources.inference.{mode}"), text
    assert "port_base 65535 + num_servers 2 - 1 = 65536" in text and "at most 65534" in text, text
    with pytest.raises(Exception, match="port_base"):
        InferenceServerResource(mode=mode, **{mode: {"port_base": 0}})
    # the last port that fits is accepted
    _file(tmp_path, monkeypatch, template.format(mode=mode, base=65534))
    assert getattr(cfg.build_resources({"inference": InferenceServerResource})["inference"], mode).port_base == 65534
