"""Stand-in definitions for the kill-and-resume tests: one partitioned asset in the ``dflash_inference``
pool that hangs (like a long generation) while ``$KILL_TEST_DIR/hang`` exists, with the project's
executor (:data:`dflash_assets.orchestration.runs.reaping_executor`). Loaded by a real ``dagster asset materialize``."""

import os
import time
from pathlib import Path

import dagster as dg

from dflash_assets.orchestration.pools import INFERENCE_POOL
from dflash_assets.orchestration.runs import reaping_executor


@dg.asset(partitions_def=dg.StaticPartitionsDefinition(["p0", "p1"]), pool=INFERENCE_POOL)
def slow_completions(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    work = Path(os.environ["KILL_TEST_DIR"])
    # Written whole before it appears (temp name + rename): the test reads it while polling.
    marker = work / f"started-{context.partition_key}-{os.getpid()}"
    partial = work / f".partial-{marker.name}"
    partial.write_text(str(os.getpid()))
    os.replace(partial, marker)
    while (work / "hang").exists():
        time.sleep(0.1)
    return dg.MaterializeResult(metadata={"pid": os.getpid()})


defs = dg.Definitions(assets=[slow_completions], executor=reaping_executor)
