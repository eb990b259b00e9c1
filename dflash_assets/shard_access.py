"""Access to stored hidden-state shards: the complete partitions' shards as local paths (S3: downloaded,
checked by size and SHA-256 against each partition's ``index.json``)."""

import json
import os

from dflash_assets.assets.hidden_states import ShardIntegrityError, fetch_shards
from dflash_assets.dflash.shards import INDEX_NAME


def complete_shards(storage, keys: list[str], indexes: dict | None = None) -> tuple[list[str], list[str], list[str]]:
    """``(shard paths, partitions used, partitions without a complete index)`` from local hidden-state dirs
    (for S3 storage, the index and any shard missing or of another size locally are downloaded first).
    ``indexes``, when given, receives ``{partition key: index.json content}`` of the partitions used.

    Raises:
        ShardIntegrityError: a listed shard is missing, unsafely named or fails verification (naming the
            partition and the fix).
    """
    shards, used, skipped = [], [], []
    for pk in keys:
        index_path = storage.ensure_local("hidden_states", pk, INDEX_NAME, refresh=True)
        if not os.path.exists(index_path):
            skipped.append(pk)
            continue
        with open(index_path) as f:
            index = json.load(f)
        if not index.get("complete"):
            skipped.append(pk)
            continue
        used.append(pk)
        if indexes is not None:
            indexes[pk] = index
        shards += fetch_shards(storage, pk, index)[0]  # S3: downloaded, checked by size and sha256
    return shards, used, skipped


__all__ = ["ShardIntegrityError", "complete_shards"]
