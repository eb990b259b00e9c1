"""Agentic tool conversations through every stage on a real server (issue 43, "Done when"): a prompt file of
OpenAI-shape and ShareGPT-shape tool conversations beside a plain prompt goes through ``prompt_corpus`` ->
``completions`` (vLLM's CPU build serving the embedded SmolLM2 model with the shipped tools template) ->
``tokenized_sequences``: none is rejected for tool use, there is one row per assistant turn, every row's context
tokens are exactly the server's ``prompt_token_ids``, and the loss covers the regenerated turn only. The template
writes each tool as ``{{ tool | tojson }}`` (issue 49, item 4): vLLM's own tool dump is in the server's ids, the rows
are those ids and say so, and the project's rendering as vLLM does matches them. A target template that cannot
render tools is refused before any server starts."""

from __future__ import annotations

import hashlib
import json

import dagster as dg
import polars as pl

from dflash_assets.assets.completions import completions
from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.assets.tokenized import tokenized_sequences
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets_tests.engine_bodies import TOJSON_TEMPLATE

CAP = 24
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
OPENAI = {  # three assistant turns: a tool call, the answer after the result, the answer to a follow-up
    "id": "oa-1",
    "tools": [WEATHER],
    "messages": [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": "Is it raining in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "light rain, 12C"},
        {"role": "assistant", "content": "Yes, light rain and 12C."},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "I cannot see tomorrow's forecast."},
    ],
}
SHAREGPT = {  # two assistant turns: a function call, the answer after the observation
    "id": "sg-1",
    "tools": json.dumps([{"name": "add", "description": "Add two numbers.", "parameters": {"type": "object"}}]),
    "conversations": [
        {"from": "human", "value": "What is 2 + 40?"},
        {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 2, "b": 40}})},
        {"from": "observation", "value": "42"},
        {"from": "gpt", "value": "2 + 40 = 42."},
    ],
}
PLAIN = {"prompt": "Write a haiku about tools."}
ASSISTANT_TURNS = 3 + 2 + 1


def write_source(tmp_path):
    source = tmp_path / "agentic.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in (OPENAI, SHAREGPT, PLAIN)))
    return source


def resources(root, chat_template: str) -> dict:
    return {
        "storage": StorageResource(root=str(root)),
        "inference": InferenceServerResource(mode="vllm", max_running_requests=4, vllm={"max_model_len": 2048}),
        "generation": GenerationResource(max_output_tokens=CAP, temperature=0.0),
        "target_model": TargetModelResource(chat_template=chat_template),
    }


def corpus_partition(instance, res, source) -> str:
    result = dg.materialize(
        [prompt_corpus],
        instance=instance,
        resources=res,
        run_config={"ops": {"prompt_corpus": {"config": {"sources": [str(source)], "partition_size": 16}}}},
    )
    assert result.success
    (pk,) = instance.get_dynamic_partitions(prompt_ranges.name)
    return pk


def test_a_template_without_tools_is_refused_before_any_server_starts(tmp_path):
    res = resources(tmp_path / "data", chat_template="")  # SmolLM2's own template: no tools
    with dg.instance_for_test() as instance:
        pk = corpus_partition(instance, res, write_source(tmp_path))
        result = dg.materialize([completions], instance=instance, resources=res, partition_key=pk, raise_on_error=False)
    assert not result.success
    failure = str(result.failure_data_for_node("completions").error)
    assert "resources.target_model.chat_template" in failure and "does not render" in failure
    assert not list((tmp_path / "data").rglob("vllm_*.log"))  # refused before any server was started


def test_tool_conversations_train_on_exactly_what_the_server_conditioned_on(tmp_path):
    root = tmp_path / "data"
    res = resources(root, chat_template=str(TOJSON_TEMPLATE))
    with dg.instance_for_test() as instance:
        pk = corpus_partition(instance, res, write_source(tmp_path))
        result = dg.materialize(
            [completions, tokenized_sequences],
            instance=instance,
            resources=res,
            partition_key=pk,
            run_config={"ops": {"tokenized_sequences": {"config": {"truncated": "keep", "max_length": 2048}}}},
        )
        assert result.success
        counts = result.asset_materializations_for_node("tokenized_sequences")[0].metadata["counts"].value

    corpus = pl.read_parquet(root / "prompt_corpus" / "corpus.parquet")
    assert corpus.height == ASSISTANT_TURNS  # one row per assistant turn, none rejected for tool use
    rejected = root / "prompt_corpus" / "rejected.parquet"
    assert not rejected.exists() or pl.read_parquet(rejected).height == 0
    per_conversation = corpus.group_by("conversation_id").agg(pl.col("turn").sort()).sort("conversation_id")
    assert sorted(len(t) for t in per_conversation["turn"]) == [1, 2, 3]

    rows = pl.read_parquet(root / "completions" / f"{pk}.parquet").sort("index")
    assert rows.height == ASSISTANT_TURNS and rows["error"].null_count() == rows.height
    assert rows["prompt_token_ids"].null_count() == 0  # vLLM returned the ids it conditioned on, every row
    tokenized = pl.read_parquet(root / "tokenized_sequences" / f"{pk}.parquet").sort("index")
    assert tokenized.height == ASSISTANT_TURNS and counts["prompt_ids_checked"] == ASSISTANT_TURNS
    assert counts["ids_server"] == ASSISTANT_TURNS and "prompt_ids_differ" not in counts
    sha = hashlib.sha256(TOJSON_TEMPLATE.read_text().encode()).hexdigest()
    for row, tok in zip(rows.iter_rows(named=True), tokenized.iter_rows(named=True), strict=True):
        n = tok["prompt_len"]
        assert tok["input_ids"][:n] == row["prompt_token_ids"] and n == row["prompt_tokens"]  # context == server's
        assert tok["input_ids"][n:] == row["output_token_ids"]  # the regenerated turn, as generated
        # issue 49, Done when: the row is the server's prompt ids + output ids, and says so; vLLM's tool dump (a
        # tojson template) rendered by the project is the same ids
        assert (row["ids_source"], row["engine"], row["template_sha256"]) == ("server", "vllm", sha)
        assert row["engine_version"] == "vllm 0.32.0"  # what its /version said
        assert (tok["ids_source"], tok["rendering_matches"], tok["template_sha256"]) == ("server", True, sha)
        assert tok["loss_mask"] == [0] * n + [1] * len(row["output_token_ids"])  # loss on that turn only
    # the tools, the earlier call and its result are in the context the rows were generated from
    by_index = dict(zip(corpus["index"], corpus["messages"]))
    after_tool = [i for i, m in by_index.items() if m[-1]["role"] == "tool"]
    assert len(after_tool) == 2


def test_the_qwen36_standin_serves_and_tokenizes_tool_conversations_alike(tmp_path):
    """The stand-in's own template (Qwen3.6's tool layout) through ``transformers serve`` (mode local): no prompt
    ids come back there, but its prompt token count is the project's rendering's length on every row, and the
    loss covers the regenerated turn only."""
    root = tmp_path / "data"
    standin = "qwen3.6-hybrid-standin"
    res = {
        "storage": StorageResource(root=str(root)),
        "inference": InferenceServerResource(mode="local", local={"model": standin}),
        "generation": GenerationResource(max_output_tokens=CAP, temperature=0.0),
        "target_model": TargetModelResource(local_model=standin),
    }
    with dg.instance_for_test() as instance:
        pk = corpus_partition(instance, res, write_source(tmp_path))
        result = dg.materialize(
            [completions, tokenized_sequences],
            instance=instance,
            resources=res,
            partition_key=pk,
            run_config={"ops": {"tokenized_sequences": {"config": {"truncated": "keep", "max_length": 4096}}}},
        )
        assert result.success
    rows = pl.read_parquet(root / "completions" / f"{pk}.parquet").sort("index")
    assert rows.height == ASSISTANT_TURNS and rows["error"].null_count() == rows.height
    tokenized = pl.read_parquet(root / "tokenized_sequences" / f"{pk}.parquet").sort("index")
    assert tokenized.height == ASSISTANT_TURNS
    for row, tok in zip(rows.iter_rows(named=True), tokenized.iter_rows(named=True), strict=True):
        assert tok["prompt_len"] == row["prompt_tokens"]  # the server rendered as many tokens as tokenization
        n = tok["prompt_len"]
        assert tok["loss_mask"] == [0] * n + [1] * (len(tok["input_ids"]) - n) and len(tok["input_ids"]) > n
