"""The Qwen3.6-architecture CPU stand-in (:mod:`dflash_assets.generation.engines.hybrid_standin`): what it is made of,
that it is made the same way every time, and that its replies have the shape the pipeline must handle.

Fast: the stand-in is built once into the cache (~5 s) and a few short generations run on it. The whole main
job on it is ``test_hybrid_standin_main_job.py``.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch

from dflash_assets.generation.engines.hybrid_standin import ensure_hybrid_standin, training_texts, write_hybrid_standin


@pytest.fixture(scope="module")
def standin():
    return ensure_hybrid_standin()


@pytest.fixture(scope="module")
def tokenizer(standin):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(standin)


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_config_is_qwen36_architecture_scaled_down(standin, tokenizer):
    from dflash_assets.dflash.target.layers import num_target_layers, resolve_target_layer_ids

    config = json.loads((standin / "config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["model_type"] == "qwen3_5"
    assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25 and text["rope_parameters"]["rope_theta"] == 1e7
    # the 27B's 24 query / 4 KV heads and 16 key / 48 value linear heads: the same ratios
    assert text["num_attention_heads"] == 6 * text["num_key_value_heads"]
    assert text["linear_num_value_heads"] == 3 * text["linear_num_key_heads"]
    # padding rows past the tokenizer, as the 27B's 248,320 rows past ~248,077 tokens
    assert len(tokenizer) < text["vocab_size"] and text["vocab_size"] % 64 == 0
    assert config["image_token_id"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert num_target_layers(standin) == 8 and resolve_target_layer_ids(standin) == [1, 2, 3, 4, 5]
    from safetensors import safe_open

    with safe_open(str(standin / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.language_model.layers.0.linear_attn.A_log" in keys  # the wrapper's decoder, Gated DeltaNet
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in keys and "lm_head.weight" in keys
    assert any(k.startswith("model.visual.") for k in keys)
    generation = json.loads((standin / "generation_config.json").read_text())
    assert generation["do_sample"] is True and generation["top_k"] == 20
    eos = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert set(generation["eos_token_id"]) == eos


def test_tokenizer_has_the_qwen36_thinking_template(standin, tokenizer):
    from transformers import AutoProcessor

    messages = [{"role": "user", "content": "Add two numbers."}]
    on = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    off = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert on == "<|im_start|>user\nAdd two numbers.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tokenizer.encode("<think>\nGiven x.\n</think>\n\nReturn y", add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("</think>") in ids
    assert "</think>" in tokenizer.decode(ids, skip_special_tokens=True)  # not special: kept in decoded text
    # what `transformers serve` loads as the processor: the tokenizer alone (no torchvision needed)
    assert type(AutoProcessor.from_pretrained(standin)).__name__ == "Qwen3_5Tokenizer"


def test_built_the_same_from_the_seed(standin, tmp_path):
    fresh = write_hybrid_standin(tmp_path / "fresh")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert sha(fresh / name) == sha(standin / name), f"{name}: bump STANDIN_NAME when the construction changes"


def test_sampled_replies_think_answer_and_stop(standin, tokenizer):
    """Sampled with the model's own generation config (temperature 0.6, top_p 0.95, top_k 20): replies read
    ``{thinking}.\\n</think>\\n\\n{answer}<|im_end|>`` and their text re-tokenizes to the ids emitted."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(standin, dtype=torch.float32).eval()
    close, end = tokenizer.convert_tokens_to_ids("</think>"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    before, after = (tokenizer.encode(t, add_special_tokens=False) for t in (".\n", "\n\n"))
    finished = 0
    for k, prompt in enumerate(training_texts()[:6]):
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        torch.manual_seed(k)
        reply = model.generate(ids, max_new_tokens=192)[0, ids.shape[1] :].tolist()
        assert max(reply) < len(tokenizer)  # never a padding row
        if reply[-1] != end:
            continue
        finished += 1
        assert reply.count(close) == 1 and reply.count(end) == 1
        at = reply.index(close)
        assert reply[at - 1 : at] == before and reply[at + 1 : at + 2] == after and at >= 2 and len(reply) - at >= 4
        body = reply[:-1]
        assert tokenizer.encode(tokenizer.decode(body), add_special_tokens=False) == body
    assert finished >= 4


def test_served_without_continuous_batching_and_sampling_sent_per_request(standin, tmp_path):
    from dflash_assets.common.settings import GenerationSettings
    from dflash_assets.generation.servers.transformers_server import (
        LocalTransformersServer,
        continuous_batching_refusal,
    )

    assert "linear_attention" in continuous_batching_refusal(standin)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    assert continuous_batching_refusal(tmp_path) is None
    server = LocalTransformersServer(standin, port=1234, settings=GenerationSettings(temperature=0.7, top_k=5))
    argv = server.argv()
    assert "--continuous-batching" not in argv and not any(a.startswith("--cb-") for a in argv)
    body = server.pool().adapt_body({"model": "m", "messages": [], "temperature": 0.7, "top_k": 5})
    sent = json.loads(body["generation_config"])
    assert sent["do_sample"] is True and sent["temperature"] == 0.7 and sent["top_k"] == 5 and "top_k" not in body
    assert "--continuous-batching" in LocalTransformersServer(tmp_path, port=1234).argv()


def test_local_server_and_target_model_must_name_the_same_model(tmp_path, monkeypatch):
    from dflash_assets.common.config import ConfigError
    from dflash_assets.stages.config_schema import check_local_model
    from dflash_assets.stages.resources.inference import InferenceServerResource
    from dflash_assets.stages.resources.target_model import TargetModelResource

    config = tmp_path / "c.yaml"
    config.write_text("resources: {}\n")
    monkeypatch.setenv("DFLASH_CONFIG", str(config))
    inference = InferenceServerResource(mode="local", local_model="qwen3.6-hybrid-standin")
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "resources.inference.local.model is 'qwen3.6-hybrid-standin' but "
            "resources.target_model.local_model is 'smollm2-135m-instruct'"
        ),
    ):
        check_local_model({"inference": inference, "target_model": TargetModelResource()})
    same = TargetModelResource(local_model="qwen3.6-hybrid-standin")
    check_local_model({"inference": inference, "target_model": same})
    check_local_model({"inference": inference, "target_model": TargetModelResource(model_path=str(tmp_path))})
