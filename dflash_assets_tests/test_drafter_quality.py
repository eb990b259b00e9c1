"""Issue "Drafter evaluation", acceptance 2: the drafter the demo pipeline trains beats an untrained one.

The whole chain runs through the real assets on real data: bundled HumanEval prompts -> completions from
the real local server (SmolLM2-135M on CPU) -> tokenized_sequences -> hidden_states -> dflash_drafter ->
drafter_evaluation, with the demo's config file (``configs/local_demo.yaml``) for every stage. To keep
the suite short it uses ``NUM_PROMPTS`` of the demo's 64 prompts, ``TEST_STEPS`` training steps instead
of the demo's 400, ``EVAL_PROMPTS`` held-out prompts of ``EVAL_NEW_TOKENS`` tokens, and the greedy
session server instead of the demo's sampled completions.

Run-to-run spread: the drafter is trained twice with different seeds (different init, data order and
anchors) and each is measured by real speculative decoding on the held-out prompts; the spread is the
difference of the two tau values. The untrained drafter's tau is measured in the same runs.
"""

from __future__ import annotations

import math

import dagster as dg
import pytest
import yaml

from dflash_assets.assets.completions import completions
from dflash_assets.assets.drafter import dflash_drafter
from dflash_assets.assets.evaluation import drafter_evaluation
from dflash_assets.assets.hidden_states import hidden_states
from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.assets.tokenized import tokenized_sequences
from dflash_assets.config import DEFAULT_CONFIG
from dflash_assets.partitions import prompt_ranges
from dflash_assets.resources.generation import GenerationResource
from dflash_assets.resources.storage import StorageResource
from dflash_assets.resources.target_model import TargetModelResource

NUM_PROMPTS = 16
TEST_STEPS = 200
EVAL_PROMPTS = 3
EVAL_NEW_TOKENS = 32


def _demo() -> dict:
    return yaml.safe_load(open(DEFAULT_CONFIG))


def _meta(result, key: str) -> dict:
    mats = [m for m in result.asset_materializations_for_node(key)]
    assert mats, f"{key} was not materialized"
    return {k: getattr(v, "value", v) for k, v in mats[-1].metadata.items()}


@pytest.fixture(scope="module")
def demo_runs(local_inference, tmp_path_factory):
    demo = _demo()
    ops = demo["ops"]
    res = demo["resources"]
    root = tmp_path_factory.mktemp("quality")
    resources = {
        "storage": StorageResource(root=str(root)),
        "inference": local_inference,
        "generation": GenerationResource(**res.get("generation", {})),
        "target_model": TargetModelResource(**res.get("target_model", {})),
    }
    corpus_config = dict(ops["prompt_corpus"]["config"], max_prompts=NUM_PROMPTS)
    out = {"evaluations": [], "drafters": []}
    with dg.instance_for_test() as instance:
        assert dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources=resources,
            run_config={"ops": {"prompt_corpus": {"config": corpus_config}}},
        ).success
        stage_ops = {k: ops[k] for k in ("tokenized_sequences", "hidden_states") if k in ops}
        for pk in instance.get_dynamic_partitions(prompt_ranges.name):
            assert dg.materialize(
                [completions, tokenized_sequences, hidden_states],
                instance=instance,
                resources=resources,
                partition_key=pk,
                run_config={"ops": stage_ops},
            ).success
        for seed in (0, 1):
            train_config = dict(ops["dflash_drafter"]["config"], max_steps=TEST_STEPS, seed=seed)
            eval_config = dict(
                ops["drafter_evaluation"]["config"], num_prompts=EVAL_PROMPTS, max_new_tokens=EVAL_NEW_TOKENS
            )
            run_config = {
                "ops": {"dflash_drafter": {"config": train_config}, "drafter_evaluation": {"config": eval_config}}
            }
            result = dg.materialize(
                [dflash_drafter, drafter_evaluation], instance=instance, resources=resources, run_config=run_config
            )
            assert result.success
            out["drafters"].append(_meta(result, "dflash_drafter"))
            out["evaluations"].append(_meta(result, "drafter_evaluation"))
    return out


def test_trained_drafter_beats_untrained_by_more_than_the_run_to_run_spread(demo_runs):
    evals = demo_runs["evaluations"]
    taus = [e["tau"] for e in evals]
    untrained = [e["tau_untrained"] for e in evals]
    spread = max(taus) - min(taus)
    margin = min(taus) - max(untrained)
    print(
        f"tau per seed {taus}, untrained {untrained}, run-to-run spread {spread:.3f}, margin {margin:.3f}, "
        f"stderr {[e['tau_stderr'] for e in evals]}"
    )
    for e in evals:
        assert e["lossless"], e  # acceptance 1 on the held-out prompts of both runs
        assert e["num_prompts"] == EVAL_PROMPTS
        assert 1.0 <= e["tau_untrained"] < 1.05  # a random drafter's drafts almost never match
        assert e["target_forwards_saved"] > 0
        # the metadata states the margin in units of the standard error across prompts
        se = math.hypot(e["tau_stderr"], e["tau_untrained_stderr"])
        assert e["tau_margin_in_stderr"] == pytest.approx((e["tau"] - e["tau_untrained"]) / max(se, 1e-9), abs=0.02)
        assert e["tau_margin_in_stderr"] > 2
    assert margin > 0.1
    assert margin > spread, (taus, untrained)
    # both drafters were trained on the same data with the demo's architecture
    d0, d1 = demo_runs["drafters"]
    assert d0["train_tokens"] == d1["train_tokens"] and d0["parameters"] == d1["parameters"]
    assert d0["seed"] == 0 and d1["seed"] == 1
    assert d0["final_loss"] != d1["final_loss"]  # two different drafters, not one run resumed
