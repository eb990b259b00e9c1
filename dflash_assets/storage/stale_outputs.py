"""Output files of partition keys that no longer exist (a range whose prompts are all gone): found in
storage and removed, safely. No Dagster here.

Per partition key ``pk`` the stages write ``completions/<pk>.parquet``, ``<pk>.journal.jsonl`` (S3:
the ``<pk>.journal/`` segments), ``tokenized_sequences/<pk>.parquet``, ``<pk>.set_aside.parquet`` and
``hidden_states/<pk>/``. Once ``pk`` is not a partition any more nothing reads them; they only take
space (hidden states: ~51 KB per token). What is never removed:

* anything of a key that is a partition now, or a name that is not ``<range key>`` or ``<range key>.<suffix>``
  (a user's file, a temporary file of a write in flight: those start with a dot);
* anything while another run of this Dagster instance is in progress (it may be reading or writing a key
  the new build dropped): the files are listed, and the next build removes them;
* an output with an object modified within ``grace_s`` (a run of another host on the same root, which this
  instance cannot see, is still writing it: journals sync every 30 s).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from dflash_assets.storage.store import Storage

__all__ = ["OUTPUT_FOLDERS", "StaleOutputs", "remove_stale_outputs", "stale_outputs"]

OUTPUT_FOLDERS = ("completions", "tokenized_sequences", "hidden_states")
_OUTPUT = re.compile(r"^(\d{7}-\d{7})(?:\.[A-Za-z0-9_.]+)?$")


@dataclass
class StaleOutputs:
    """What :func:`remove_stale_outputs` did: URIs ``removed``, ``kept`` (with why in ``reason``)."""

    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    reason: str = ""

    def message(self) -> str:
        """One log line, or "" when there was nothing stale."""
        parts = []
        if self.removed:
            parts.append(
                f"removed {len(self.removed)} outputs of partition keys no longer in the corpus: "
                f"{', '.join(self.removed[:5])}{' ...' if len(self.removed) > 5 else ''}"
            )
        if self.kept:
            parts.append(
                f"kept {len(self.kept)} outputs of keys no longer in the corpus ({self.reason}): "
                f"{', '.join(self.kept[:5])}{' ...' if len(self.kept) > 5 else ''}"
            )
        return "; ".join(parts)


def stale_outputs(store: Storage, keys: set[str] | list[str]) -> list[tuple[str, str]]:
    """``(folder, name)`` of every per-partition output in storage whose key is not in ``keys``."""
    current = set(keys)
    found = []
    for folder in OUTPUT_FOLDERS:
        for name in store.listdir(folder):
            match = _OUTPUT.match(name)
            if match and match.group(1) not in current:
                found.append((folder, name))
    return found


def _newest_change(store: Storage, parts: tuple[str, str]) -> float:
    """Unix time of the newest change of the object ``parts`` or of any object under it (a folder)."""
    path = store.path(*parts)
    infos = store.call("list", parts, lambda: store.fs.find(path, detail=True, withdirs=False)) or {
        path: store.call("head", parts, lambda: store.fs.info(path))
    }
    newest = 0.0
    for name, info in infos.items():
        stamp = info.get("mtime") or info.get("LastModified")
        if stamp is None:  # a listing without times: ask for the object itself
            info = store.call("head", parts, lambda name=name: store.fs.info(name))
            stamp = info.get("mtime") or info.get("LastModified") or time.time()  # unknown: as if just now
        newest = max(newest, stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp))
    return newest


def remove_stale_outputs(
    store: Storage, keys: set[str] | list[str], busy_runs: list[str], grace_s: float = 3600.0
) -> StaleOutputs:
    """Remove the outputs of keys not in ``keys`` (see the module docstring for what is spared).

    Args:
        busy_runs: ids of other runs in progress: when any, nothing is removed (all listed as kept).
        grace_s: outputs changed less than this many seconds ago are kept.
    """
    stale = stale_outputs(store, keys)
    result = StaleOutputs()
    if busy_runs:
        result.kept = [store.uri(*p) for p in stale]
        result.reason = f"runs in progress: {', '.join(busy_runs[:3])}; the next corpus build removes them"
        return result
    now = time.time()
    for parts in stale:
        if now - _newest_change(store, parts) < grace_s:
            result.kept.append(store.uri(*parts))
            result.reason = f"changed within the last {grace_s:.0f} s: maybe written by another host"
            continue
        store.remove(*parts, recursive=True)
        result.removed.append(store.uri(*parts))
    return result
