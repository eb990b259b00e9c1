"""Issue 40, finding 1: a blocking check that raises holds its partition like one that fails.

The input that showed it: ``hidden_states``' checks re-read every shard after the materialization is recorded;
a read that fails (here EIO, as a network disk gives it, on an intact shard) raised out of the check, so no
evaluation was recorded. The gate counted only evaluations that passed or failed: the partition was up to
date for the next run, ``status`` and the schedule, the summary showed no failed check, and ``dflash_drafter``
trained on its shards, which nobody had checked. Here the real assets run against a real Dagster instance and
real files (a tiny random target with the embedded model's tokenizer); only the shard read of the check is
made to fail. A materialization reported by hand (the UI's "Report materialization") has no evaluation either.
"""

from __future__ import annotations

import errno
import json
import shutil

import dagster as dg
import polars as pl
import pytest
import torch

from dflash_assets.app.status import collect_status
from dflash_assets.app.status_lines import format_status
from dflash_assets.app.summary import failed_checks
from dflash_assets.app.summary_lines import failed_check_lines
from dflash_assets.assets.drafter import dflash_drafter
from dflash_assets.assets.hidden_states import hidden_states
from dflash_assets.assets.tokenized import tokenized_sequences
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.engines.local_model import ensure_local_model
from dflash_assets.generation.rows.records import rows_to_frame
from dflash_assets.orchestration import freshness
from dflash_assets.orchestration.check_gate import BLOCKING_CHECKS
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages import hidden_states as hidden_states_stage
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets_tests import automation_defs
from dflash_assets_tests.tiny_target import LAYER_IDS, project_config_with_layers

GOOD, BAD = "0000000-0000007", "0000008-0000015"
QUESTIONS = {i: f"Question number {i}: tell me something." for i in range(16)}
EIO = "Input/output error"


def tiny_target_with_tokenizer(root):
    """A random 6-layer Llama over the embedded model's vocabulary, beside that model's tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    source = ensure_local_model()
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    path = root / "target"
    LlamaForCausalLM(config).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path, vocab


def write_inputs(root) -> None:
    """The corpus and both partitions' completions: real answers that pass the tokenized checks."""
    settings = GenerationSettings(max_output_tokens=64)
    (root / "prompt_corpus").mkdir(parents=True)
    (root / "completions").mkdir(parents=True)
    pl.DataFrame(
        {
            "index": list(QUESTIONS),
            "prompt_id": [f"t:{i}" for i in QUESTIONS],
            "source": ["t"] * len(QUESTIONS),
            "messages": [[{"role": "user", "content": q}] for q in QUESTIONS.values()],
            "content_hash": [f"h{i}" for i in QUESTIONS],
        }
    ).write_parquet(root / "prompt_corpus" / "corpus.parquet")
    for pk, first in ((GOOD, 0), (BAD, 8)):
        rows = [
            {
                "index": i,
                "prompt_id": f"t:{i}",
                "prompt_hash": f"h{i}",
                "source": "t",
                "reasoning_content": None,
                "content": " ".join(["word"] * (3 + 2 * i)) + ".",
                "finish_reason": "stop",
                "prompt_tokens": 10,
                "completion_tokens": 10,
                "output_token_ids": None,
                "truncated_in_reasoning": False,
                "empty_answer": False,
                "max_output_tokens": 64,
                "settings_fingerprint": settings.sampling_fingerprint(),
                "settings": json.dumps(settings.model_dump(), sort_keys=True),
                "latency_s": 0.1,
                "server": "t",
                "attempts": 1,
                "error": None,
            }
            for i in range(first, first + 8)
        ]
        rows_to_frame(rows).write_parquet(root / "completions" / f"{pk}.parquet")


def tick(instance) -> list[dg.RunRequest] | str:
    """One tick of the shipped backfill schedule over the project's partition stages."""
    schedule = automation_defs.defs.get_schedule_def("backfill_unfinished_partitions")
    data = schedule.evaluate_tick(
        dg.build_schedule_context(instance=instance, repository_def=automation_defs.defs.get_repository_def())
    )
    return list(data.run_requests) if data.run_requests else data.skip_message


def test_a_check_that_raises_holds_its_partition_and_nothing_trains_on_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CONFIG", str(project_config_with_layers(tmp_path / "config", LAYER_IDS)))
    root = tmp_path / "data"
    write_inputs(root)
    target_dir, vocab = tiny_target_with_tokenizer(tmp_path)
    resources = {
        "storage": StorageResource(root=str(root)),
        "target_model": TargetModelResource(model_path=str(target_dir), dtype="float32", device="cpu"),
        "generation": GenerationResource(max_output_tokens=64),
    }
    hs_config = {"ops": {"hidden_states": {"config": {"target_layer_ids": LAYER_IDS, "rows_per_shard": 4}}}}
    drafter_config = {
        "ops": {
            "dflash_drafter": {
                "config": {
                    "features": "offline",
                    "num_hidden_layers": 1,
                    "block_size": 4,
                    "mask_token_id": vocab - 1,
                    "max_steps": 2,
                    "max_anchors": 4,
                    "eval_fraction": 0.0,
                    "checkpoint_every": 0,
                    "intermediate_size": 32,
                }
            }
        }
    }

    def materialize(assets, pk=None, config=None):
        return dg.materialize(
            assets, instance=instance, partition_key=pk, run_config=config, resources=resources, raise_on_error=False
        )

    def drafter_partitions_used() -> int:
        result = materialize([dflash_drafter], config=drafter_config)
        assert result.success, [e.message for e in result.all_events if e.is_step_failure]
        return result.asset_materializations_for_node("dflash_drafter")[0].metadata["partitions_used"].value

    def unreadable(path):
        raise OSError(errno.EIO, EIO, str(path))

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, [GOOD, BAD])
        for pk in (GOOD, BAD):
            instance.report_runless_asset_event(dg.AssetMaterialization("completions", partition=pk))
            assert materialize([tokenized_sequences], pk).success
        assert materialize([hidden_states], GOOD, hs_config).success
        with monkeypatch.context() as m:
            m.setattr(hidden_states_stage, "read_shard", unreadable)  # the check's read of BAD's shards fails
            raised = materialize([hidden_states], BAD, hs_config)
        assert not raised.success
        # the input that showed it: the materialization is recorded, no evaluation of its checks is
        assert raised.asset_materializations_for_node("hidden_states")
        assert not [e for e in raised.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"]

        # the gate: BAD's hidden_states is not up to date, naming both checks and the error; GOOD is
        reasons = freshness.partition_reasons(instance, "hidden_states", [GOOD, BAD], upstream="tokenized_sequences")
        names = [f"hidden_states.{n}" for n in BLOCKING_CHECKS["hidden_states"]]
        why = reasons[BAD]
        assert reasons[GOOD] is None and why.startswith("failed check ") and all(n in why for n in names), reasons
        assert "not evaluated" in why and EIO in why, why
        # status and the schedule name it; the schedule requests nothing for it
        status = collect_status(instance)
        assert status["held"] == {BAD: why}
        assert f"{BAD} ({why})" in format_status(status)
        skipped = tick(instance)
        assert isinstance(skipped, str) and f"{BAD} ({why})" in skipped, skipped
        # the summary lists both checks as failed on BAD, with the error
        checks = failed_checks(
            instance,
            [GOOD, BAD],
            [dg.AssetCheckKey(dg.AssetKey("hidden_states"), n) for n in BLOCKING_CHECKS["hidden_states"]],
        )
        assert [(c["check"], c["partitions"]) for c in checks] == [(n, [BAD]) for n in sorted(names)], checks
        assert all("not evaluated" in c["description"] and EIO in c["description"] for c in checks), checks
        assert EIO in "\n".join(failed_check_lines(checks))

        # dflash_drafter materialized alone (the UI, `dagster asset materialize`): it trains without BAD
        assert drafter_partitions_used() == 1

        # made again, the checks run and pass: the hold is gone and the drafter trains on both
        assert materialize([hidden_states], BAD, hs_config).success
        assert freshness.partition_reason(instance, "hidden_states", BAD, upstream="tokenized_sequences") is None
        assert collect_status(instance)["held"] == {}
        assert drafter_partitions_used() == 2

        # a materialization reported by hand had no check run on it: held too, saying so
        instance.report_runless_asset_event(dg.AssetMaterialization("hidden_states", partition=GOOD))
        why = freshness.partition_reason(instance, "hidden_states", GOOD, upstream="tokenized_sequences")
        assert why is not None and "not evaluated" in why and "without a run" in why, why
        assert drafter_partitions_used() == 1


@pytest.mark.parametrize("stage", list(BLOCKING_CHECKS))
def test_a_reported_materialization_holds_the_stages_after_it(stage):
    """The rule for every stage with blocking checks: no evaluation of the latest materialization, held."""
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, [GOOD])
        instance.report_runless_asset_event(dg.AssetMaterialization(stage, partition=GOOD))
        held = collect_status(instance)["held"]
        assert (
            list(held) == [GOOD] and held[GOOD].startswith(f"failed check {stage}.") and "not evaluated" in held[GOOD]
        )
