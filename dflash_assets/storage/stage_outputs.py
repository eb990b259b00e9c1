"""Whether each stage's output is in the configured storage: the one file a stage writes last or reads back
first (its table, its index), never every shard.

Dagster's records say a stage ran, not that its files are where the config now points: after a change of
``DFLASH_STORAGE_ROOT`` or of an S3 prefix, or with ``dflash_data`` deleted while the Dagster instance
stays, every record still reads "materialized". :mod:`dflash_assets.orchestration.freshness` asks here, so such a stage
is "needs work" (``output missing: <uri>``) instead of up to date.

Cost: one object listing per partitioned stage for all its partitions (a LIST of the stage's folder on S3,
paged by 1,000 objects), one existence check per unpartitioned stage.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence

from dflash_assets.storage.store import Storage

#: stage -> its output's path under the storage root (``{pk}``: the partition key)
OUTPUTS: dict[str, tuple[str, ...]] = {
    "prompt_corpus": ("prompt_corpus", "corpus.parquet"),
    "completions": ("completions", "{pk}.parquet"),
    "tokenized_sequences": ("tokenized_sequences", "{pk}.parquet"),
    "hidden_states": ("hidden_states", "{pk}", "index.json"),  # written last: readers trust only a complete index
    "truncation_report": ("truncation_report", "report.json"),
    "dflash_drafter": ("dflash_drafter", "export", "model.safetensors"),
    # drafter_evaluation is left out: its "reused" path (same export, same settings) writes no report, so a
    # missing report.json would send every run back to it without ever writing one
}
#: completions' output when it runs ``mode: on_policy`` (ops.completions.config.mode): the on-policy table
ON_POLICY_OUTPUT = ("completions", "{pk}.on_policy.parquet")


def output_parts(stage: str, pk: str | None = None, mode: str | None = None) -> tuple[str, ...]:
    """The path parts of ``stage``'s output (of partition ``pk``) under the storage root; ``mode``: completions'
    ``ops.completions.config.mode`` (``on_policy``: its on-policy table; else its regeneration table).

    Raises:
        KeyError: ``stage`` is not a stage of the pipeline.
    """
    parts = ON_POLICY_OUTPUT if stage == "completions" and mode == "on_policy" else OUTPUTS[stage]
    return tuple(p.format(pk=pk) for p in parts)


def missing_reason(uri: str | None) -> str | None:
    """``"output missing: <uri>"``, or None."""
    return f"output missing: {uri}" if uri else None


def output_missing(store: Storage, stage: str, pk: str | None = None) -> str | None:
    """The URI of ``stage``'s output (of ``pk``) when it is not in ``store``, else None (one existence check;
    None for a stage without a checked output)."""
    if stage not in OUTPUTS:
        return None
    parts = output_parts(stage, pk)
    return None if store.exists(*parts) else store.uri(*parts)


def missing_outputs(store: Storage, stage: str, keys: Sequence[str], mode: str | None = None) -> dict[str, str]:
    """``{pk: uri}`` of the partitions of ``keys`` whose output of partitioned ``stage`` (completions: of ``mode``,
    :func:`output_parts`) is not in ``store``, from one recursive listing of the stage's folder."""
    if not keys or stage not in OUTPUTS:
        return {}
    folder = OUTPUTS[stage][0]
    base = store.path(folder).rstrip("/")

    def listing() -> set[str]:
        try:
            found = store.fs.find(base)
        except FileNotFoundError:
            return set()
        # find gives the filesystem's paths (local: OS separators); compare as posix paths under the folder
        return {posixpath.relpath(str(p).replace("\\", "/"), base.replace("\\", "/")) for p in found}

    present = store.call("list", (folder,), listing)
    out = {}
    for pk in keys:
        rel = posixpath.join(*output_parts(stage, pk, mode)[1:])
        if rel not in present:
            out[pk] = store.uri(*output_parts(stage, pk, mode))
    return out
