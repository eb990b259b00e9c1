"""Issue 26: a corpus edit never pairs an answer with another prompt, and costs only what changed.

One Dagster instance and storage root go through a series of edits of the prompt files (the tests run in
file order, each on the state the one before left): a file added after, before and between the others, a
prompt's text edited, the sources reordered, the same prompt in two files, a file removed. After each, the
stages run as the main job runs them (what :mod:`dflash_assets.orchestration.freshness` says is not up to date:
completions as one range run, then tokenized_sequences and hidden_states per partition), and the test checks:

- on the STORED tables, every completions, tokenized and hidden-state row answers the corpus's prompt at
  its index (completions: the answer text names the prompt; tokenized: the prompt tokens decode to the
  prompt and the loss tokens to the answer naming it; hidden states: index.json's prompt of each row);
- the requests the server received (its own log, in its own process) are exactly the new or changed prompts;
- the held-out split (keyed by index, stable per content) never puts a prompt trained on before the edit in
  the evaluation after it.

The server is the stand-in (``--script echo``: each answer names its prompt), a real process on a socket:
what it stands in for is a model whose answers identify their prompt. The target is a random tiny Llama
with SmolLM2's tokenizer (real tokenization, real hidden-state extraction, in seconds).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from dflash_assets.app.status import collect_status
from dflash_assets.app.status_lines import format_status
from dflash_assets.assets.completions import completions
from dflash_assets.assets.hidden_states import hidden_states
from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.assets.tokenized import tokenized_sequences
from dflash_assets.dflash.shards.dataset import heldout_fraction_of
from dflash_assets.generation.engines.local_model import ensure_local_model
from dflash_assets.orchestration import freshness
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.prompts import CORPUS_FILE
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource

SIZE = 2  # prompts per partition: several partitions from a few prompts
EVAL_FRACTION = 0.5  # a large held-out share, so the split has members on both sides


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The echo server (own process, logging each request's prompt), a tiny target, an instance, a storage root."""
    tmp = tmp_path_factory.mktemp("corpus_edits")
    log = tmp / "requests.jsonl"
    log.touch()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_simulators.stand_in_server", "--script", "echo", "--log", str(log)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line
        url = f"http://127.0.0.1:{int(line.split()[1])}"
        target = tiny_target(tmp / "target")
        (tmp / "home").mkdir()
        with dg.instance_for_test(temp_dir=str(tmp / "home")) as instance:
            yield {
                "tmp": tmp,
                "log": log,
                "url": url,
                "target": target,
                "instance": instance,
                "root": tmp / "data",
                "history": [],
            }
    finally:
        proc.terminate()
        proc.wait(10)


def tiny_target(path: Path) -> str:
    """A random 2-layer Llama (hidden 32) with SmolLM2's tokenizer: real tokens, hidden states in a blink."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True)
    src = ensure_local_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, path / name)
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=49152,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=512,
        )
    ).save_pretrained(path)
    return str(path)


def write(world, name: str, prompts: list[str]) -> str:
    path = world["tmp"] / name
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def requests_so_far(world) -> list[str]:
    """Prompts the server received (its log; the start-up probe's message left out)."""
    prompts = [json.loads(line) for line in world["log"].read_text().splitlines() if line.strip()]
    return [p for p in prompts if p and p.startswith("p-")]


def resources(world) -> dict:
    return {
        "storage": StorageResource(root=str(world["root"])),
        "inference": InferenceServerResource(
            mode="external",
            base_urls=[world["url"]],
            served_model_name="fake",
            external_backend="openai",
            max_running_requests=4,
            max_attempts=1,
            request_timeout_s=10.0,
            startup_timeout_s=10.0,
        ),
        "generation": GenerationResource(max_output_tokens=16, temperature=0.0),
        "target_model": TargetModelResource(model_path=world["target"], dtype="float32", device="cpu"),
    }


def run_main_job_stages(world, sources: list[str]) -> dict[str, str]:
    """Build the corpus from ``sources``, then materialize what the freshness rule says is not up to date,
    as the main job does. Returns ``{partition: completions reason}`` seen before the run."""
    instance, res = world["instance"], resources(world)
    config = {"sources": sources, "partition_size": SIZE}
    assert dg.materialize(
        [prompt_corpus], instance=instance, resources=res, run_config={"ops": {"prompt_corpus": {"config": config}}}
    ).success
    keys = instance.get_dynamic_partitions(prompt_ranges.name)
    settings = res["generation"].settings()
    # what status says the run will cost, before it runs
    world["status"] = collect_status(instance, settings=settings, store=res["storage"].open())
    reasons = {pk: r for pk, r in freshness.completions_reasons(instance, keys, settings).items() if r}
    if reasons:
        stale = [pk for pk in keys if pk in reasons]
        result = dg.materialize(
            [completions],
            instance=instance,
            resources=res,
            raise_on_error=False,
            tags={ASSET_PARTITION_RANGE_START_TAG: stale[0], ASSET_PARTITION_RANGE_END_TAG: stale[-1]},
        )
        assert result.success
        assert not {pk for pk, r in freshness.completions_reasons(instance, keys, settings).items() if r}
    for pk in keys:
        todo, upstream = [], "completions"
        for stage in ("tokenized_sequences", "hidden_states"):
            if todo or freshness.partition_reason(instance, stage, pk, settings, upstream):
                todo.append(stage)
            upstream = stage
        if todo:
            assets = {"tokenized_sequences": tokenized_sequences, "hidden_states": hidden_states}
            result = dg.materialize(
                [assets[s] for s in todo],
                instance=instance,
                resources=res,
                partition_key=pk,
                raise_on_error=False,
                run_config={
                    "ops": {
                        # every echo answer is ~8 tokens: that is not the empty-answer signature here
                        "tokenized_sequences": {"config": {"degenerate_small_tokens": 1}},
                        "hidden_states": {"config": {"target_layer_ids": [0, 1], "rows_per_shard": 4}},
                    }
                },
            )
            assert result.success, pk
    return reasons


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def check_stored_rows(world) -> pl.DataFrame:
    """Every stored row answers the corpus's prompt at its index; returns the corpus (index, text, hash)."""
    from transformers import AutoTokenizer

    root = world["root"]
    corpus = pl.read_parquet(root.joinpath(*CORPUS_FILE))
    text = dict(zip(corpus["index"].to_list(), [m[-1]["content"] for m in corpus["messages"].to_list()]))
    chash = dict(zip(corpus["index"].to_list(), corpus["content_hash"].to_list()))
    assert corpus["content_hash"].n_unique() == corpus.height  # one index per prompt content
    tokenizer = world.setdefault("tokenizer", AutoTokenizer.from_pretrained(world["target"]))
    seen = set()
    for pk in world["instance"].get_dynamic_partitions(prompt_ranges.name):
        comp = pl.read_parquet(root / "completions" / f"{pk}.parquet")
        for row in comp.iter_rows(named=True):
            assert row["prompt_hash"] == chash[row["index"]], (pk, row["index"])
            assert row["content"] == f"Answer to: {text[row['index']]}", (pk, row["index"], row["content"])
        tok = pl.read_parquet(root / "tokenized_sequences" / f"{pk}.parquet")
        assert sorted(tok["index"].to_list()) == sorted(comp["index"].to_list())
        for row in tok.iter_rows(named=True):
            i = row["index"]
            assert row["prompt_hash"] == chash[i]
            prompt_part, answer_part = (
                decode(tokenizer, row["input_ids"][: row["prompt_len"]]),
                decode(tokenizer, row["input_ids"][row["prompt_len"] :]),
            )
            assert prompt_part.rstrip().endswith(text[i]) or f"{text[i]}\n" in prompt_part, (i, prompt_part[-80:])
            assert answer_part.strip() == f"Answer to: {text[i]}", (i, answer_part)
            assert row["loss_mask"][row["prompt_len"] :] == [1] * (len(row["input_ids"]) - row["prompt_len"])
        index = json.loads((root / "hidden_states" / pk / "index.json").read_text())
        assert {int(i): h for i, h in index["prompt_hashes"].items()} == {i: chash[i] for i in tok["index"].to_list()}
        seen.update(comp["index"].to_list())
    assert seen == set(text)  # every prompt has its row, in the partition of its index
    return corpus


def held_out(index: int) -> bool:
    return heldout_fraction_of(f"idx:{index}") < EVAL_FRACTION


def step(world, sources: list[str], expected_requests: set[str]) -> dict[str, str]:
    """One edit: run, then check the stored rows, the requests and the held-out split against the build before."""
    before = len(requests_so_far(world))
    reasons = run_main_job_stages(world, sources)
    sent = requests_so_far(world)[before:]
    assert sorted(sent) == sorted(expected_requests), reasons
    assert world["status"]["corpus_edit"]["to_request"] == len(sent), world["status"]["corpus_edit"]
    edit = world["status"]["corpus_edit"]
    assert (
        f"corpus, last build: {edit['new']} new, {edit['changed']} changed, {edit['removed']} removed prompts"
        in format_status(world["status"])
    )
    corpus = check_stored_rows(world)
    hashes = dict(zip(corpus["index"].to_list(), corpus["content_hash"].to_list()))
    if world["history"]:
        trained_before = {h for i, h in world["history"][-1].items() if not held_out(i)}
        evaluated_now = {h for i, h in hashes.items() if held_out(i)}
        assert not trained_before & evaluated_now
        # the reason the split holds: an index never changes its prompt
        assert all(world["history"][-1][i] == h for i, h in hashes.items() if i in world["history"][-1])
    world["history"].append(hashes)
    return reasons


BASE_A = ["p-a0", "p-a1"]
BASE_B = ["p-b0", "p-b1"]


def test_base_corpus_requests_every_prompt_once(world):
    world["a"], world["b"] = write(world, "a.jsonl", BASE_A), write(world, "b.jsonl", BASE_B)
    step(world, [world["a"], world["b"]], set(BASE_A + BASE_B))
    assert world["instance"].get_dynamic_partitions(prompt_ranges.name) == ["0000000-0000001", "0000002-0000003"]


def test_a_file_added_after_the_others_costs_its_prompts(world):
    world["after"] = write(world, "after.jsonl", ["p-after0", "p-after1"])
    reasons = step(world, [world["a"], world["b"], world["after"]], {"p-after0", "p-after1"})
    assert reasons == {"0000004-0000005": freshness.NOT_MATERIALIZED}  # the old partitions are up to date


def test_a_file_added_before_the_others_costs_its_prompts(world):
    world["before"] = write(world, "before.jsonl", ["p-before0"])
    reasons = step(world, [world["before"], world["a"], world["b"], world["after"]], {"p-before0"})
    assert reasons == {"0000006-0000006": freshness.NOT_MATERIALIZED}


def test_a_file_added_between_the_others_costs_its_prompts(world):
    world["between"] = write(world, "between.jsonl", ["p-between0"])
    step(world, [world["before"], world["a"], world["between"], world["b"], world["after"]], {"p-between0"})


def test_an_edited_prompt_costs_one_request_and_its_old_row_is_dropped(world):
    write(world, "a.jsonl", ["p-a0", "p-a1 edited"])
    reasons = step(world, [world["before"], world["a"], world["between"], world["b"], world["after"]], {"p-a1 edited"})
    # the edit's old index (1) is a gap now: its partition's table is rewritten without that row, no request
    assert reasons["0000000-0000001"] == freshness.PROMPTS_CHANGED
    edit = world["status"]["corpus_edit"]
    assert (edit["new"], edit["changed"], edit["removed"]) == (1, 0, 1)  # a plain prompt's id is its content hash
    assert world["status"]["completions"]["regenerate"]["removed"] == 1


def test_reordered_sources_cost_nothing(world):
    reasons = step(world, [world["after"], world["b"], world["between"], world["a"], world["before"]], set())
    assert reasons == {}


def test_the_same_prompt_in_two_files_is_one_prompt_with_one_row(world):
    world["dup"] = write(world, "dup.jsonl", ["p-b0", "p-dup-new", "p-after1"])
    step(
        world, [world["a"], world["dup"], world["b"], world["before"], world["between"], world["after"]], {"p-dup-new"}
    )


def test_a_removed_file_costs_nothing_and_its_rows_leave_every_table(world):
    reasons = step(world, [world["a"], world["dup"], world["before"], world["between"], world["after"]], set())
    corpus = pl.read_parquet(world["root"].joinpath(*CORPUS_FILE))
    assert "p-b1" not in {m[-1]["content"] for m in corpus["messages"].to_list()}
    # p-b0 is in dup.jsonl too: its partition keeps it, loses p-b1 (a gap), and is rewritten without a request
    assert reasons == {"0000002-0000003": freshness.PROMPTS_CHANGED}
    assert pl.read_parquet(world["root"] / "completions" / "0000002-0000003.parquet")["index"].to_list() == [2]


def test_a_row_from_before_rows_named_their_prompt_is_requested_again(world):
    """Rows without prompt_hash (tables written before this change) prove nothing about their prompt: requested
    again, unless the prompt has no id field (its prompt_id is then its content hash, which proves it)."""
    root, instance = world["root"], world["instance"]
    pk = instance.get_dynamic_partitions(prompt_ranges.name)[0]
    path = root / "completions" / f"{pk}.parquet"
    table = pl.read_parquet(path)
    # an old table: no prompt_hash column; row 0 has an id-like prompt_id (unverifiable), the rest their hash
    old = table.drop("prompt_hash").with_columns(
        pl.when(pl.col("index") == table["index"][0])
        .then(pl.lit("a:0"))
        .otherwise(pl.col("prompt_id"))
        .alias("prompt_id")
    )
    old.write_parquet(path)
    instance.report_runless_asset_event(
        dg.AssetMaterialization("completions", partition=pk, metadata={"rows": old.height})
    )
    before = len(requests_so_far(world))
    reasons = run_main_job_stages(world, [world["a"], world["dup"], world["before"], world["between"], world["after"]])
    assert reasons == {pk: freshness.PROMPTS_UNVERSIONED}
    corpus = pl.read_parquet(root.joinpath(*CORPUS_FILE))
    first = corpus.filter(pl.col("index") == table["index"][0])["messages"][0][-1]["content"]
    assert requests_so_far(world)[before:] == [first]
    assert world["status"]["completions"]["regenerate"]["by_reason"] == {"prompt unknown": 1}
    check_stored_rows(world)


def test_status_previews_an_edit_of_the_prompt_files_before_the_corpus_is_built(world, monkeypatch):
    """`status` after the user edits the prompt files, before any run: it builds the next corpus in memory (writing
    nothing) and says what it will cost; the run then sends exactly that."""
    from dflash_assets.app.status import corpus_preview

    sources = [
        world["a"],
        world["dup"],
        world["before"],
        world["between"],
        world["after"],
        write(world, "late.jsonl", ["p-late0", "p-b1"]),
    ]  # one new prompt, one that comes back
    config = world["tmp"] / "config.yaml"
    config.write_text(json.dumps({"ops": {"prompt_corpus": {"config": {"sources": sources, "partition_size": SIZE}}}}))
    monkeypatch.setenv("DFLASH_CONFIG", str(config))
    monkeypatch.setenv("DFLASH_STORAGE_ROOT", str(world["root"]))
    index_before = (world["root"] / "prompt_corpus" / "prompt_index.parquet").read_bytes()
    line = corpus_preview(world["instance"], resources(world)["storage"].open())
    assert line is not None and "2 new, 0 changed, 0 removed prompts" in line and "request 2 completions" in line, line
    assert (world["root"] / "prompt_corpus" / "prompt_index.parquet").read_bytes() == index_before  # nothing written
    # p-b1 comes back at its old index 3, whose row its partition dropped when b.jsonl was removed: requested again
    step(world, sources, {"p-late0", "p-b1"})
