"""Storage plan before hidden_states writes anything; stable-hash subsets (max_rows / fraction); feature modes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from dflash_assets.assets.hidden_states import hidden_states
from dflash_assets.dflash.shards.format import read_index, read_shard
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.prompts import CORPUS_FILE
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets.stages.tokenized import tokenized_file
from dflash_assets_tests.checked_events import report_checked

try:
    from dflash_assets_tests.tiny_target import HIDDEN, LAYER_IDS, make_rows, make_target
except ImportError:  # run from inside the tests folder
    from tiny_target import HIDDEN, LAYER_IDS, make_rows, make_target  # type: ignore[no-redef]

KEYS = ["0000000-0000019", "0000020-0000039"]
PER_TOKEN = len(LAYER_IDS) * HIDDEN * 2 + 5  # 197 bytes: bf16 features + int32 id + int8 mask


def h(index: int) -> float:
    """The subset hash, computed here independently of the product code."""
    return int.from_bytes(hashlib.sha256(f"dflash-hidden-states-subset:{index}".encode()).digest()[:8], "big") / 2.0**64


@pytest.fixture
def project(tmp_path):
    """A storage root with a 40-prompt corpus, two tokenized partitions and their tokenized metadata."""
    _, target = make_target(tmp_path)
    root = tmp_path / "data"
    storage = StorageResource(root=str(root))
    store = storage.open()
    # rows name their prompt by content (issue 26): the corpus's content_hash is each row's prompt_hash
    rows = [dict(r, prompt_hash=f"hash-{r['index']}") for r in make_rows(40, first_index=0)]
    corpus = {"index": list(range(40)), "prompt": [f"p{i}" for i in range(40)]}
    store.write_parquet(pl.DataFrame({**corpus, "content_hash": [f"hash-{i}" for i in range(40)]}), *CORPUS_FILE)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, KEYS)
        for k, pk in enumerate(KEYS):
            part = rows[20 * k : 20 * (k + 1)]
            store.write_parquet(pl.DataFrame(part), *tokenized_file(pk))
            report_checked(  # its blocking checks passed: the drafter trains on it
                instance,
                "tokenized_sequences",
                pk,
                {"rows": len(part), "total_tokens": sum(len(r["input_ids"]) for r in part)},
            )
        yield {
            "instance": instance,
            "storage": storage,
            "root": root,
            "rows": rows,
            "target": TargetModelResource(model_path=str(target), dtype="float32", device="cpu"),
            "tokens": sum(len(r["input_ids"]) for r in rows),
        }


def run(p, pk: str, **config) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        [hidden_states],
        instance=p["instance"],
        partition_key=pk,
        raise_on_error=False,
        resources={"storage": p["storage"], "target_model": p["target"]},
        run_config={
            "ops": {"hidden_states": {"config": {"target_layer_ids": LAYER_IDS, "rows_per_shard": 8, **config}}}
        },
    )


def files_under(path: Path) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] if path.exists() else []


def failure_text(result: dg.ExecuteInProcessResult) -> str:
    return "\n".join(e.step_failure_data.error.message for e in result.all_events if e.is_step_failure)


def test_over_budget_fails_before_writing_and_names_the_ways_out(project):
    needed = project["tokens"] * PER_TOKEN  # the whole corpus (both partitions), computed independently
    budget_gb = needed / 2 / 1e9
    result = run(project, KEYS[0], storage_budget_gb=budget_gb)
    assert not result.success
    text = failure_text(result)
    assert f"{needed / 1e3:.2f} KB" in text, text  # bytes needed
    assert f"budget {needed / 2 / 1e3:.2f} KB" in text, text
    assert "features: online" in text and "max_rows" in text and "fraction" in text
    assert "Nothing was written" in text
    assert files_under(project["root"] / "hidden_states") == []  # not a byte


def test_subset_fits_and_writes_only_the_subset(project):
    needed = project["tokens"] * PER_TOKEN
    budget_gb = needed / 2 / 1e9
    # fraction 0.25: about 10 of 40 rows, about a quarter of the bytes
    result = run(project, KEYS[0], storage_budget_gb=budget_gb, fraction=0.25)
    assert result.success, failure_text(result)
    expected = [i for i in range(20) if h(i) < 0.25]
    assert 0 < len(expected) < 20
    out = project["root"] / "hidden_states" / KEYS[0]
    index = read_index(out)
    stored = sorted(int(i) for s in index["shards"] for i in read_shard(out / s["name"]).row_index.tolist())
    assert stored == expected
    meta = result.asset_materializations_for_node("hidden_states")[0].metadata
    assert meta["rows"].value == len(expected) and meta["rows_in_partition"].value == 20
    assert meta["subset"].value == {"fraction": 0.25}
    plan = meta["storage_plan"].value
    assert plan["fits"] and plan["budget_bytes"] == int(budget_gb * 1e9)
    # max_rows: the 6 rows of the whole corpus with the smallest hashes, wherever they are
    smallest = sorted(range(40), key=h)[:6]
    result = run(project, KEYS[1], storage_budget_gb=budget_gb, max_rows=6)
    assert result.success, failure_text(result)
    out = project["root"] / "hidden_states" / KEYS[1]
    stored = sorted(int(i) for s in read_index(out)["shards"] for i in read_shard(out / s["name"]).row_index.tolist())
    assert stored == sorted(i for i in smallest if i >= 20)
    plan = result.asset_materializations_for_node("hidden_states")[0].metadata["storage_plan"].value
    assert plan["rows_selected"] == 6 and plan["rows_total"] == 40


def test_free_space_is_checked_locally_without_a_budget(project, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    result = run(project, KEYS[0])
    assert not result.success
    assert "1.00 KB free at" in failure_text(result)
    assert files_under(project["root"] / "hidden_states") == []


def test_auto_features_follow_the_plan(project):
    """features: auto -> online exactly when the plan does not fit (what the main job and the drafter use)."""
    from dflash_assets.stages.hidden_states import HiddenStatesConfig
    from dflash_assets.stages.storage_plan import resolve_features, storage_plan

    needed = project["tokens"] * PER_TOKEN
    args = (project["instance"], project["storage"], project["target"])
    tight = storage_plan(*args, HiddenStatesConfig(target_layer_ids=LAYER_IDS, storage_budget_gb=needed / 2 / 1e9))
    assert tight.bytes_needed == needed and not tight.fits
    assert tight.rows_that_fit == 20  # half the budget, rows of equal mean size
    assert resolve_features("auto", tight) == "online" and resolve_features("offline", tight) == "offline"
    roomy = storage_plan(*args, HiddenStatesConfig(target_layer_ids=LAYER_IDS, storage_budget_gb=needed * 2 / 1e9))
    assert roomy.fits and resolve_features("auto", roomy) == "offline"
    half = storage_plan(
        *args, HiddenStatesConfig(target_layer_ids=LAYER_IDS, storage_budget_gb=needed / 2 / 1e9, fraction=0.25)
    )
    assert half.fits and half.rows_selected == sum(1 for i in range(40) if h(i) < 0.25)


def test_drafter_asset_online_under_torchrun(project):
    """dflash_drafter with features: online and nproc 2: torchrun, one frozen target per process, nothing
    stored; nnodes > 1 without a rendezvous endpoint fails with the setting to fix."""
    from dflash_assets.assets.drafter import dflash_drafter

    try:
        from dflash_assets_tests.tiny_target import VOCAB
    except ImportError:
        from tiny_target import VOCAB  # type: ignore[no-redef]

    config = {
        "features": "online",
        "nproc": 2,
        "num_hidden_layers": 1,
        "block_size": 4,
        "mask_token_id": VOCAB - 1,
        "max_steps": 3,
        "max_anchors": 4,
        "eval_fraction": 0.0,
        "checkpoint_every": 0,
        "intermediate_size": 32,
    }

    def run_drafter(**extra):
        return dg.materialize(
            [dflash_drafter],
            instance=project["instance"],
            raise_on_error=False,
            resources={"storage": project["storage"], "target_model": project["target"]},
            run_config={"ops": {"dflash_drafter": {"config": {**config, **extra}}}},
        )

    result = run_drafter()
    assert result.success, failure_text(result)
    meta = result.asset_materializations_for_node("dflash_drafter")[0].metadata
    assert meta["features"].value == "online" and meta["world_size"].value == 2 and meta["steps"].value == 3
    assert not (project["root"] / "hidden_states").exists()
    bad = run_drafter(nnodes=2)
    assert not bad.success and "rdzv_endpoint" in failure_text(bad)


def test_the_summary_says_when_its_storage_plan_was_made():
    """A fresh user's second run printed "(71.25 MB already stored)" as if current: the plan is the one recorded
    before the last partition's extraction, so the summary line now names that partition."""
    from dflash_assets.app.summary import _feature_figures

    keys = ["0000000-0000015", "0000016-0000031"]
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, keys)
        for pk, text in zip(keys, ["plan A (0 B already stored)", "plan B (35.62 MB already stored)"]):
            instance.report_runless_asset_event(
                dg.AssetMaterialization("hidden_states", partition=pk, metadata={"storage_plan_text": text})
            )
        figures = _feature_figures(instance, keys, {"features": "offline"})
    assert figures["storage_plan"] == "plan B (35.62 MB already stored) (planned before extracting 0000016-0000031)"
