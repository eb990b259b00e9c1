"""Issue 32, finding 1: a failed blocking check holds its partition until it is made again and passes.

The input that showed it: ``tokenized_sequences`` of a partition whose completions are all empty answers
(every kept row supervises exactly the end token: the degenerate-mask check fails). Dagster records the
materialization before the check runs, so by the materialization records alone the partition was up to
date: the next run, the schedule and ``status`` went on to ``hidden_states`` and training. Here the real
asset runs against a real Dagster instance and real files; the freshness rule, a tick of the shipped
backfill schedule and ``status`` must all name the check, and forget it once the partition passes.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import polars as pl

from dflash_assets.app.status import collect_status
from dflash_assets.app.status_lines import format_status
from dflash_assets.assets.hidden_states import hidden_states
from dflash_assets.assets.tokenized import tokenized_sequences
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.rows.records import rows_to_frame
from dflash_assets.orchestration import freshness
from dflash_assets.orchestration.check_gate import BLOCKING_CHECKS, CHECK_DEGENERATE, failed_blocking_checks
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets_tests import automation_defs

QUESTIONS = {i: f"Question number {i}: tell me something." for i in range(8)}
PK = "0000000-0000007"
HELD = f"failed check tokenized_sequences.{CHECK_DEGENERATE}"


def completion_row(index: int, content: str) -> dict:
    settings = GenerationSettings(max_output_tokens=64)
    return {
        "index": index,
        "prompt_id": f"t:{index}",
        "prompt_hash": f"h{index}",
        "source": "t",
        "reasoning_content": None,
        "content": content,
        "finish_reason": "stop",
        "prompt_tokens": 10,
        "completion_tokens": 10,
        "output_token_ids": None,
        "truncated_in_reasoning": False,
        "empty_answer": not content,
        "max_output_tokens": 64,
        "settings_fingerprint": settings.sampling_fingerprint(),
        "settings": json.dumps(settings.model_dump(), sort_keys=True),
        "latency_s": 0.1,
        "server": "t",
        "attempts": 1,
        "error": None,
    }


def write_completions(root: Path, contents: dict[int, str]) -> None:
    (root / "prompt_corpus").mkdir(parents=True, exist_ok=True)
    (root / "completions").mkdir(parents=True, exist_ok=True)
    pl.DataFrame(
        {
            "index": list(QUESTIONS),
            "prompt_id": [f"t:{i}" for i in QUESTIONS],
            "source": ["t"] * len(QUESTIONS),
            "messages": [[{"role": "user", "content": q}] for q in QUESTIONS.values()],
            "content_hash": [f"h{i}" for i in QUESTIONS],
        }
    ).write_parquet(root / "prompt_corpus" / "corpus.parquet")
    rows_to_frame([completion_row(i, text) for i, text in contents.items()]).write_parquet(
        root / "completions" / f"{PK}.parquet"
    )


def tokenize(instance, root: Path) -> dg.ExecuteInProcessResult:
    """``tokenized_sequences[PK]`` alone, as from the UI or ``dagster asset materialize --select``."""
    return dg.materialize(
        [tokenized_sequences],
        instance=instance,
        partition_key=PK,
        resources={
            "storage": StorageResource(root=str(root)),
            "target_model": TargetModelResource(),
            "generation": GenerationResource(max_output_tokens=64),
        },
        raise_on_error=False,
    )


def tick(instance) -> list[dg.RunRequest] | str:
    """One tick of the shipped backfill schedule over the project's partition stages."""
    schedule = automation_defs.defs.get_schedule_def("backfill_unfinished_partitions")
    data = schedule.evaluate_tick(
        dg.build_schedule_context(instance=instance, repository_def=automation_defs.defs.get_repository_def())
    )
    return list(data.run_requests) if data.run_requests else data.skip_message


def test_the_gate_names_the_blocking_checks_the_assets_declare():
    declared = {
        a.key.to_user_string(): tuple(s.name for s in a.check_specs if s.blocking)
        for a in (tokenized_sequences, hidden_states)
    }
    assert declared == BLOCKING_CHECKS


def test_a_failed_blocking_check_holds_the_partition_until_it_passes(tmp_path):
    root = tmp_path / "data"
    write_completions(root, dict.fromkeys(QUESTIONS, ""))  # empty answers: the 87%-empty dataset of the mission
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, [PK])
        instance.report_runless_asset_event(dg.AssetMaterialization("completions", partition=PK))

        first = tokenize(instance, root)
        assert not first.success  # the check failed after the materialization was recorded
        assert instance.get_latest_materialization_event(dg.AssetKey("tokenized_sequences")) is not None

        # the main job's rule: the stage is not up to date, nor anything after it, naming the check
        assert freshness.partition_reason(instance, "tokenized_sequences", PK, upstream="completions") == HELD
        reasons = freshness.partition_reasons(instance, "tokenized_sequences", [PK], upstream="completions")
        assert reasons == {PK: HELD}
        # the schedule requests no hidden_states for it, and says why
        skipped = tick(instance)
        assert isinstance(skipped, str) and f"{PK} ({HELD})" in skipped, skipped
        # status names it
        status = collect_status(instance)
        assert status["held"] == {PK: HELD}
        assert f"{PK} ({HELD})" in format_status(status)

        # fixed rows, made again: the check passes, the partition is up to date and hidden_states follows
        write_completions(root, {i: " ".join(["word"] * (3 + 4 * i)) + "." for i in QUESTIONS})
        assert tokenize(instance, root).success
        latest = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("tokenized_sequences"), asset_partitions=[PK]), limit=1
        ).records[0]
        assert failed_blocking_checks(instance, "tokenized_sequences", {PK: latest}) == {}
        assert freshness.partition_reason(instance, "tokenized_sequences", PK, upstream="completions") is None
        assert collect_status(instance)["held"] == {}
        requests = tick(instance)
        assert [(r.partition_key, r.asset_selection) for r in requests] == [(PK, [dg.AssetKey("hidden_states")])]
