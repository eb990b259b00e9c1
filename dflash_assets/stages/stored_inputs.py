"""The drafter's inputs read back from storage, local or on S3: one partition's hidden-state shards fetched and
verified against its ``index.json`` (size and SHA-256), the shards of every complete partition (offline
features), and the tokenized rows the frozen target computes features from (online)."""

import json
import os

from dflash_assets.dflash.shards.format import INDEX_NAME
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.tokenized import tokenized_file
from dflash_assets.storage.atomic import atomic_write_bytes
from dflash_assets.storage.store import IntegrityError, UnsafeNameError, check_name, file_sha256


class ShardIntegrityError(RuntimeError):
    """A downloaded shard's size or SHA-256 differs from its partition's index.json."""


def fetch_shards(
    storage: StorageResource, pk: str, index: dict, *, on_bad: str = "raise"
) -> tuple[list[str], list[str]]:
    """Local paths of the shards ``index`` lists, downloading (S3) each one missing locally, of another
    size than the index records, or whose SHA-256 differs from the index's (:func:`local_copy_matches`:
    a shard re-extracted elsewhere with the same size is not the local copy); a download goes to a
    temporary name and is put in place only once its size and, when the index has it, SHA-256 match.
    Local storage: the paths, nothing copied.
    Every shard name is checked first: one plain file name (:func:`~dflash_assets.storage.store.check_name`),
    so a hostile or corrupt index.json cannot point outside the partition's directory.

    Args:
        on_bad: ``"raise"``: a shard that is missing, unsafely named or fails verification raises
            :class:`ShardIntegrityError` (the drafter cannot recompute it); ``"drop"``: it is left out
            (hidden_states then recomputes that shard).

    Returns:
        ``(paths, names downloaded now)``.
    """
    listed = []  # every name is checked before anything is downloaded: a bad index fails as a whole
    for shard in index.get("shards", []):
        try:
            where = f"hidden_states/{pk}/{INDEX_NAME}"
            name = check_name(shard.get("name") if isinstance(shard, dict) else None, f"{where} shard")
            expected = shard.get("bytes")
            if expected is not None and (not isinstance(expected, int) or isinstance(expected, bool) or expected < 0):
                raise UnsafeNameError(f"{where}: shard {name!r} has bytes {expected!r}, not a size")
        except UnsafeNameError as exc:
            if on_bad == "drop":
                continue
            raise ShardIntegrityError(f"{exc}; re-materialize hidden_states[{pk}]") from None
        listed.append((name, expected, shard.get("sha256") or None))
    paths, fetched = [], []
    for name, expected, sha256 in listed:
        path = storage.local_scratch("hidden_states", pk, name)
        if storage.is_remote and not local_copy_matches(path, expected, sha256):
            try:
                storage.open().download(path, "hidden_states", pk, name, size=expected, sha256=sha256)
            except FileNotFoundError:
                if on_bad == "drop":
                    continue
                raise ShardIntegrityError(
                    f"hidden_states/{pk}/{name} is listed in index.json but missing from "
                    f"storage; re-materialize hidden_states[{pk}]"
                ) from None
            except IntegrityError as exc:
                if os.path.exists(path):
                    os.unlink(path)  # the local copy is of another size: not the indexed shard either
                if on_bad == "drop":
                    continue
                raise ShardIntegrityError(f"{exc} (index.json); re-materialize hidden_states[{pk}]") from None
            fetched.append(name)
            _stamp(path, sha256)
        paths.append(path)
    return paths, fetched


def _stamp_path(path: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.verified.json")


def _stamp(path: str, sha256: str | None) -> None:
    """Record that ``path`` as it is now (size, mtime, inode) has SHA-256 ``sha256``."""
    if sha256:
        st = os.stat(path)
        mark = {"sha256": sha256, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
        atomic_write_bytes(_stamp_path(path), json.dumps(mark).encode())


def local_copy_matches(path: str, size: int | None, sha256: str | None) -> bool:
    """True when the local scratch copy ``path`` is the shard the index describes: it exists, has
    ``size`` bytes (when given) and SHA-256 ``sha256`` (when given). The hash is read from a stamp
    beside the file when the stamp matches the file's size, mtime and inode (a file changed since it
    was verified fails that), else computed (streamed) and stamped, so a verified copy is hashed once.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    if size is not None and st.st_size != size:
        return False
    if not sha256:
        return True
    try:
        with open(_stamp_path(path)) as f:
            mark = json.load(f)
        if mark == {"sha256": sha256, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}:
            return True
    except (OSError, ValueError):
        pass  # no stamp or a damaged one: hash the file
    if file_sha256(path) != sha256:
        return False
    _stamp(path, sha256)
    return True


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


def tokenized_inputs(storage, keys: list[str]) -> tuple[list[str], list[str]]:
    """``(local parquet paths, partitions used)`` of tokenized_sequences, in partition order (S3: downloaded
    to scratch when missing or of another size)."""
    store = storage.open()
    paths, used = [], []
    for pk in keys:
        parts = tokenized_file(pk)
        if not store.exists(*parts):
            continue
        path = (
            storage.ensure_local(*parts, size=store.size(*parts))
            if storage.is_remote
            else storage.local_scratch(*parts)
        )
        if os.path.exists(path):
            paths.append(path)
            used.append(pk)
    return paths, used


__all__ = ["ShardIntegrityError", "complete_shards", "fetch_shards", "local_copy_matches", "tokenized_inputs"]
