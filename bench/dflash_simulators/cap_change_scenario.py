"""The cap-change scenario shared by ``dflash_assets_tests/test_cap_change.py`` and ``bench/bench_cap_change.py``.

3 partitions of 2 prompts at a small cap, behind a counting proxy in front of a real server: raise the cap,
then lower it, each time launching only what the ``generation_settings_changed`` sensor asks for, and record
the requests, runs and table hashes each change caused. Test-support code: nothing in the pipeline imports it.
"""

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg
import polars as pl

from dflash_assets.app.automation import request_partitions
from dflash_assets.assets.completions import completions
from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.assets.tokenized import tokenized_sequences
from dflash_assets.stages.completions.tables import partition_file
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets.stages.tokenized import tokenized_file

PROMPTS = [
    "What is 2+2? Answer with just the number.",
    "What is the capital of France? Answer with one word.",
    "What is 3+5? Answer with just the number.",
    "Write a long story about a dragon.",
    "Explain how a compiler works in detail.",
    "Describe the history of Rome.",
]
PARTITION_SIZE = 2
CAP_SMALL, CAP_RAISED, CAP_LOWERED = 10, 14, 11
PROBE = "Hi"  # the user message of the readiness probe external mode sends once per serve()
ASSET_KEYS = {"completions": dg.AssetKey("completions"), "tokenized_sequences": dg.AssetKey("tokenized_sequences")}
# tiny caps make every loss mask short: judge degenerate masks only at 0 tokens, keep length rows
TOKENIZE_CONFIG = {"ops": {"tokenized_sequences": {"config": {"truncated": "keep", "degenerate_small_tokens": 0}}}}


@dataclass
class Snapshot:
    """Partition tables and file hashes at one point of the scenario."""

    rows: dict[str, list[dict]]  # pk -> completions rows (dicts), index order
    completions_sha: dict[str, str]
    tokenized_sha: dict[str, str]
    materializations: dict[str, Counter]  # asset name -> Counter(pk -> count)

    def truncated(self) -> dict[str, list[dict]]:
        return {pk: [r for r in rows if r["finish_reason"] == "length"] for pk, rows in self.rows.items()}

    def longer_than(self, cap: int) -> dict[str, list[dict]]:
        return {pk: [r for r in rows if r["completion_tokens"] > cap] for pk, rows in self.rows.items()}


@dataclass
class CapChange:
    """What one cap change did: the sensor's RunRequests and the requests the server received."""

    new_cap: int
    run_requests: list[dg.RunRequest]
    requested: Counter  # user message -> requests received by the server (probes excluded)
    probes: int
    wall_s: float
    after: Snapshot | None = None


@dataclass
class Scenario:
    keys: list[str]
    initial: Snapshot
    initial_requests: Counter
    changes: list[CapChange] = field(default_factory=list)
    skip_after: list = field(default_factory=list)  # sensor results once every change was applied
    timings: dict[str, float] = field(default_factory=dict)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(instance: dg.DagsterInstance, root: Path, keys: list[str]) -> Snapshot:
    rows = {pk: pl.read_parquet(root.joinpath(*partition_file(pk))).sort("index").to_dicts() for pk in keys}
    mats = {}
    for name, key in ASSET_KEYS.items():
        mats[name] = Counter()
        for pk in keys:
            recs = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=key, asset_partitions=[pk]), limit=100
            ).records
            mats[name][pk] = len(recs)
    return Snapshot(
        rows=rows,
        completions_sha={pk: sha(root.joinpath(*partition_file(pk))) for pk in keys},
        tokenized_sha={pk: sha(root.joinpath(*tokenized_file(pk))) for pk in keys},
        materializations=mats,
    )


def resources(root: Path, inference: InferenceServerResource, cap: int) -> dict:
    return {
        "storage": StorageResource(root=str(root)),
        "inference": inference,
        "generation": GenerationResource(max_output_tokens=cap, temperature=0.0),
        "target_model": TargetModelResource(),
    }


def materialize_partition(instance, root: Path, inference, cap: int, pk: str, tags: dict | None = None) -> None:
    """The per-partition stages this test needs (completions -> tokenized_sequences) for one key."""
    result = dg.materialize(
        [completions, tokenized_sequences],
        instance=instance,
        partition_key=pk,
        tags=tags or {},
        resources=resources(root, inference, cap),
        run_config=TOKENIZE_CONFIG,
    )
    assert result.success


def materialize_partitions(
    instance, root: Path, inference, cap: int, jobs: list[tuple[str, dict]], timings: dict
) -> None:
    """Run ``(partition_key, tags)`` jobs one after another (in-process runs on threads deadlocked here)."""
    for pk, tags in jobs:
        started = time.monotonic()
        materialize_partition(instance, root, inference, cap, pk, tags)
        timings[f"run_cap{cap}_{pk}_s"] = time.monotonic() - started


def requests_since(proxy, before: Counter) -> tuple[Counter, int]:
    """Requests the server received since ``before`` (a copy of ``proxy.requested``): rows, probes."""
    now = proxy.requested - before
    probes = now.pop(PROBE, 0)
    return now, probes


def run_scenario(root: Path, proxy, inference: InferenceServerResource, caps: list[int]) -> Scenario:
    """Corpus -> all partitions at ``caps[0]`` -> for each later cap: sensor tick, run its partitions.

    ``inference`` must point at ``proxy`` so every request is counted at the server side.
    """
    from dflash_assets.definitions import defs

    sensor = defs.get_sensor_def("generation_settings_changed")
    corpus_file = root / "prompts.jsonl"
    corpus_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    timings = {}
    with dg.instance_for_test() as instance:
        started = time.monotonic()
        assert dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources={"storage": StorageResource(root=str(root))},
            run_config={
                "ops": {"prompt_corpus": {"config": {"sources": [str(corpus_file)], "partition_size": PARTITION_SIZE}}}
            },
        ).success
        keys = instance.get_dynamic_partitions("prompt_index_ranges")
        timings["corpus_s"] = time.monotonic() - started
        before = proxy.requested
        materialize_partitions(instance, root, inference, caps[0], [(pk, {}) for pk in keys], timings)
        initial_requests, _ = requests_since(proxy, before)
        timings["initial_s"] = time.monotonic() - started
        scenario = Scenario(
            keys=keys, initial=snapshot(instance, root, keys), initial_requests=initial_requests, timings=timings
        )

        for cap in caps[1:]:
            started = time.monotonic()
            generation = GenerationResource(max_output_tokens=cap, temperature=0.0)
            result = sensor(
                dg.build_sensor_context(
                    instance=instance, resources={"generation": generation, "target_model": TargetModelResource()}
                )
            )
            run_requests = [] if isinstance(result, dg.SkipReason) else list(result)
            before = proxy.requested
            # the sensor requests ranges of touched partitions; run them one partition at a time here
            jobs = [
                (pk, {k: v for k, v in rr.tags.items() if k.startswith("dflash/")})
                for rr in run_requests
                for pk in request_partitions(rr, keys)
            ]
            materialize_partitions(instance, root, inference, cap, jobs, timings)
            requested, probes = requests_since(proxy, before)
            change = CapChange(cap, run_requests, requested, probes, time.monotonic() - started)
            change.after = snapshot(instance, root, keys)
            scenario.changes.append(change)
        last = GenerationResource(max_output_tokens=caps[-1], temperature=0.0)
        scenario.skip_after.append(
            sensor(
                dg.build_sensor_context(
                    instance=instance, resources={"generation": last, "target_model": TargetModelResource()}
                )
            )
        )
    return scenario


def proxied_inference(base: InferenceServerResource, proxy_url: str) -> InferenceServerResource:
    """``base`` (external mode) with its URL replaced by the counting proxy's."""
    return InferenceServerResource(
        mode="external",
        external={**base.external.model_dump(), "base_urls": [proxy_url]},
        max_running_requests=base.max_running_requests,
        client={"max_attempts": 1},
    )
