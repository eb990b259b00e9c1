"""The main job: materialize every stage into the persistent Dagster instance, skipping what is up to date.

Order: prompt_corpus; for each partition completions -> tokenized_sequences -> hidden_states;
truncation_report; dflash_drafter; drafter_evaluation. What is up to date is decided by
:mod:`dflash_assets.orchestration.freshness` (the one rule ``status``, the schedule and the sensor use too). Every
partition reported failed carries its reason: the failed step's error, or why the run left it not up to
date. Ends with a summary read back from the assets' metadata.
"""

import os
import time
from collections import Counter

import dagster as dg

# private module: dagster 1.13 exports no public name for these run tags
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from dflash_assets.app.cost_report import configured_bytes_per_token, cost_and_forecast, keep_forecast
from dflash_assets.app.stage_order import FINAL_STAGES, PARTITION_STAGES
from dflash_assets.assets.drafter import config_changed_since_last
from dflash_assets.assets.prompts import corpus_fingerprint
from dflash_assets.common.config import completions_mode, config_path, op_config
from dflash_assets.definitions import defs
from dflash_assets.generation.engines.environments import make_in_background
from dflash_assets.generation.engines.install import stop_installs, wait_for_installs
from dflash_assets.generation.servers.registry import orphan_message, reap_orphaned_servers
from dflash_assets.orchestration import check_gate, freshness
from dflash_assets.orchestration.history import latest_record, plain_metadata
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.orchestration.runs import process_tags, reap_dead_runs
from dflash_assets.stages.drafter.config import DrafterConfig
from dflash_assets.stages.evaluation.config import EvaluationConfig
from dflash_assets.stages.evaluation.vllm_run import evaluation_environment, prepare_in_background
from dflash_assets.stages.prompts import CORPUS_FILE, PromptCorpusConfig
from dflash_assets.stages.resources.generation import served_settings


def other_storage_root(corpus_meta: dict | None, corpus_uri: str, dagster_home: str | None) -> str | None:
    """Why this run must not use this instance, or None: its run history (partition keys, materializations) was
    made with a corpus at another storage root. Building here would replace that config's partition keys, and
    its summary, freshness and evaluation would then judge one root's files by the other's history."""
    before = (corpus_meta or {}).get("path")
    if not before or before == corpus_uri:
        return None
    return (
        f"DAGSTER_HOME {dagster_home} holds the run history of the corpus at {before}; this config's corpus is "
        f"{corpus_uri}. One instance keeps one corpus's partition keys and history: give this config its own "
        "DAGSTER_HOME (mkdir runs/mine && cp dagster.yaml runs/mine/ && export DAGSTER_HOME=$PWD/runs/mine), "
        "or set its storage root back. Nothing was changed."
    )


def run_failure_reason(result: dg.ExecuteInProcessResult) -> str | None:
    """The errors of a run's failed steps (or of the run itself), first line of each, or None when none failed."""
    errors = []
    for event in result.all_events:
        if event.event_type_value in ("STEP_FAILURE", "RUN_FAILURE"):
            error = getattr(event.event_specific_data, "error", None)
            text = (error.message if error is not None else event.message) or ""
            lines = text.strip().splitlines()
            # a first line ending in ":" announces the next (a failed check: "...failed ...:\nasset: check")
            text = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
            if text and text not in errors:
                errors.append(text)
    return "; ".join(errors) or None


def partition_reason_in(error: str, pk: str, failed: list[str], limit: int = 600) -> str:
    """The part of a range run's ``error`` about partition ``pk`` (from ``"<pk>:"`` to the next failed
    partition's key), or the whole error when it names no partition; at most ``limit`` characters."""
    start = error.find(f"{pk}:")
    if start < 0:
        return error[:limit]
    ends = [e for other in failed if other != pk and (e := error.find(f"{other}:", start + 1)) > start]
    return error[start : min(ends, default=len(error))].rstrip("; ")[:limit]


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
    """The drafter's feature source for this run (see :mod:`dflash_assets.stages.drafter.features`); printed.
    Online: hidden_states is skipped and the drafter follows tokenized_sequences."""
    from dflash_assets.stages.drafter.features import configured_mode, decide_mode

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

    ``verbose``: print Dagster's DEBUG events too (by default only INFO and above reach the terminal). On every
    way out (an early failure too) an engine environment still installing in the background is waited for with
    a line saying so; Ctrl-C or an error stops its install instead (the next run resumes it).
    """
    installs: list = []
    try:
        return _run_all(config_path_arg, dagster_home, verbose, installs)
    except BaseException:
        stop_installs()
        raise
    finally:
        wait_for_installs(installs, print)


def _run_all(config_path_arg: str | None, dagster_home: str | None, verbose: bool, engine_environments: list) -> int:
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
    # an engine's own environment (vLLM, SGLang) installs (first use only) while the stages before its user run:
    # completions in inference mode vllm or sglang (which waits on the environment's file lock), drafter_evaluation
    inference = defs.resources["inference"]
    evaluation = EvaluationConfig(
        **(op_config("drafter_evaluation")["ops"].get("drafter_evaluation") or {}).get("config", {})
    )
    device = "cpu" if str(defs.resources["target_model"].device).startswith("cpu") else "cuda"
    if inference.mode == "vllm":
        engine_environments.append(make_in_background(inference.vllm_environment(), print, "(completions will retry)"))
    if inference.mode == "sglang" and (sglang := inference.sglang_environment()):  # SGLang's own torch: minutes
        engine_environments.append(make_in_background(sglang, print, "(completions will retry)"))
    if not (inference.mode == "vllm" and evaluation_environment(evaluation, device) == inference.vllm_environment()):
        engine_environments.append(prepare_in_background(evaluation, device=device))
    did_work = []

    corpus_cfg = op_config("prompt_corpus")
    fingerprint = corpus_fingerprint(
        PromptCorpusConfig(**(corpus_cfg["ops"].get("prompt_corpus") or {}).get("config", {})),
        defs.resources["storage"],
    )
    # EnvVar credentials resolve only in an initialized resource (outside a run, reading one raises)
    store = defs.resources["storage"].process_config_and_initialize().open()
    corpus_meta = plain_metadata(latest_record(instance, "prompt_corpus"))
    if problem := other_storage_root(corpus_meta, store.uri(*CORPUS_FILE), os.environ.get("DAGSTER_HOME")):
        print(problem)
        return 1
    if why := freshness.corpus_reason(corpus_meta, fingerprint) or freshness.output_reason(store, "prompt_corpus"):
        print(f"prompt_corpus: {why}: building it")
        result = _materialize(["prompt_corpus"], corpus_cfg)
        if not result.success:
            print(f"prompt_corpus failed: {run_failure_reason(result) or 'see the run log above'}")
            return 1
        did_work.append("prompt_corpus")
    keys = instance.get_dynamic_partitions(prompt_ranges.name)
    # judged with the servers' context: prompts set aside as too long are judged again when it changes
    settings = served_settings(defs.resources["generation"], inference, defs.resources["target_model"])
    features = _feature_mode(instance, settings)
    stages = [s for s in PARTITION_STAGES if not (features == "online" and s == "hidden_states")]

    failed: dict[str, str] = {}  # partition -> why it failed
    # completions of every partition that needs it in ONE run: the servers start once, requests stream
    # across partitions, each partition is committed as it completes (up-to-date ones in between are kept)
    reasons = (
        freshness.partition_reasons(instance, "completions", keys, settings, store=store, mode=completions_mode())
        if "completions" in asset_names
        else {}
    )
    generate = [pk for pk in keys if reasons.get(pk)]
    if generate:
        span = (generate[0], generate[-1])
        why = dict(Counter(reasons[pk] for pk in generate))
        print(f"completions: {len(generate)} partitions in one run ({span[0]}...{span[1]}): {why}")
        before = {pk: getattr(latest_record(instance, "completions", pk), "storage_id", None) for pk in generate}
        if note := keep_forecast(instance, defs.resources["storage"].open(), defs.resources["inference"]):
            print(note)  # the forecast from what is measured so far, for the report at the end (docs/cost.md)
        result = _materialize(["completions"], op_config("completions"), partition_range=span)
        # a partition the run did not commit and left not up to date gets no later stages now; say why for
        # each (one committed with error rows goes on: the next run retries those rows)
        error = run_failure_reason(result)
        after = freshness.completions_reasons(instance, generate, settings, mode=completions_mode())
        left = [
            pk
            for pk in generate
            if after[pk] and getattr(latest_record(instance, "completions", pk), "storage_id", None) == before[pk]
        ]
        for pk in left:
            failed[pk] = (
                partition_reason_in(error, pk, left)
                if error
                else f"the run made no new materialization of it, and it is still not up to date: "
                f"{after[pk]} (see the run log above)"
            )
        did_work += [f"completions[{pk}]" for pk in generate if pk not in failed]
    later = [s for s in stages if s in asset_names and s != "completions"]  # completions: done above, in one run
    # one read per stage for every partition: runs of other partitions cannot change a partition's answer
    stage_reasons = {
        stage: freshness.partition_reasons(instance, stage, keys, settings, upstream, store)
        for stage, upstream in zip(later, ["completions", *later])
    }
    for pk in keys:
        if pk in failed:
            continue  # its completions run failed: the later stages would read stale rows
        first = next((i for i, stage in enumerate(later) if stage_reasons[stage][pk]), None)
        if first is None:
            continue
        todo = later[first:]
        print(f"{pk}: materializing {', '.join(todo)} ({todo[0]}: {stage_reasons[todo[0]][pk]})")
        result = _materialize(todo, op_config(*todo), partition_key=pk)
        did_work += [f"{s}[{pk}]" for s in todo]
        if not result.success:
            # a blocking check that failed or raised: name the check (and the error, when it raised)
            held = check_gate.held_partitions(instance, [pk], todo)
            why = held.get(pk) or run_failure_reason(result) or f"run {result.run_id} failed (see the run log above)"
            failed[pk] = why[:600]
    if failed:
        print(f"partitions failed: {list(failed)}")
        for pk, why in failed.items():
            print(f"  {pk}: {why}")
        print("rerun the same command to resume them (finished rows are kept)")
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
            [latest_record(instance, upstream_key, pk) for pk in keys]
            if upstream_key != "dflash_drafter"
            else [latest_record(instance, upstream_key)]
        )
        settings_cls = {"dflash_drafter": DrafterConfig, "drafter_evaluation": EvaluationConfig}.get(stage)
        changed = settings_cls is not None and config_changed_since_last(
            instance, stage, settings_cls(**((op_config(stage)["ops"].get(stage) or {}).get("config") or {}))
        )
        why = freshness.after_upstream_reason(latest_record(instance, stage), upstream) or (
            "its config changed" if changed else freshness.output_reason(store, stage)
        )
        if why is None:
            continue
        print(f"materializing {stage} ({why})")
        result = _materialize([stage], op_config(stage))
        did_work.append(stage)
        if not result.success:
            print(f"{stage} failed; see the run log above")
            return 1
    wait_for_installs(engine_environments, print)  # before the summary, so no install line cuts into it
    from dflash_assets.app.summary import collect_summary, format_summary

    summary = collect_summary(instance, keys, ran=did_work)
    print(format_summary(summary))
    resources = defs.resources
    store, price = resources["storage"].open(), resources["cost"].device_hour_usd
    per_token = configured_bytes_per_token(resources["target_model"].model_path)
    print("\n" + cost_and_forecast(instance, store, resources["inference"], price, None, per_token))
    if did_work:
        print(f"\nmaterialized {len(did_work)} steps in {time.monotonic() - started:.0f}s")
    else:
        print("\neverything is up to date: no generation, extraction or training work was done")
    return 0
