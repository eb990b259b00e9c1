"""Code location for the UI test: the real ``prompt_corpus`` plus fast stand-ins of the later stages.

The stand-ins carry the real asset keys, partitions (``prompt_index_ranges``), groups, dependencies,
op tags and pools, so the asset graph, the partition views and the run queue behave as with the real
pipeline, but a partition takes ``DFLASH_UI_STAGE_SECONDS`` (default 1 s) instead of needing an
inference server and the target model. Loaded by ``dagster dev`` as a python_file code location;
test_ui.py checks the mirrored attributes against the real asset definitions.
"""

import os
import time

import dagster as dg
import polars as pl

from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.data.ranges import key_range
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.orchestration.pools import GPU_POOL, INFERENCE_POOL
from dflash_assets.stages.prompts import CORPUS_FILE
from dflash_assets.stages.resources.storage import StorageResource

TOKENS_PER_ROW = 100  # fake completion_tokens per prompt


def _stage_seconds() -> float:
    return float(os.environ.get("DFLASH_UI_STAGE_SECONDS", "1.0"))


@dg.asset(
    partitions_def=prompt_ranges,
    deps=["prompt_corpus"],
    group_name="generation",
    op_tags={"dflash/inference": "servers"},
    pool=INFERENCE_POOL,
    description="Stand-in for completions: counts the partition's corpus rows and sleeps instead of calling servers.",
)
def completions(context: dg.AssetExecutionContext, storage: StorageResource) -> dg.MaterializeResult:
    started = time.monotonic()
    first, last = key_range(context.partition_key)
    corpus = storage.open().read_parquet(*CORPUS_FILE)  # the real corpus the real prompt_corpus wrote
    rows = corpus.filter(pl.col("index").is_between(first, last)).height
    if rows != last - first + 1:
        raise dg.Failure(f"{context.partition_key}: the corpus holds {rows} of its {last - first + 1} prompts")
    time.sleep(_stage_seconds())
    return dg.MaterializeResult(
        metadata={
            "rows": rows,
            "completion_tokens_total": rows * TOKENS_PER_ROW,
            "wall_s": round(time.monotonic() - started, 2),
        }
    )


@dg.asset(deps=["completions"], group_name="generation", description="Stand-in for truncation_report.")
def truncation_report() -> dg.MaterializeResult:
    return dg.MaterializeResult(metadata={"rows": 0})


@dg.asset(
    partitions_def=prompt_ranges,
    deps=["completions"],
    group_name="tokenization",
    description="Stand-in for tokenized_sequences.",
)
def tokenized_sequences() -> dg.MaterializeResult:
    time.sleep(_stage_seconds() / 3)
    return dg.MaterializeResult(metadata={"rows": 1})


@dg.asset(
    partitions_def=prompt_ranges,
    deps=["tokenized_sequences"],
    group_name="hidden_states",
    op_tags={"dflash/gpu": "target"},
    pool=GPU_POOL,
    description="Stand-in for hidden_states.",
)
def hidden_states() -> dg.MaterializeResult:
    time.sleep(_stage_seconds() / 3)
    return dg.MaterializeResult(metadata={"rows": 1})


partition_stages = dg.define_asset_job(
    "partition_stages",
    selection=dg.AssetSelection.assets("completions", "tokenized_sequences", "hidden_states"),
)

defs = dg.Definitions(
    assets=[prompt_corpus, completions, truncation_report, tokenized_sequences, hidden_states],
    jobs=[partition_stages],
    resources={"storage": StorageResource()},
    executor=dg.in_process_executor,  # saves a step subprocess (~2 s) per run; in-process steps claim pool slots too
)
