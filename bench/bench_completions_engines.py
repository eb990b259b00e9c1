"""The completions stage on ``transformers serve`` (``inference.mode: local``) against vLLM's CPU build
(``inference.mode: vllm``), side by side in one run: which one the embedded default should use.

Both run the default's workload: its 64 HumanEval prompts (``local_demo.yaml``'s ``max_prompts``), its cap and
sampling (``resources.generation`` of that file, with the sampling defaults: temperature 0.6, top_p 0.95,
top_k 20), its concurrency (16 requests in flight, the default of both modes on a CPU), through the whole
``completions`` asset (``dg.materialize`` of one partition, fresh each round: server start, requests, journal,
table). Rounds alternate the engines in ABBA order, so a change of the machine's load during the run is charged
to both. Per engine, over all rounds:

- rows/s and output tok/s of the generation phase (the asset's ``wall_s``: first request to the table write);
- the servers' start-up (``cost_startup_s``) and the whole stage (``dg.materialize``, start-up included);
- exactness of the last round's rows, checked with the tokenizer the ``tokenized_sequences`` stage uses: a row is
  exact when it carries the ids the server generated (``output_token_ids``) and the prompt the stage renders is
  as long as the server's (``prompt_tokens``), so the stage rebuilds the server's sequence token for token;
  ``transformers serve`` returns no ids, so its rows are re-tokenized from text, and the bench counts those whose
  re-tokenized length differs from the server's count (a re-tokenization that is certainly not the server's).

The ratio vLLM / transformers serve of output tok/s is the headline; the default is the engine that is faster
and exact (docs/configuration.md says which and why). vLLM's environment is made first when it is not (not
timed: a one-time install, which the main job overlaps with its earlier stages).

    python bench/bench_completions_engines.py [--prompts 64] [--rounds 2] [--cap N] [--concurrency 16]

Prints one ``name: value`` line per figure and HEADLINE lines for bench/run_all.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import dagster as dg
import polars as pl
import yaml
from headline import headline

from dflash_assets.assets.completions import completions
from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.common.config import DEFAULT_CONFIG
from dflash_assets.common.settings import default_sources
from dflash_assets.data.tokenization import SequenceBuilder
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.prompts import CORPUS_FILE
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource

ENGINES = {"transformers serve": "local", "vLLM": "vllm"}


def demo_settings() -> tuple[dict, int]:
    """``resources.generation`` and ``max_prompts`` of the embedded default's config file."""
    demo = yaml.safe_load(DEFAULT_CONFIG.read_text())
    generation = dict((demo.get("resources") or {}).get("generation") or {})
    prompts = demo["ops"]["prompt_corpus"]["config"]["max_prompts"]
    return generation, int(prompts)


def make_corpus(instance, root: Path, n: int) -> tuple[str, pl.DataFrame]:
    """The first ``n`` default prompts as one partition; returns (key, corpus)."""
    result = dg.materialize(
        [prompt_corpus],
        instance=instance,
        resources={"storage": StorageResource(root=str(root))},
        run_config={
            "ops": {"prompt_corpus": {"config": {"sources": default_sources(), "partition_size": n, "max_prompts": n}}}
        },
    )
    assert result.success
    (pk,) = instance.get_dynamic_partitions(prompt_ranges.name)
    return pk, pl.read_parquet(root.joinpath(*CORPUS_FILE))


def run_stage(instance, root: Path, pk: str, inference, generation: GenerationResource) -> tuple[dict, pl.DataFrame]:
    """One fresh ``completions[pk]``: its metadata (plus ``stage_s``, the whole materialization) and table."""
    shutil.rmtree(root / "completions", ignore_errors=True)
    started = time.perf_counter()
    result = dg.materialize(
        [completions],
        instance=instance,
        partition_key=pk,
        resources={
            "storage": StorageResource(root=str(root)),
            "inference": inference,
            "generation": generation,
            "target_model": TargetModelResource(),
        },
    )
    stage_s = time.perf_counter() - started
    assert result.success
    meta = {k: v.value for k, v in result.asset_materializations_for_node("completions")[0].metadata.items()}
    meta["stage_s"] = stage_s
    return meta, pl.read_parquet(root / "completions" / f"{pk}.parquet")


def exactness(rows: pl.DataFrame, corpus: pl.DataFrame, builder: SequenceBuilder) -> dict:
    """``rows``, ``with_server_ids``, ``prompt_len_agrees`` (stage-rendered prompt as long as the server's) and
    ``retokenized_len_differs`` (rows without ids whose re-tokenized completion is not the server's length)."""
    messages = dict(zip(corpus["index"].to_list(), corpus["messages"].to_list()))
    tools = dict(zip(corpus["index"].to_list(), corpus["tools"].to_list())) if "tools" in corpus.columns else {}
    ok = [r for r in rows.iter_rows(named=True) if r["error"] is None]
    built = builder.build_many(ok, [messages[r["index"]] for r in ok], [tools.get(r["index"]) for r in ok])
    out = {"rows": rows.height, "with_server_ids": 0, "prompt_len_agrees": 0, "retokenized_len_differs": 0}
    for row, item in zip(ok, built):
        if isinstance(item, Exception):
            continue
        ids, prompt_len = item
        out["prompt_len_agrees"] += prompt_len == row["prompt_tokens"]
        if row["output_token_ids"] is not None:
            out["with_server_ids"] += ids[prompt_len:][: len(row["output_token_ids"])] == list(row["output_token_ids"])
        elif len(ids) - prompt_len != row["completion_tokens"]:
            out["retokenized_len_differs"] += 1
    out["exact"] = out["with_server_ids"] == out["prompt_len_agrees"] == out["rows"]
    return out


def main() -> int:
    generation_fields, default_prompts = demo_settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=default_prompts, help="the default's prompts (64)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both engines, ABBA order")
    parser.add_argument("--cap", type=int, default=None, help="max_output_tokens (default: the default's)")
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight (default: 16 both)")
    args = parser.parse_args()
    if args.cap is not None:
        generation_fields["max_output_tokens"] = args.cap
    generation = GenerationResource(**generation_fields)
    settings = generation.settings()
    inference = {
        name: InferenceServerResource(mode=mode, max_running_requests=args.concurrency)
        for name, mode in ENGINES.items()
    }
    print(f"cpu_cores: {os.cpu_count()}, load_average_1min at start: {os.getloadavg()[0]:.2f}")
    print(
        f"workload: {args.prompts} default prompts, cap {settings.max_output_tokens}, temperature "
        f"{settings.temperature}, top_p {settings.top_p}, top_k {settings.top_k}, concurrency "
        f"{inference['vLLM'].effective_max_running_requests()}, {args.rounds} rounds ABBA",
        flush=True,
    )
    started = time.monotonic()
    inference["vLLM"].vllm_environment().ensure(print)  # a one-time install, not timed
    print(f"vllm_environment_ready_s: {time.monotonic() - started:.0f}", flush=True)
    builder = SequenceBuilder(TargetModelResource().load_tokenizer())
    totals = {name: {"rows": 0, "tokens": 0, "gen_s": 0.0, "startup_s": 0.0, "stage_s": 0.0} for name in ENGINES}
    exact: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_engines_") as tmp, dg.instance_for_test(temp_dir=tmp) as instance:
        root = Path(tmp) / "data"
        pk, corpus = make_corpus(instance, root, args.prompts)
        order = list(ENGINES)
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                meta, rows = run_stage(instance, root, pk, inference[name], generation)
                assert meta["errors"] == 0, f"{name}: {meta['errors']} error rows"
                t = totals[name]
                t["rows"] += meta["rows"]
                t["tokens"] += meta["output_tokens_generated"]
                t["gen_s"] += meta["wall_s"]
                t["startup_s"] += meta["cost_startup_s"]
                t["stage_s"] += meta["stage_s"]
                exact[name] = exactness(rows, corpus, builder)
                print(
                    f"round_{r} {name}: {meta['rows']} rows, {meta['output_tokens_generated']} tok in "
                    f"{meta['wall_s']:.1f} s generating ({meta['output_tokens_generated'] / meta['wall_s']:.1f} "
                    f"tok/s), start-up {meta['cost_startup_s']:.1f} s, stage {meta['stage_s']:.1f} s, finish "
                    f"{rows['finish_reason'].value_counts(sort=True).rows()}, load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    rates = {}
    for name, t in totals.items():
        rates[name] = (t["rows"] / t["gen_s"], t["tokens"] / t["gen_s"], t["stage_s"] / args.rounds)
        e = exact[name]
        print(
            f"{name}: rows/s {rates[name][0]:.3f}, output tok/s {rates[name][1]:.1f}, start-up "
            f"{t['startup_s'] / args.rounds:.1f} s, whole stage {rates[name][2]:.1f} s per round; rows with the "
            f"server's ids {e['with_server_ids']}/{e['rows']}, prompt length agrees {e['prompt_len_agrees']}/"
            f"{e['rows']}, re-tokenized length differs {e['retokenized_len_differs']}; exact: {e['exact']}"
        )
    tok_ratio = rates["vLLM"][1] / rates["transformers serve"][1]
    rows_ratio = rates["vLLM"][0] / rates["transformers serve"][0]
    stage_ratio = rates["transformers serve"][2] / rates["vLLM"][2]
    print(f"vllm_over_transformers_output_tok_per_s: {tok_ratio:.3f}")
    print(f"vllm_over_transformers_rows_per_s: {rows_ratio:.3f}")
    print(f"transformers_stage_s_over_vllm_stage_s (start-up included): {stage_ratio:.3f}")
    print(f"load_average_1min at end: {os.getloadavg()[0]:.2f}")
    faster_and_exact = tok_ratio > 1.0 and stage_ratio > 1.0 and exact["vLLM"]["exact"]
    headline(
        f"completions, default's {args.prompts} prompts: vLLM / transformers serve output tok/s, {args.rounds} "
        "ABBA rounds",
        tok_ratio,
        "> 1 with exact rows: vLLM is the default",
        faster_and_exact,
    )
    headline(
        "completions: whole stage (start-up included), transformers serve s / vLLM s",
        stage_ratio,
        "> 1",
        stage_ratio > 1.0,
    )
    e = exact["vLLM"]
    headline(
        "completions on vLLM: rows exact (server ids, prompt length agrees)",
        f"{min(e['with_server_ids'], e['prompt_len_agrees'])} / {e['rows']}",
        "all",
        e["exact"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
