"""The main job: materialize every stage into the persistent Dagster instance, skipping what is up to date.

Order: prompt_corpus; for each partition completions -> tokenized_sequences -> hidden_states;
truncation_report; dflash_drafter; drafter_evaluation. A partition's stage is up to date when its latest
materialization is newer than its upstream's and, for completions, no row is invalid under the current
generation settings; the drafter and its evaluation also rerun when their settings changed (the drafter
itself then decides, by the content of its data, whether to train, resume or reuse). Ends with a summary
read back from the assets' metadata.
"""

import os
import time

import dagster as dg
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from dflash_assets.assets.drafter import DrafterConfig, config_changed_since_last
from dflash_assets.assets.evaluation import EvaluationConfig
from dflash_assets.assets.prompts import PromptCorpusConfig, corpus_fingerprint
from dflash_assets.automation import affected_reason
from dflash_assets.config import config_path, op_config
from dflash_assets.definitions import defs
from dflash_assets.generation.server_registry import orphan_message, reap_orphaned_servers
from dflash_assets.partitions import prompt_ranges
from dflash_assets.runs import process_tags, reap_dead_runs

PARTITION_STAGES = ["completions", "tokenized_sequences", "hidden_states"]
UPSTREAM = {"completions": None, "tokenized_sequences": "completions", "hidden_states": "tokenized_sequences"}
FINAL_STAGES = ["truncation_report", "dflash_drafter", "drafter_evaluation"]


def _latest_record(instance, key: str, pk: str | None = None):
    flt = dg.AssetRecordsFilter(asset_key=dg.AssetKey(key), asset_partitions=[pk] if pk else None)
    records = instance.fetch_materializations(flt, limit=1).records
    return records[0] if records else None


def stage_up_to_date(instance, key: str, pk: str | None, upstream: list, settings=None) -> bool:
    """True when ``key`` (partition ``pk``) was materialized after every upstream record given."""
    record = _latest_record(instance, key, pk)
    if record is None:
        return False
    if any(u is not None and u.storage_id > record.storage_id for u in upstream):
        return False
    if key == "completions" and settings is not None:
        meta = {k: getattr(v, "value", v) for k, v in record.asset_materialization.metadata.items()}
        return affected_reason(meta, settings) is None
    return True


# Console level of the runs' Dagster logger: INFO shows the assets' own progress lines and warnings; Dagster's
# DEBUG events (step start/output, check evaluations, ...) still go to the run storage (UI). `run --verbose`: DEBUG.
CONSOLE_LOG_LEVEL = {"level": "INFO"}


def console_logger_config(level: str | None = None) -> dict:
    """Run-config ``loggers`` section for Dagster's default console logger at ``level`` (default: the CLI's)."""
    return {"console": {"config": {"log_level": level or CONSOLE_LOG_LEVEL["level"]}}}


def _materialize(
    keys: list[str], run_config: dict, partition_key: str | None = None, partition_range: tuple[str, str] | None = None
) -> dg.ExecuteInProcessResult:
    """One in-process run (of one partition, or of a key range as one run: single-run backfill). Raises
    KeyboardInterrupt when Ctrl-C / SIGTERM interrupted it: Dagster turns the signal into a failed run,
    and ``raise_on_error=False`` would otherwise let the loop go on."""
    # the full process record (machine, boot, pid namespace, start time): the reaper acts only on what it proves dead
    tags = {"dflash/trigger": "cli-run", **process_tags()}
    if partition_range is not None:
        tags.update(
            {ASSET_PARTITION_RANGE_START_TAG: partition_range[0], ASSET_PARTITION_RANGE_END_TAG: partition_range[1]}
        )
    result = dg.materialize(
        list(defs.assets),
        selection=keys,
        instance=dg.DagsterInstance.get(),
        resources=defs.resources,
        run_config={"loggers": console_logger_config(), **run_config},
        partition_key=partition_key,
        raise_on_error=False,
        tags=tags,
    )
    if was_interrupted(result):
        raise KeyboardInterrupt(f"run {result.run_id} was interrupted")
    return result


def was_interrupted(result: dg.ExecuteInProcessResult) -> bool:
    """Whether a step or the run failed with Dagster's interrupt (SIGINT / SIGTERM during execution)."""
    interrupt_errors = {"DagsterExecutionInterruptedError", "KeyboardInterrupt"}
    for event in result.all_events:
        error = getattr(event.event_specific_data, "error", None)
        if error is not None and error.cls_name in interrupt_errors:
            return True
        if event.event_type_value == "RUN_FAILURE" and "interrupted" in (event.message or ""):
            return True
    return False


def _feature_mode(instance, settings) -> str:
    """The drafter's feature source for this run (see :mod:`dflash_assets.feature_sources`); printed.
    Online: hidden_states is skipped and the drafter follows tokenized_sequences."""
    from dflash_assets.feature_sources import configured_mode, decide_mode

    mode, reason = decide_mode(
        instance,
        defs.resources["storage"],
        defs.resources["target_model"],
        configured_mode(),
        fallback_tokens_per_row=settings.max_output_tokens,
    )
    print(reason + ("; hidden_states is skipped" if mode == "online" else ""))
    return mode


def run_all(config_path_arg: str | None = None, dagster_home: str | None = None, verbose: bool = False) -> int:
    """Materialize what is not up to date and print the summary. Returns the exit code.

    ``verbose``: print Dagster's DEBUG events too (by default only INFO and above reach the terminal).
    """
    CONSOLE_LOG_LEVEL["level"] = "DEBUG" if verbose else "INFO"
    if config_path_arg:
        os.environ["DFLASH_CONFIG"] = os.path.abspath(config_path_arg)
    instance = dg.DagsterInstance.get()
    # servers a killed run left behind still hold their port and (GPU) memory: stop them first
    for entry in reap_orphaned_servers():
        print(orphan_message(entry))
    for run_id in reap_dead_runs(instance, by="`python -m dflash_assets run`"):
        print(f"run {run_id} was killed earlier: marked failed, its pool slots freed; resuming its partitions")
    started = time.monotonic()
    asset_names = {k.to_user_string() for k in defs.resolve_all_asset_keys()}
    print(f"config: {config_path()}\nDAGSTER_HOME: {dagster_home or os.environ.get('DAGSTER_HOME')}")
    did_work = []

    corpus_cfg = op_config("prompt_corpus")
    fingerprint = corpus_fingerprint(
        PromptCorpusConfig(**(corpus_cfg["ops"].get("prompt_corpus") or {}).get("config", {})),
        defs.resources["storage"],
    )
    record = _latest_record(instance, "prompt_corpus")
    if (
        record is None
        or record.asset_materialization.metadata.get("config_fingerprint", dg.TextMetadataValue("")).value
        != fingerprint
    ):
        result = _materialize(["prompt_corpus"], corpus_cfg)
        if not result.success:
            print("prompt_corpus failed; see the run log above")
            return 1
        did_work.append("prompt_corpus")
    keys = instance.get_dynamic_partitions(prompt_ranges.name)
    settings = defs.resources["generation"].settings()
    features = _feature_mode(instance, settings)
    stages = [s for s in PARTITION_STAGES if not (features == "online" and s == "hidden_states")]

    failed = []
    # completions of every partition that needs it in ONE run: the servers start once, requests stream
    # across partitions, each partition is committed as it completes (up-to-date ones in between are kept)
    corpus_record = _latest_record(instance, "prompt_corpus")
    generate = [
        pk
        for pk in keys
        if "completions" in asset_names and not stage_up_to_date(instance, "completions", pk, [corpus_record], settings)
    ]
    if generate:
        span = (generate[0], generate[-1])
        print(f"completions: {len(generate)} partitions in one run ({span[0]}...{span[1]})")
        before = {pk: getattr(_latest_record(instance, "completions", pk), "storage_id", None) for pk in generate}
        result = _materialize(["completions"], op_config("completions"), partition_range=span)
        # a partition the run did not commit (it failed before its last row) gets no later stages now
        failed = [
            pk
            for pk in generate
            if getattr(_latest_record(instance, "completions", pk), "storage_id", None) == before[pk]
        ]
        did_work += [f"completions[{pk}]" for pk in generate if pk not in failed]
    for pk in keys:
        if pk in failed:
            continue  # its completions run failed: the later stages would read stale rows
        todo, upstream = [], [_latest_record(instance, "prompt_corpus")]
        for stage in stages:
            if stage not in asset_names:
                continue
            if stage == "completions":  # done above, for all partitions in one run
                upstream = [_latest_record(instance, stage, pk)]
                continue
            if todo or not stage_up_to_date(instance, stage, pk, upstream, settings):
                todo.append(stage)
            upstream = [_latest_record(instance, stage, pk)]
        if not todo:
            continue
        print(f"{pk}: materializing {', '.join(todo)}")
        result = _materialize(todo, op_config(*todo), partition_key=pk)
        did_work += [f"{s}[{pk}]" for s in todo]
        if not result.success:
            failed.append(pk)
    if failed:
        print(f"partitions failed: {failed}; rerun the same command to resume them (finished rows are kept)")
        return 1

    for stage in FINAL_STAGES:
        if stage not in asset_names:
            continue
        upstream_key = {
            "truncation_report": "completions",
            "dflash_drafter": stages[-1],
            "drafter_evaluation": "dflash_drafter",
        }[stage]
        upstream = (
            [_latest_record(instance, upstream_key, pk) for pk in keys]
            if upstream_key != "dflash_drafter"
            else [_latest_record(instance, upstream_key)]
        )
        settings_cls = {"dflash_drafter": DrafterConfig, "drafter_evaluation": EvaluationConfig}.get(stage)
        changed = settings_cls is not None and config_changed_since_last(
            instance, stage, settings_cls(**((op_config(stage)["ops"].get(stage) or {}).get("config") or {}))
        )
        if stage_up_to_date(instance, stage, None, upstream) and not changed:
            continue
        print(f"materializing {stage}")
        result = _materialize([stage], op_config(stage))
        did_work.append(stage)
        if not result.success:
            print(f"{stage} failed; see the run log above")
            return 1
    from dflash_assets.summary import collect_summary, format_summary

    summary = collect_summary(instance, keys, ran=did_work)
    print(format_summary(summary))
    if did_work:
        print(f"\nmaterialized {len(did_work)} steps in {time.monotonic() - started:.0f}s")
    else:
        print("\neverything is up to date: no generation, extraction or training work was done")
    return 0
