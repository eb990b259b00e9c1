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
    """The main job's steps in order (:class:`MainJob`); the exit code: 1 when a step stops the run."""
    CONSOLE_LOG_LEVEL["level"] = "DEBUG" if verbose else "INFO"
    if config_path_arg:
        os.environ["DFLASH_CONFIG"] = os.path.abspath(config_path_arg)
    job = MainJob(dg.DagsterInstance.get())
    job.reap_what_killed_runs_left()
    job.started = time.monotonic()
    print(f"config: {config_path()}\nDAGSTER_HOME: {dagster_home or os.environ.get('DAGSTER_HOME')}")
    job.start_engine_installs(engine_environments)
    if not job.build_corpus():
        return 1
    job.plan_partitions()
    job.generate_completions()
    job.run_later_stages()
    if job.failed:
        job.print_failed()
        return 1
    if not job.run_final_stages():
        return 1
    wait_for_installs(engine_environments, print)  # before the summary, so no install line cuts into it
    job.print_summary()
    return 0


class MainJob:
    """One ``python -m dflash_assets run``, step by step (:func:`_run_all` calls them in order): what killed runs
    left is reaped; the engines' environments install in the background; the corpus is built when stale; the
    completions of every partition that needs them run as one range run; then, partition by partition, the later
    per-partition stages from the first one not up to date; then the final stages; then the summary. ``did_work``
    lists the steps materialized, ``failed`` the partitions that failed and why."""

    def __init__(self, instance: dg.DagsterInstance) -> None:
        self.instance = instance
        self.started = time.monotonic()
        self.asset_names = {k.to_user_string() for k in defs.resolve_all_asset_keys()}
        self.did_work: list[str] = []
        self.failed: dict[str, str] = {}  # partition -> why it failed
        self.store = None
        self.keys: list[str] = []
        self.settings = None
        self.stages: list[str] = []

    def reap_what_killed_runs_left(self) -> None:
        """Servers a killed run left behind still hold their port and (GPU) memory: stop them first; mark killed
        runs failed (their pool slots freed)."""
        for entry in reap_orphaned_servers():
            print(orphan_message(entry))
        for run_id in reap_dead_runs(self.instance, by="`python -m dflash_assets run`"):
            print(f"run {run_id} was killed earlier: marked failed, its pool slots freed; resuming its partitions")

    def start_engine_installs(self, engine_environments: list) -> None:
        """An engine's own environment (vLLM, SGLang) installs (first use only) while the stages before its user
        run: completions in inference mode vllm or sglang (which waits on the environment's file lock),
        drafter_evaluation. Each background install is appended to ``engine_environments`` as it starts."""
        inference = defs.resources["inference"]
        evaluation = EvaluationConfig(
            **(op_config("drafter_evaluation")["ops"].get("drafter_evaluation") or {}).get("config", {})
        )
        device = "cpu" if str(defs.resources["target_model"].device).startswith("cpu") else "cuda"
        if inference.mode == "vllm":
            engine_environments.append(
                make_in_background(inference.vllm_environment(), print, "(completions will retry)")
            )
        if inference.mode == "sglang" and (sglang := inference.sglang_environment()):  # SGLang's own torch: minutes
            engine_environments.append(make_in_background(sglang, print, "(completions will retry)"))
        if not (
            inference.mode == "vllm" and evaluation_environment(evaluation, device) == inference.vllm_environment()
        ):
            engine_environments.append(prepare_in_background(evaluation, device=device))

    def build_corpus(self) -> bool:
        """Build ``prompt_corpus`` when its sources or output changed; False (said why) when this instance holds
        another storage root's history or the build failed."""
        corpus_cfg = op_config("prompt_corpus")
        fingerprint = corpus_fingerprint(
            PromptCorpusConfig(**(corpus_cfg["ops"].get("prompt_corpus") or {}).get("config", {})),
            defs.resources["storage"],
        )
        # EnvVar credentials resolve only in an initialized resource (outside a run, reading one raises)
        self.store = store = defs.resources["storage"].process_config_and_initialize().open()
        corpus_meta = plain_metadata(latest_record(self.instance, "prompt_corpus"))
        if problem := other_storage_root(corpus_meta, store.uri(*CORPUS_FILE), os.environ.get("DAGSTER_HOME")):
            print(problem)
            return False
        if why := freshness.corpus_reason(corpus_meta, fingerprint) or freshness.output_reason(store, "prompt_corpus"):
            print(f"prompt_corpus: {why}: building it")
            result = _materialize(["prompt_corpus"], corpus_cfg)
            if not result.success:
                print(f"prompt_corpus failed: {run_failure_reason(result) or 'see the run log above'}")
                return False
            self.did_work.append("prompt_corpus")
        return True

    def plan_partitions(self) -> None:
        """The partitions, the generation settings the rows are judged by, and the per-partition stages (no
        ``hidden_states`` when the drafter's features are online)."""
        self.keys = self.instance.get_dynamic_partitions(prompt_ranges.name)
        # judged with the servers' context: prompts set aside as too long are judged again when it changes
        inference = defs.resources["inference"]
        self.settings = served_settings(defs.resources["generation"], inference, defs.resources["target_model"])
        features = _feature_mode(self.instance, self.settings)
        self.stages = [s for s in PARTITION_STAGES if not (features == "online" and s == "hidden_states")]

    def generate_completions(self) -> None:
        """The completions of every partition that needs them in ONE run: the servers start once, requests stream
        across partitions, each partition is committed as it completes (up-to-date ones in between are kept). A
        partition the run did not commit and left not up to date goes to ``failed``, with why."""
        instance, settings = self.instance, self.settings
        reasons = (
            freshness.partition_reasons(
                instance, "completions", self.keys, settings, store=self.store, mode=completions_mode()
            )
            if "completions" in self.asset_names
            else {}
        )
        generate = [pk for pk in self.keys if reasons.get(pk)]
        if not generate:
            return
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
            self.failed[pk] = (
                partition_reason_in(error, pk, left)
                if error
                else f"the run made no new materialization of it, and it is still not up to date: "
                f"{after[pk]} (see the run log above)"
            )
        self.did_work += [f"completions[{pk}]" for pk in generate if pk not in self.failed]

    def run_later_stages(self) -> None:
        """Partition by partition, the per-partition stages after completions from the first one not up to date;
        a run that fails puts the partition in ``failed``, naming the check that holds it or the error."""
        instance = self.instance
        later = [s for s in self.stages if s in self.asset_names and s != "completions"]  # completions: done
        # one read per stage for every partition: runs of other partitions cannot change a partition's answer
        stage_reasons = {
            stage: freshness.partition_reasons(instance, stage, self.keys, self.settings, upstream, self.store)
            for stage, upstream in zip(later, ["completions", *later])
        }
        for pk in self.keys:
            if pk in self.failed:
                continue  # its completions run failed: the later stages would read stale rows
            first = next((i for i, stage in enumerate(later) if stage_reasons[stage][pk]), None)
            if first is None:
                continue
            todo = later[first:]
            print(f"{pk}: materializing {', '.join(todo)} ({todo[0]}: {stage_reasons[todo[0]][pk]})")
            result = _materialize(todo, op_config(*todo), partition_key=pk)
            self.did_work += [f"{s}[{pk}]" for s in todo]
            if not result.success:
                # a blocking check that failed or raised: name the check (and the error, when it raised)
                held = check_gate.held_partitions(instance, [pk], todo)
                why = (
                    held.get(pk) or run_failure_reason(result) or f"run {result.run_id} failed (see the run log above)"
                )
                self.failed[pk] = why[:600]

    def print_failed(self) -> None:
        print(f"partitions failed: {list(self.failed)}")
        for pk, why in self.failed.items():
            print(f"  {pk}: {why}")
        print("rerun the same command to resume them (finished rows are kept)")

    def run_final_stages(self) -> bool:
        """Each final stage (truncation report, drafter, evaluation) whose upstream, config or output changed;
        False when one fails."""
        instance, keys = self.instance, self.keys
        for stage in FINAL_STAGES:
            if stage not in self.asset_names:
                continue
            upstream_key = {
                "truncation_report": "completions",
                "dflash_drafter": self.stages[-1],
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
                "its config changed" if changed else freshness.output_reason(self.store, stage)
            )
            if why is None:
                continue
            print(f"materializing {stage} ({why})")
            result = _materialize([stage], op_config(stage))
            self.did_work.append(stage)
            if not result.success:
                print(f"{stage} failed; see the run log above")
                return False
        return True

    def print_summary(self) -> None:
        """The summary read back from the assets' metadata, the cost and forecast, and what this run did."""
        from dflash_assets.app.summary import collect_summary
        from dflash_assets.app.summary_lines import format_summary

        summary = collect_summary(self.instance, self.keys, ran=self.did_work)
        print(format_summary(summary))
        resources = defs.resources
        store, price = resources["storage"].open(), resources["cost"].device_hour_usd
        per_token = configured_bytes_per_token(resources["target_model"].model_path)
        print("\n" + cost_and_forecast(self.instance, store, resources["inference"], price, None, per_token))
        if self.did_work:
            print(f"\nmaterialized {len(self.did_work)} steps in {time.monotonic() - self.started:.0f}s")
        else:
            print("\neverything is up to date: no generation, extraction or training work was done")
