"""Issue 49: what the server saw is what the drafter learns (rendering as each engine does, and the explained
difference: ``test_chat_templates``).

- The server's ids are the row (item 1, "Done when"): a BFCL tool conversation through ``completions`` on the
  GPU-node simulator rendering as SGLang does (``sglang_stub --sim-tokenizer``, SGLang's own tool dump, a tojson
  template) and ``tokenized_sequences``: every row is the server's prompt ids + output ids (+ the end token of a
  stop row), records its source, engine, version and template, and the run does not fail. Served with another
  template than the project renders, the rows are still the server's, and the check names the first differing
  token, its text on both sides and its cause.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
from transformers import AutoTokenizer

from dflash_assets.assets.completions import completions
from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.assets.tokenized import tokenized_sequences
from dflash_assets.generation.engines.chat_render import BUNDLED_TEMPLATES, SMOLLM2_TOOLS_TEMPLATE
from dflash_assets.generation.engines.local_model import ensure_local_model
from dflash_assets.generation.processes.ports import free_port_block
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.completions.continuing import load_target_builder
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets_tests.engine_bodies import TOJSON_TEMPLATE

FIELD_BY_FIELD = BUNDLED_TEMPLATES / SMOLLM2_TOOLS_TEMPLATE


@pytest.fixture(scope="module")
def smol() -> AutoTokenizer:
    return AutoTokenizer.from_pretrained(str(ensure_local_model()))


# ------------------------------------------------------------------------------------------ the simulator

SOURCE = "bfcl:multi_turn_base?limit=1&tools=used"
CAP = 12


def simulator(template: Path | None = None) -> InferenceServerResource:
    """One GPU-node simulator rendering as SGLang does with the SmolLM2 tokenizer (``--sim-tokenizer``); with
    ``template``, served with that template whatever the project's (a later --chat-template wins)."""
    extra = ["--sim-startup-s", "0", "--sim-speed", "1000", "--sim-median-tokens", "8", "--sim-tokenizer"]
    return InferenceServerResource(
        mode="sglang",
        max_running_requests=4,
        sglang={
            "model_path": str(ensure_local_model()),
            "num_servers": 1,
            "port_base": free_port_block(1),
            "launch_module": "dflash_simulators.sglang_stub",
            "context_length": 8192,
            "extra_args": [*extra, *(["--chat-template", str(template)] if template else [])],
        },
        startup_timeout_s=60.0,
    )


def run_partition(tmp_path: Path, inference: InferenceServerResource, project_template: Path):
    """prompt_corpus, then completions and tokenized_sequences of its one partition; ``(completions rows,
    tokenized rows, tokenized metadata, checks by name, corpus)``."""
    root = tmp_path / "data"
    resources = {
        "storage": StorageResource(root=str(root)),
        "inference": inference,
        "generation": GenerationResource(max_output_tokens=CAP, temperature=0.6),
        "target_model": TargetModelResource(chat_template=str(project_template)),
    }
    with dg.instance_for_test() as instance:
        corpus_config = {"ops": {"prompt_corpus": {"config": {"sources": [SOURCE], "partition_size": 64}}}}
        assert dg.materialize([prompt_corpus], instance=instance, resources=resources, run_config=corpus_config).success
        (pk,) = instance.get_dynamic_partitions(prompt_ranges.name)
        result = dg.materialize(
            [completions, tokenized_sequences],
            instance=instance,
            resources=resources,
            partition_key=pk,
            run_config={"ops": {"tokenized_sequences": {"config": {"truncated": "keep", "max_length": 8192}}}},
        )
        assert result.success  # the run does not fail
        meta = result.asset_materializations_for_node("tokenized_sequences")[0].metadata
        checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    rows = pl.read_parquet(root / "completions" / f"{pk}.parquet").sort("index")
    tokenized = pl.read_parquet(root / "tokenized_sequences" / f"{pk}.parquet").sort("index")
    corpus = pl.read_parquet(root / "prompt_corpus" / "corpus.parquet").sort("index")
    return rows, tokenized, meta, checks, corpus


def test_a_tool_conversations_rows_are_the_simulators_prompt_ids_plus_output_ids(tmp_path, smol):
    """Done when, on the SGLang simulator: SGLang's tool dump, a tojson template; every tokenized row is the
    server's prompt ids + output ids (+ the end token of a stop row)."""
    inference = simulator()
    rows, tokenized, meta, checks, corpus = run_partition(tmp_path, inference, TOJSON_TEMPLATE)
    end = smol.convert_tokens_to_ids("<|im_end|>")
    sha = hashlib.sha256(TOJSON_TEMPLATE.read_text().encode()).hexdigest()
    assert rows.height >= 5 and rows["error"].null_count() == rows.height  # the task's turns: calls and answers
    assert rows["ids_source"].to_list() == ["server"] * rows.height
    assert set(rows["engine"]) == {"sglang"} and set(rows["engine_version"]) == {"sglang sglang_stub (simulated)"}
    assert set(rows["template_sha256"]) == {sha}
    assert tokenized.height == rows.height
    for row, tok in zip(rows.iter_rows(named=True), tokenized.iter_rows(named=True), strict=True):
        output = list(row["output_token_ids"]) + ([end] if row["finish_reason"] == "stop" else [])
        assert tok["input_ids"] == list(row["prompt_token_ids"]) + output
        assert tok["prompt_len"] == row["prompt_tokens"] == len(row["prompt_token_ids"])
        assert tok["loss_mask"] == [0] * tok["prompt_len"] + [1] * len(output)
        # SGLang's dump reached the template: its "defer_loading": null is in the context, decoded apart
        assert '"defer_loading": null' in smol.decode(row["prompt_token_ids"])
        assert (tok["ids_source"], tok["engine"], tok["template_sha256"]) == ("server", "sglang", sha)
        assert tok["engine_version"] == "sglang sglang_stub (simulated)" and tok["rendering_matches"] is True
    counts = meta["counts"].value
    assert counts["ids_server"] == rows.height and counts["prompt_ids_checked"] == rows.height
    assert "prompt_ids_differ" not in counts and checks["rendering_matches_server_prompt_ids"].passed
    # the length pre-filter counts each prompt as the server rendered it (SGLang's tool dump included)
    builder = load_target_builder(inference, TOJSON_TEMPLATE)
    counted = builder.prompt_lengths(corpus["messages"].to_list(), True, corpus["tools"].to_list())
    assert counted == rows["prompt_tokens"].to_list()


def test_served_with_another_template_the_rows_keep_the_servers_ids_and_the_check_names_the_cause(tmp_path, smol):
    """The server renders with the tojson template, the project with the field-by-field one: the rows are the
    server's ids all the same, and the WARN check names the first differing token, both texts and the tools."""
    rows, tokenized, meta, checks, _ = run_partition(tmp_path, simulator(TOJSON_TEMPLATE), FIELD_BY_FIELD)
    for row, tok in zip(rows.iter_rows(named=True), tokenized.iter_rows(named=True), strict=True):
        assert tok["input_ids"][: tok["prompt_len"]] == list(row["prompt_token_ids"])
        assert tok["rendering_matches"] is False and tok["ids_source"] == "server"
    counts = meta["counts"].value
    assert counts["prompt_ids_differ"] == rows.height and counts["ids_server"] == rows.height
    check = checks["rendering_matches_server_prompt_ids"]
    assert not check.passed and check.severity == dg.AssetCheckSeverity.WARN
    first = meta["first_prompt_difference"].value
    # the first tool written by tojson puts "type" first; the shipped template writes it field by field
    assert first.startswith(f"row {rows['index'][0]} ") and "cause: tools" in first, first
    assert "project '" in first and "server '" in first
