"""The evaluation in this process, in named phases: the drafter loaded as trained; the engine's outputs replayed
step by step (after a real vLLM run: :mod:`~dflash_assets.stages.evaluation.replay`) or, without one, speculative
vs plain decoding here (an untrained drafter beside it when ``untrained_baseline`` is set); the teacher-forced
estimates on the held-out rows; the report's and the metadata's in-process parts."""

import math
import time

import dagster as dg
import torch

from dflash_assets.common.progress import StageProgressBar
from dflash_assets.dflash.decoding.acceptance import acceptance_length
from dflash_assets.dflash.decoding.engine_replay import numeric_tolerance, with_context_k_norm_of_layer0
from dflash_assets.dflash.decoding.evaluation import acceptance_histogram_png, evaluate_drafters, untrained_drafter_like
from dflash_assets.dflash.decoding.teacher_forced import teacher_forced_acceptance, teacher_forced_chain
from dflash_assets.dflash.export.directory import load_exported
from dflash_assets.dflash.model.draft_model import load_target_head
from dflash_assets.dflash.training.online import OnlineTargetFeatures
from dflash_assets.orchestration.metadata import png_markdown
from dflash_assets.stages.evaluation.baseline import in_process_forward_figures
from dflash_assets.stages.evaluation.datasets import HELDOUT
from dflash_assets.stages.evaluation.replay import replay_engine_datasets
from dflash_assets.stages.evaluation.vllm_probe import LAYER_0
from dflash_assets.stages.resources.target_model import TargetModelResource

REPORT_DIR = "drafter_evaluation"


def _r(x, nd: int = 4):
    return None if x is None or x != x else round(float(x), nd)


def in_process_evaluation(
    log,
    config,
    store,
    target_model: TargetModelResource,
    export_dir: str,
    train_meta: dict,
    prompts: dict[str, list[list[int]]],
    eos: list[int],
    heldout_set,
    online: bool,
    engine_positions: dict[str, list[float]] | None = None,
    engine_section: dict | None = None,
) -> dict:
    """The report's and the metadata's in-process parts (``{"report": ..., "metadata": ...}``).

    With a real vLLM ``engine_section`` the engine's drafter outputs are replayed here (the in-process figures are
    this drafter's own chain over them, and each engine step is compared: the ``engine_parity`` check); otherwise
    speculative vs plain decoding runs here (and the untrained drafter's, ``config.untrained_baseline``; without it
    its ``untrained`` entries and ``*_untrained`` figures are absent). Then the teacher-forced chain on the held-out
    rows. ``online``: ``heldout_set`` holds tokenized rows, whose features the frozen target computes here.
    ``engine_positions``: the engine's acceptance per draft position per decode step on the held-out prompts, by
    label, drawn beside the trained drafter's in ``acceptance.png``."""
    drafters, target = _load(config, target_model, export_dir, train_meta)
    drafter = drafters["trained"]
    if online:  # online drafters have no shards: the frozen target computes the held-out rows' features
        heldout_set.attach(OnlineTargetFeatures(target, drafter.config.target_layer_ids))
    with torch.no_grad():
        if _replayable(engine_section):
            results = _replay(log, target, drafters, prompts, engine_section, target_model.dtype)
        else:
            results = _decode(log, config, target, drafters, prompts, eos)
        log.info(f"teacher-forced chain estimate on {len(heldout_set)} held-out rows")
        chains = {
            who: teacher_forced_chain(d, heldout_set, max_new_tokens=config.max_new_tokens)
            for who, d in drafters.items()
        }
        uniform = teacher_forced_acceptance(drafter, heldout_set, max_anchors=config.teacher_forced_anchors)
    return _parts(log, store, results, chains, uniform, drafter.config.block_size, engine_positions)


def _load(config, target_model: TargetModelResource, export_dir: str, train_meta: dict):
    """``({"trained": drafter[, "untrained": one of its shape]}, target)``: the export decoded with the settings it
    trained with (an export that wrote others then disagrees with the engine: ``engine_parity``)."""
    embed, lm_head = load_target_head(target_model.resolved_path())
    trained = {
        k: train_meta[k] for k in ("target_layer_ids", "block_size", "mask_token_id") if train_meta.get(k) is not None
    }
    drafter = load_exported(export_dir, embed_weight=embed, lm_head_weight=lm_head, overrides=trained).eval()
    drafters = {"trained": drafter}
    if config.untrained_baseline:  # the floor (tau ~1.00), opt-in: it costs ~40% of the decoding here
        drafters["untrained"] = untrained_drafter_like(drafter, seed=int(train_meta.get("seed", 0)))
    return drafters, target_model.load_model()


def _replayable(engine_section: dict | None) -> bool:
    """A real vLLM run whose records carry each prompt's verification steps."""
    section = engine_section or {}
    return (
        section.get("kind") == "vllm"
        and not section.get("simulated")
        and any("steps" in r for r in section.get("requests") or [])
    )


def _replay(log, target, drafters: dict, prompts, engine_section: dict, dtype: str) -> dict[str, dict]:
    """Every engine drafter record replayed here; ``{dataset: {"trained": entry[, "untrained": entry]}}``: the
    untrained drafter (when loaded) replayed over the same outputs, its own chain of anchors the floor beside the
    trained one's (its step parity means nothing: vLLM served the trained drafter)."""
    drafter = drafters["trained"]
    if engine_section.get("context_k_norm") == LAYER_0:
        drafter = with_context_k_norm_of_layer0(drafter)
        log.info("replaying with layer 0's k_norm on every layer's context keys, as this vLLM build computes it")
    tolerance = numeric_tolerance(getattr(torch, str(dtype), torch.float32))
    total = sum(len(v) for v in prompts.values())
    # the untrained floor (when loaded) rides on the same target forwards
    replayed_drafters = {
        "trained": drafter,
        **({"untrained": drafters["untrained"]} if "untrained" in drafters else {}),
    }
    log.info(
        f"replaying the engine's {total} outputs here (one target forward each for {', '.join(replayed_drafters)}; "
        f"tolerance {tolerance} logits)"
    )
    started = time.monotonic()
    with StageProgressBar("drafter_evaluation replay", total, unit="prompt") as bar:
        results = replay_engine_datasets(
            target, replayed_drafters, prompts, engine_section["requests"], tolerance,
            progress=lambda d, t: bar.update_to(d), log=log.info,
        )  # fmt: skip
    for name, entries in results.items():
        s = entries["trained"]["step_parity"]
        log.info(
            f"replay {name}: {s['prompts_replayed']} prompts, {s['steps_compared']} engine steps, "
            f"{s['mismatches']} mismatches, {s['ties']} ties; {s['wall_s']:.0f} s"
        )
    log.info(f"replay: {time.monotonic() - started:.0f} s in all")
    return results


def _decode(log, config, target, drafters: dict, prompts, eos) -> dict[str, dict]:
    """Speculative vs plain decoding here, per dataset: ``{dataset: {who: evaluate_drafters' figures}}``."""
    started = time.monotonic()

    def report_progress(label: str, bar: StageProgressBar):
        calls = 0

        def progress(name: str, done: int, total: int, result) -> None:
            nonlocal calls
            calls += 1
            bar.update_to(calls, tok_s=f"{result.num_new_tokens / max(result.wall_s, 1e-9):.1f}")
            log.info(
                f"{label} / {name} drafter: prompt {done}/{total}, {result.num_new_tokens} tokens in "
                f"{result.wall_s:.1f} s ({result.num_new_tokens / max(result.wall_s, 1e-9):.1f} tokens/s), tau "
                f"{acceptance_length(result.accepted_lengths):.2f}; {time.monotonic() - started:.0f} s into evaluation"
            )

        return progress

    results: dict[str, dict] = {}
    for name, prompts_ids in prompts.items():
        log.info(
            f"dataset {name}: {len(prompts_ids)} prompts, {config.max_new_tokens} new tokens each, plain / "
            f"{' / '.join(drafters)} interleaved"
        )
        with StageProgressBar(f"drafter_evaluation {name}", len(drafters) * len(prompts_ids), unit="prompt") as bar:
            results[name] = evaluate_drafters(
                target, drafters, prompts_ids, config.max_new_tokens, eos_token_ids=eos,
                progress=report_progress(name, bar),
            )  # fmt: skip
        for who, run in results[name].items():
            if not run["lossless"]:
                log.error(
                    f"{name}: speculative output with the {who} drafter differs from the target's greedy output on "
                    f"prompts {run['mismatched_prompts']}"
                )
    return results


def _parts(log, store, results, chains, uniform, block_size: int, engine_positions) -> dict:
    """The report's and the metadata's in-process parts from the phases' outcomes."""
    head_name = HELDOUT if HELDOUT in results else next(iter(results))
    head, base = results[head_name]["trained"], results[head_name].get("untrained")
    chain, chain_base = chains["trained"], chains.get("untrained")
    lengths = [v for v in head["accepted_lengths"] if v is not None]
    positions = {
        "DFlash (in process)": in_process_forward_figures(lengths, block_size)["accepted_per_decode_step"],
        **(engine_positions or {}),
    }
    png = acceptance_histogram_png(
        {who: [n for v in r["accepted_lengths"] if v is not None for n in v] for who, r in results[head_name].items()},
        block_size,
        per_position=positions,
    )
    png_uri = store.write_bytes(png, REPORT_DIR, "acceptance.png")
    report = {
        "datasets": {name: {"num_prompts": r["trained"]["num_prompts"], **r} for name, r in results.items()},
        "tau_definition": "tau = mean over prompts of each prompt's mean accepted length per verification step "
        "(bonus token counted; z-lab's benchmark); tau_pooled = all tokens / all verification steps; standard errors "
        "across prompts (pooled: ratio estimator clustered by prompt)",
        "teacher_forced_chain": chains,
        "teacher_forced_uniform_anchors": {k: v for k, v in uniform.items() if k != "blocks"},
    }
    by_dataset = {name: _dataset_figures(r) for name, r in results.items()}
    metadata = {
        "tau": _r(head["tau"]),
        "tau_stderr": _r(head["tau_stderr"]),
        "tau_pooled": _r(head["tau_pooled"]),
        "tau_pooled_stderr": _r(head["tau_pooled_stderr"]),
        "tau_by_dataset": by_dataset,
        "datasets": dg.MetadataValue.md(_table(by_dataset, base is not None)),
        "acceptance_per_position": [_r(a) for a in head["acceptance_per_position"]],
        "teacher_forced_tau": _r(chain["tau"]),
        "teacher_forced_tau_pooled": _r(chain["tau_pooled"]),
        "teacher_forced_tau_uniform_anchors": _r(uniform["tau"]),
        **_decode_figures(head),
        **(_untrained_figures(head, base, chain_base) if base is not None else {}),
        "lossless": all(run.get("lossless", True) for r in results.values() for run in r.values()),
        "num_prompts": head["num_prompts"],
        "new_tokens": head["new_tokens"],
        "histogram": png_markdown(png, "acceptance"),
        "histogram_path": dg.MetadataValue.path(png_uri),
    }
    return {"report": report, "metadata": metadata}


def _dataset_figures(r: dict) -> dict:
    run = r["trained"]
    return {
        "prompts": run["num_prompts"],
        "tau": _r(run["tau"]),
        "tau_stderr": _r(run["tau_stderr"]),
        "tau_pooled": _r(run["tau_pooled"]),
        "tau_pooled_stderr": _r(run["tau_pooled_stderr"]),
        **({"tau_untrained": _r(r["untrained"]["tau"])} if "untrained" in r else {}),
        **({"speedup_wall": _r(run["speedup"], 3)} if "speedup" in run else {}),
    }


def _table(by_dataset: dict, floor: bool) -> str:
    """Markdown: tau per dataset (the untrained drafter's column only when it ran)."""
    return (
        f"| dataset | prompts | tau (per-prompt mean) | tau pooled |{' untrained |' if floor else ''} speedup |\n"
        f"|---|---|---|---|{'---|' if floor else ''}---|\n"
        + "".join(
            f"| {n} | {d['prompts']} | {d['tau']} +- {d['tau_stderr']} | {d['tau_pooled']} +- "
            f"{d['tau_pooled_stderr']} |" + (f" {d['tau_untrained']} |" if floor else "")
            + f" {d.get('speedup_wall', '-')} |\n"
            for n, d in by_dataset.items()
        )
    )  # fmt: skip


def _decode_figures(head: dict) -> dict:
    """Forwards and wall time of a decode here (none for a replay: the engine decoded)."""
    keys = ("target_forwards_plain", "target_forwards_spec", "target_forwards_saved", "timing")
    out = {k: head[k] for k in keys if k in head}
    if "speedup" in head:
        out["speedup_wall"] = _r(head["speedup"], 3)
    return out


def _untrained_figures(head: dict, base: dict, chain_base: dict) -> dict:
    se, se_base = head["tau_stderr"], base["tau_stderr"]
    return {
        "tau_untrained": _r(base["tau"]),
        "tau_untrained_stderr": _r(se_base),
        "tau_margin_in_stderr": round((head["tau"] - base["tau"]) / max(math.hypot(se, se_base), 1e-9), 2),
        "teacher_forced_tau_untrained": _r(chain_base["tau"]),
        # a replay has no wall time of its own (the engine decoded)
        **({"speedup_wall_untrained": _r(base["speedup"], 3)} if "speedup" in base else {}),
    }
