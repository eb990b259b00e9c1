"""``drafter_evaluation``'s engine mode: tau as SGLang itself reports it, with the exported drafter loaded.

:func:`plan_engine` decides the servers and flags and checks the export by SGLang's loader rules
(:func:`dflash_assets.dflash.export.sglang_check.check_dflash_export`) before anything starts, so an export SGLang
would refuse costs no GPU time; :func:`run_engine` starts the servers through the inference resource's own
launcher (``engine: sglang``: the completions servers' settings plus the DFLASH flags) or uses running ones
(``engine: external``), decodes the evaluation prompts greedily, and returns the report section;
:func:`engine_metadata` turns it into metadata. A simulated engine (the GPU-node simulator says
``"simulated": true`` in ``/server_info``) is plumbing: its figures are kept under ``simulated_*`` keys and
in a table of their own, never beside the in-process figures as a measurement.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg

from dflash_assets.dflash.export.sglang_check import ExportCheck, check_dflash_export, is_hybrid_target
from dflash_assets.generation.api.urls import redact
from dflash_assets.generation.engines.environments import EngineEnvironment
from dflash_assets.generation.servers.registry import orphan_message, reap_orphaned_servers
from dflash_assets.generation.servers.sglang_dflash import (
    EngineError,
    EnginePrompt,
    dflash_server_flags,
    engine_generate,
    engine_tau_by_dataset,
    mamba_strategy_for,
    ngram_server_flags,
    server_info,
)
from dflash_assets.generation.servers.sglang_servers import SGLangServers
from dflash_assets.stages.evaluation.vllm_run import VLLMPlan, plan_vllm

FLAGS_READ_FROM = "0.5.23"
SIMULATED_LABEL = (
    "SIMULATED engine (the GPU-node simulator): checks the plumbing (flags, the export's refusal rules, "
    "the per-request fields); its acceptance lengths are simulated, not a measurement"
)


@dataclass
class EnginePlan:
    """What engine mode will run: ``kind`` (sglang | external), the DFLASH ``flags``, the launch commands
    (sglang) or ``base_urls`` (external), the directory whose ``config.json`` is the served target, and the
    export check's result."""

    kind: str
    flags: list[str]
    target_dir: Path
    commands: list = field(default_factory=list)
    base_urls: list[str] = field(default_factory=list)
    check: ExportCheck | None = None
    num_draft_tokens: int = 16
    ngram_flags: list[str] = field(default_factory=list)  # the n-gram baseline's (recorded, not run)
    ngram_commands: list = field(default_factory=list)

    def launch_lines(self) -> list[str]:
        """Each server's command line with the API key shown as ``$VARIABLE`` (never its value)."""
        return [c.redacted() for c in self.commands]

    def fingerprint_parts(self) -> list:
        return [self.kind, self.flags, self.launch_lines(), self.base_urls]


def plan_engine(config, inference, target_model, export_dir: str, log) -> EnginePlan | VLLMPlan | None:
    """The engine run ``config`` asks for, checked; None for ``engine: none``.

    Raises:
        dagster.Failure: a setting that cannot work (``engine: sglang`` without ``inference.mode: sglang``,
            ``external`` without URLs) or an export SGLang would refuse: every reason, with the field or
            tensor and the fix, before any server or model is started.
    """
    if config.engine == "none":
        return None
    if config.engine == "vllm":
        return plan_vllm(config, target_model, export_dir, log)
    export = json.loads((Path(export_dir) / "config.json").read_text())
    block = int((export.get("dflash_config") or {}).get("block_size") or export.get("block_size") or 16)
    n = config.num_draft_tokens if config.num_draft_tokens is not None else block
    if config.engine == "sglang":
        if config.engine_python:
            raise dg.Failure(
                "drafter_evaluation.engine_python names vLLM's interpreter (engine: vllm); engine: sglang starts the "
                "servers of resources.inference from SGLang's environment: set resources.inference.sglang.python "
                "instead"
            )
        if inference.mode != "sglang":
            raise dg.Failure(
                f"drafter_evaluation.engine: sglang starts the servers of resources.inference, whose mode is "
                f"{inference.mode!r}: set resources.inference.mode: sglang (and sglang.model_path), or use engine: "
                "external with engine_base_urls"
            )
        target_dir, tp = Path(inference.sglang.model_path), inference.sglang.tp_size
    else:
        if not config.engine_base_urls:
            raise dg.Failure(
                "drafter_evaluation.engine: external needs engine_base_urls (SGLang servers already "
                "running with this export as --speculative-draft-model-path)"
            )
        target_dir, tp = target_model.resolved_path(), 1
    try:
        target = json.loads((target_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise dg.Failure(
            f"drafter_evaluation.engine: the target's {target_dir / 'config.json'} is unreadable "
            f"({type(exc).__name__}: {exc}); SGLang could not serve it either"
        ) from None
    mamba = mamba_strategy_for(
        target, None if config.mamba_radix_cache_strategy == "from_target" else config.mamba_radix_cache_strategy
    )
    backend = None if config.draft_attention_backend == "sglang_default" else config.draft_attention_backend
    flags = dflash_server_flags(
        export_dir, n, draft_attention_backend=backend, mamba_strategy=mamba, draft_window_size=config.draft_window_size
    ) + list(config.engine_extra_args)
    check = check_dflash_export(
        export_dir, target_dir=target_dir, tp_size=tp, num_draft_tokens=n, draft_window_size=config.draft_window_size
    )
    for line in check.warnings:
        log.warning(f"engine: {line}")
    if not check.ok:
        reasons = "\n".join(f"  - {r}" for r in check.refusals)
        raise dg.Failure(
            f"drafter_evaluation: SGLang would not load {export_dir} as a DFlash drafter (rules read from SGLang "
            f"{FLAGS_READ_FROM}'s loader); refused before any server started:\n{reasons}"
        )
    if is_hybrid_target(target) and mamba is None:
        log.warning("engine: the target has linear-attention layers and no mamba strategy is passed")
    plan = EnginePlan(
        config.engine, flags, target_dir, check=check, num_draft_tokens=n, base_urls=list(config.engine_base_urls)
    )
    if config.ngram_baseline:
        plan.ngram_flags = ngram_server_flags(n)
    if config.engine == "sglang":
        plan.commands = inference.sglang_commands(extra_args=flags, use_router=False)
        if plan.ngram_flags:
            plan.ngram_commands = inference.sglang_commands(extra_args=plan.ngram_flags, use_router=False)
        if environment := inference.sglang_environment(use_router=False):
            _warn_on_old_sglang(environment, log)
    return plan


def _warn_on_old_sglang(environment: EngineEnvironment, log) -> None:
    """Warn when SGLang's environment holds a release older than the one the DFLASH flags were read from: the
    pinned version, or the one installed in a given interpreter (``inference.sglang.python``)."""
    from packaging.version import InvalidVersion, Version

    if environment.python:
        proc = subprocess.run(
            [environment.python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=120,
        )
        if proc.returncode != 0:
            log.warning(f"engine: sglang is not installed in {environment.python}; the servers will not start")
            return
        version = proc.stdout.strip()
    else:
        pins = [r.split("==", 1)[1] for r in environment.requirements if r.replace(" ", "").startswith("sglang==")]
        if not pins:
            return
        version = pins[0]
    try:
        if Version(version) < Version("0.5.15"):
            log.warning(
                f"engine: SGLang {version} serves; the DFLASH flags were read from {FLAGS_READ_FROM} "
                "(older releases name the mamba flag --mamba-scheduler-strategy)"
            )
    except InvalidVersion:
        log.warning(f"engine: SGLang's version {version!r} is not a version; the DFLASH flags may not match it")


def run_engine(
    plan: EnginePlan,
    inference,
    prompts: dict[str, list[list[int]]],
    max_new_tokens: int,
    stop_token_ids: list[int],
    log_dir: str,
    config,
    log,
) -> dict[str, Any]:
    """Decode ``prompts`` (dataset -> token ids) on the engine and return the report's ``engine`` section.

    Raises:
        dagster.Failure: the servers did not start (the log tail says why), a request failed, or the engine
            reports no speculative fields (it is not running DFLASH).
    """
    todo = [EnginePrompt(name, i, tuple(ids)) for name, rows in prompts.items() for i, ids in enumerate(rows)]
    api_key = inference.api_key

    def decode(urls: list[str]) -> tuple[list[dict], list[dict]]:
        infos = [server_info(u, api_key) for u in urls]
        log.info(f"engine: {len(todo)} prompts on {len(urls)} server(s), {max_new_tokens} new tokens each, greedy")
        records = engine_generate(
            urls,
            todo,
            max_new_tokens,
            stop_token_ids=stop_token_ids,
            api_key=api_key,
            concurrency=config.engine_concurrency,
            timeout_s=config.engine_request_timeout_s,
        )
        return infos, records

    try:
        if plan.kind == "sglang":
            for entry in reap_orphaned_servers():
                log.warning(orphan_message(entry))
            for line in plan.launch_lines():
                log.info(f"engine: starting {line}")
            if environment := inference.sglang_environment(use_router=False):  # made on first use (minutes)
                environment.ensure(log.info)
            with SGLangServers(plan.commands, log_dir, api_key, inference.startup_timeout_s) as servers:
                infos, records = decode(servers.base_urls)
        else:
            infos, records = decode(plan.base_urls)
    except (RuntimeError, TimeoutError, EngineError) as exc:
        raise dg.Failure(f"drafter_evaluation engine: {redact(str(exc), api_key)}") from None
    if not any(r.get("spec_verify_ct") for r in records):
        raise dg.Failure(
            "drafter_evaluation engine: no reply carried meta_info.spec_accept_length / spec_verify_ct: the "
            "engine is not running --speculative-algorithm DFLASH (server_info: "
            f"{json.dumps(infos)[:400]})"
        )
    simulated = any(i.get("simulated") is True for i in infos)
    for i, info in enumerate(infos):
        if info.get("speculative_algorithm") not in (None, "DFLASH"):
            raise dg.Failure(
                f"drafter_evaluation engine: server {i} runs speculative_algorithm "
                f"{info.get('speculative_algorithm')!r}, not DFLASH"
            )
    return {
        "kind": plan.kind,
        "simulated": simulated,
        "label": SIMULATED_LABEL if simulated else "SGLang (real engine)",
        "dflash_flags": plan.flags,
        "server_flags": plan.launch_lines() or None,
        "server_info": infos,
        "flags_read_from_sglang": FLAGS_READ_FROM,
        "num_draft_tokens": plan.num_draft_tokens,
        "export_check_warnings": plan.check.warnings if plan.check else [],
        "datasets": engine_tau_by_dataset(records),
        "requests": records,
        **(
            {
                "ngram": {
                    "run": False,
                    "why": "SGLang's n-gram baseline is not run yet: its flags, read from SGLang "
                    f"{FLAGS_READ_FROM}'s server arguments, are untested on a GPU",
                    "ngram_flags": plan.ngram_flags,
                    "server_flags": [c.redacted() for c in plan.ngram_commands] or None,
                    "tokens_per_forward_definition": "completion_tokens / (spec_verify_ct + 1): NGRAM verifies "
                    "every decode step (a step without a match is padded), the prefill yields the first token",
                }
            }
            if plan.ngram_flags
            else {}
        ),
        "tau_definition": "per dataset: mean over requests of the engine's meta_info.spec_accept_length "
        "(completion_tokens / "
        "spec_verify_ct, the prefill's token included; z-lab's benchmark) and pooled (all completion_tokens / "
        "all spec_verify_ct); tau_without_prefill_token leaves each request's prefill token out, as the "
        "in-process figure does",
    }


def _r(x, nd: int = 4):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), nd)


def engine_metadata(section: dict[str, Any], in_process: dict[str, dict] | None) -> dict[str, Any]:
    """Metadata of the engine section: a real engine's tau per dataset beside the in-process figure
    (``engine_tau``...); a simulated one's under ``simulated_engine_*`` and a table of its own."""
    sim = section["simulated"]
    prefix = "simulated_engine" if sim else "engine"
    by_dataset = {
        name: {
            "requests": d["requests"],
            "requests_measured": d["requests_measured"],
            "tau": _r(d["tau"]),
            "tau_stderr": _r(d["tau_stderr"]),
            "tau_pooled": _r(d["tau_pooled"]),
            "tau_pooled_stderr": _r(d["tau_pooled_stderr"]),
            "tau_without_prefill_token": _r(d.get("tau_without_prefill_token")),
        }
        for name, d in section["datasets"].items()
    }
    head = by_dataset.get("heldout") or next(iter(by_dataset.values()), {})
    if sim:
        table = (
            f"**{SIMULATED_LABEL}.**\n\n| dataset | requests | simulated tau | simulated pooled |\n|---|---|---|---|\n"
            + "".join(f"| {n} | {d['requests']} | {d['tau']} | {d['tau_pooled']} |\n" for n, d in by_dataset.items())
        )
    elif section["kind"] == "vllm":
        table = (
            "| dataset | requests | vLLM tau (1 + accepted / drafts) | vLLM pooled | in-process tau |\n"
            "|---|---|---|---|---|\n"
            + "".join(
                f"| {n} | {d['requests']} | {d['tau']} +- {d['tau_stderr']} | {d['tau_pooled']} | "
                f"{(in_process or {}).get(n, {}).get('tau', '-')} |\n"
                for n, d in by_dataset.items()
            )
        )
    else:
        table = (
            "| dataset | requests | SGLang tau (spec_accept_length) | SGLang pooled | in-process tau "
            "|\n|---|---|---|---|---|\n"
            + "".join(
                f"| {n} | {d['requests']} | {d['tau']} +- {d['tau_stderr']} | {d['tau_pooled']} | "
                f"{(in_process or {}).get(n, {}).get('tau', '-')} |\n"
                for n, d in by_dataset.items()
            )
        )
    return {
        "engine_kind": section["kind"],
        "engine_simulated": sim,
        "engine_label": section["label"],
        f"{prefix}_tau": head.get("tau"),
        f"{prefix}_tau_stderr": head.get("tau_stderr"),
        f"{prefix}_tau_pooled": head.get("tau_pooled"),
        f"{prefix}_tau_by_dataset": by_dataset,
        "engine_requests": sum(d["requests"] for d in by_dataset.values()),
        # prompts with a figure (no error, a verification step): the only ones any tau above counts
        "engine_requests_measured": sum(d["requests_measured"] for d in by_dataset.values()),
        "engine_server_flags": section["server_flags"] or section.get("dflash_flags"),
        "engine_table": dg.MetadataValue.md(table),
    }


def engine_fingerprint(plan: EnginePlan | VLLMPlan | None) -> str | None:
    """16 hex naming the engine run (flags, commands, URLs), for the evaluation's reuse check."""
    if plan is None:
        return None
    return hashlib.sha256(json.dumps(plan.fingerprint_parts(), default=str).encode()).hexdigest()[:16]


__all__ = ["SIMULATED_LABEL", "EnginePlan", "engine_fingerprint", "engine_metadata", "plan_engine", "run_engine"]
