"""Stable prompt indices: a prompt keeps its index across corpus builds while its content is unchanged.

Every stored row (completions, tokenized, hidden states) is keyed by its prompt's ``index``. If each build
numbered prompts from 0, a file added before the others would move every prompt to another index and
each stored row would then sit at the index of another prompt. Instead the build keeps a persistent table
``content_hash -> index`` (:data:`INDEX_FILE`, next to the corpus in storage, written atomically):

- a prompt whose content hash is in the table gets that index, wherever its file sorts in ``sources``;
- a prompt never seen gets the next index after the largest one ever given, in corpus order;
- a prompt no longer in the corpus leaves its index unused (a gap); its entry stays in the table, so the
  same content coming back gets its old index (and its stored rows, still valid) again;
- the same prompt in two files is one prompt (the corpus keeps the first), so one index.

An edited prompt is new content: it gets a new index and its old index becomes a gap. Partitions are
index *ranges* (:data:`RANGES_FILE`): ranges given before keep their bounds (so a partition key always
means the same indices); indices past the last range get new ranges of ``partition_size``. A range
left with no prompt is not registered as a partition. Changing ``partition_size`` re-cuts every range
(every partition key changes, as before this table existed).

The index table also records each index's range (``partition``) and the ``partition_size`` they were cut
with, so a lost :data:`RANGES_FILE` is rebuilt from it with every key as it was (a range is cut once, by
the first build that gives an index in it, and a partial last range keeps its bounds: they cannot be
recomputed from the indices alone). A file that does not read fails the build naming it and the fix.

No Dagster imports.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
from dataclasses import dataclass, field

import polars as pl

from dflash_assets.data.ranges import KEY_DIGITS, key_range, range_key

INDEX_FILE = ("prompt_corpus", "prompt_index.parquet")
RANGES_FILE = ("prompt_corpus", "partition_ranges.json")
INDEX_SCHEMA = {
    "content_hash": pl.String,
    "index": pl.Int64,
    "prompt_id": pl.String,
    "partition": pl.String,  # the key of the range holding the index (None: written before ranges were kept here)
    "partition_size": pl.Int64,  # the size the ranges were cut with
}
_REQUIRED = ("content_hash", "index", "prompt_id")


@dataclass
class IndexTable:
    """Every content hash ever given an index, and the partition ranges cut so far.

    ``prompt_ids``: content hash -> the ``prompt_id`` it last had (to tell an edited prompt, same id and
    new content, from a new one). ``ranges``: inclusive ``(first, last)`` index ranges in order, each a
    partition key once it holds a prompt. ``partition_size``: the size the ranges were cut with (None:
    no range yet)."""

    by_hash: dict[str, int] = field(default_factory=dict)
    prompt_ids: dict[str, str] = field(default_factory=dict)
    ranges: list[tuple[int, int]] = field(default_factory=list)
    partition_size: int | None = None

    @property
    def next_index(self) -> int:
        """The index the next new prompt gets: one past the largest ever given (0 for an empty table)."""
        return max(self.by_hash.values(), default=-1) + 1

    def frame(self) -> pl.DataFrame:
        """The table as stored (INDEX_SCHEMA), sorted by index, each index with the key of its range."""
        firsts = [first for first, _ in self.ranges]
        rows = []
        for h, i in self.by_hash.items():
            k = bisect.bisect_right(firsts, i) - 1
            inside = k >= 0 and self.ranges[k][0] <= i <= self.ranges[k][1]
            rows.append(
                {
                    "content_hash": h,
                    "index": i,
                    "prompt_id": self.prompt_ids.get(h),
                    "partition": range_key(*self.ranges[k]) if inside else None,
                    "partition_size": self.partition_size,
                }
            )
        return pl.DataFrame(rows, schema=INDEX_SCHEMA).sort("index") if rows else pl.DataFrame(schema=INDEX_SCHEMA)


@dataclass
class EditCounts:
    """What a build changed against the corpus before it, in prompts.

    ``new``: content not in the last corpus whose ``prompt_id`` was not there either; ``changed``: content
    not in the last corpus under a ``prompt_id`` the last corpus had with other content (an edited prompt);
    ``removed``: prompts of the last corpus whose content is gone, not counting the old side of a changed
    one; ``kept``: prompts whose content (so index) is unchanged. Cost of the edit: ``new + changed``
    requests (fewer when returning content still has its rows)."""

    new: int = 0
    changed: int = 0
    removed: int = 0
    kept: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"new": self.new, "changed": self.changed, "removed": self.removed, "kept": self.kept}


def load_index(store, previous_corpus: pl.DataFrame | None = None) -> IndexTable:
    """The stored table; without one, a table seeded from ``previous_corpus`` (a corpus written before
    stable indices existed keeps its numbering), else an empty one. The ranges come from :data:`RANGES_FILE`,
    or, when it is gone, from the ranges the stored table records (same keys as before).

    Raises:
        ValueError: a stored file does not read, lacks a column or a key, holds one hash or one index twice,
            or the ranges file is gone and the table does not record ranges (an older table); the message
            names the file and the fix.
    """
    table = IndexTable()
    stored = _read_index(store) if store.exists(*INDEX_FILE) else None
    if stored is not None:
        frame = stored
    elif previous_corpus is not None and previous_corpus.height:
        frame = previous_corpus.select("content_hash", "index", "prompt_id")
    else:
        frame = None
    if frame is not None:
        table.by_hash = dict(zip(frame["content_hash"].to_list(), frame["index"].to_list()))
        table.prompt_ids = dict(zip(frame["content_hash"].to_list(), frame["prompt_id"].to_list()))
    if store.exists(*RANGES_FILE):
        table.ranges, table.partition_size = _read_ranges(store)
    elif stored is not None and stored.height:
        table.ranges, table.partition_size = ranges_from_index(stored, store.uri(*INDEX_FILE), store.uri(*RANGES_FILE))
    return table


def _read_index(store) -> pl.DataFrame:
    """The stored index table, checked.

    Raises:
        ValueError: it does not read as Parquet, lacks a column, or holds a hash or an index twice.
    """
    uri = store.uri(*INDEX_FILE)
    fix = (
        "Restore it from a backup, or delete it: the next build numbers the prompts of corpus.parquet as they "
        "are (prompts removed since lose their old index; their stored rows are requested again if they return)"
    )
    try:
        frame = store.read_parquet(*INDEX_FILE)
    except Exception as exc:
        raise ValueError(
            f"{uri}: not a readable prompt index table ({type(exc).__name__}: {str(exc)[:200]}). {fix}"
        ) from None
    if missing := [c for c in _REQUIRED if c not in frame.columns]:
        raise ValueError(f"{uri}: the prompt index table lacks the column(s) {missing}; the file is damaged. {fix}")
    if frame["content_hash"].n_unique() != frame.height or frame["index"].n_unique() != frame.height:
        raise ValueError(f"{uri}: a content hash or an index appears twice; the file is damaged. {fix}")
    return frame


def _read_ranges(store) -> tuple[list[tuple[int, int]], int | None]:
    """``(ranges, partition_size)`` of :data:`RANGES_FILE`.

    Raises:
        ValueError: not JSON, or not ``{"partition_size": int, "ranges": [[first, last], ...]}`` with
            ``0 <= first <= last`` in increasing order.
    """
    uri = store.uri(*RANGES_FILE)
    fix = f"Delete it: the next build rebuilds the ranges from {store.uri(*INDEX_FILE)} (every key as before)"
    try:
        saved = json.loads(store.read_bytes(*RANGES_FILE))
        ranges = [(int(a), int(b)) for a, b in saved["ranges"]]
        size = saved.get("partition_size")
        size = None if size is None else int(size)
    except Exception as exc:
        raise ValueError(
            f"{uri}: not a readable partition ranges file ({type(exc).__name__}: {str(exc)[:200]}). {fix}"
        ) from None
    if any(a > b or a < 0 for a, b in ranges) or any(b >= c for (_, b), (c, _) in itertools.pairwise(ranges)):
        raise ValueError(f"{uri}: ranges overlap, are out of order or negative; the file is damaged. {fix}")
    return ranges, size


def ranges_from_index(frame: pl.DataFrame, index_uri: str, ranges_uri: str) -> tuple[list[tuple[int, int]], int]:
    """``(ranges, partition_size)`` the stored index table records (its ``partition`` keys, in order).

    Raises:
        ValueError: the table records no ranges (written before it did) or a bad key: the ranges file is then
            the only record, and the message names both files and the fix.
    """
    fix = (
        f"{ranges_uri} is missing and {index_uri} does not record the partition ranges (written by an older "
        "version). Restore partition_ranges.json from a backup; or, to cut every range again from index 0 (every "
        "partition key changes and every partition is generated again), delete prompt_index.parquet too"
    )
    if "partition" not in frame.columns or frame["partition"].null_count() or "partition_size" not in frame.columns:
        raise ValueError(fix)
    sizes = frame["partition_size"].drop_nulls().unique().to_list()
    if len(sizes) != 1:
        raise ValueError(f"{fix} (it records {len(sizes)} partition sizes)")
    try:
        ranges = sorted(key_range(k) for k in frame["partition"].unique().to_list())
    except ValueError as exc:
        raise ValueError(f"{fix} ({exc})") from None
    return ranges, int(sizes[0])


def save_index(store, table: IndexTable) -> None:
    """Write the table, then the ranges (each atomically). A crash between the two leaves ranges that end
    before the table's largest index; the next build cuts the missing ranges again, the same way."""
    store.write_parquet(table.frame(), *INDEX_FILE)
    store.write_json({"partition_size": table.partition_size, "ranges": [list(r) for r in table.ranges]}, *RANGES_FILE)


def assign_indices(prompts: pl.DataFrame, table: IndexTable) -> tuple[pl.DataFrame, IndexTable]:
    """Give each prompt (corpus rows in corpus order, deduplicated, without ``index``) its stable index.

    Returns the rows with ``index`` set, sorted by index, and the updated table (a new object: the
    caller saves it only once the corpus is written). Raises ValueError when the indices would overflow
    the partition key's width."""
    by_hash, ids = dict(table.by_hash), dict(table.prompt_ids)
    next_index = table.next_index
    indices = []
    for chash, prompt_id in zip(prompts["content_hash"].to_list(), prompts["prompt_id"].to_list()):
        if chash not in by_hash:
            by_hash[chash] = next_index
            next_index += 1
        ids[chash] = prompt_id
        indices.append(by_hash[chash])
    if next_index > 10**KEY_DIGITS:
        raise ValueError(f"{next_index} prompt indices exceed the {KEY_DIGITS}-digit partition key width")
    out = prompts.with_columns(pl.Series("index", indices, dtype=pl.Int64)).sort("index")
    return out, IndexTable(by_hash, ids, list(table.ranges), table.partition_size)


def cut_ranges(table: IndexTable, partition_size: int) -> IndexTable:
    """``table`` with ranges covering every index given so far: the ranges already cut kept as they are
    (same ``partition_size``), then ranges of ``partition_size`` from the first index past the last one.
    Another ``partition_size`` than the ranges were cut with re-cuts them all from index 0."""
    ranges = list(table.ranges) if table.partition_size == partition_size else []
    start = ranges[-1][1] + 1 if ranges else 0
    end = table.next_index  # exclusive
    while start < end:
        last = min(start + partition_size, end) - 1
        ranges.append((start, last))
        start = last + 1
    return IndexTable(table.by_hash, table.prompt_ids, ranges, partition_size)


def partition_keys_of(table: IndexTable, indices: list[int]) -> list[str]:
    """Keys of the ranges that hold at least one of ``indices`` (the corpus's), in index order."""
    present = pl.Series(indices, dtype=pl.Int64).sort()
    keys = []
    for first, last in table.ranges:
        lo = present.search_sorted(first, side="left")
        hi = present.search_sorted(last, side="right")
        if hi > lo:
            keys.append(range_key(first, last))
    return keys


def edit_counts(previous: pl.DataFrame | None, current: pl.DataFrame) -> EditCounts:
    """Classify a build against the corpus before it (both with ``content_hash`` and ``prompt_id``)."""
    if previous is None or previous.is_empty():
        return EditCounts(new=current.height)
    old_hashes = set(previous["content_hash"].to_list())
    old_by_id = dict(zip(previous["prompt_id"].to_list(), previous["content_hash"].to_list()))
    counts = EditCounts()
    replaced: set[str] = set()
    for chash, prompt_id in zip(current["content_hash"].to_list(), current["prompt_id"].to_list()):
        if chash in old_hashes:
            counts.kept += 1
        elif prompt_id in old_by_id:
            counts.changed += 1
            replaced.add(old_by_id[prompt_id])
        else:
            counts.new += 1
    current_hashes = set(current["content_hash"].to_list())
    counts.removed = sum(1 for h in old_hashes if h not in current_hashes and h not in replaced)
    return counts


def partition_prompts(corpus: pl.DataFrame, keys: list[str]) -> dict[str, list[tuple[int, str]]]:
    """``{partition key: [(index, content_hash), ...]}`` in index order (keys: sorted, disjoint ranges)."""
    pairs = sorted(zip(corpus["index"].to_list(), corpus["content_hash"].to_list()))
    out, k = {}, 0
    for pk in keys:
        first, last = key_range(pk)
        while k < len(pairs) and pairs[k][0] < first:
            k += 1
        start = k
        while k < len(pairs) and pairs[k][0] <= last:
            k += 1
        out[pk] = pairs[start:k]
    return out


def partition_versions(corpus: pl.DataFrame, keys: list[str]) -> dict[str, str]:
    """``{partition key: version}``: :func:`prompt_version` of each partition's ``(index, content_hash)`` pairs.

    A completions partition records the version it was made for; a corpus build that leaves a partition's
    prompts as they were leaves its version (and so its stored rows' freshness) unchanged."""
    return {pk: prompt_version(rows) for pk, rows in partition_prompts(corpus, keys).items()}


def prompt_version(rows: list[tuple[int, str]]) -> str:
    """The version :func:`partition_versions` gives a partition holding ``(index, content_hash)`` rows."""
    digest = hashlib.sha256()
    for index, chash in sorted(rows):
        digest.update(f"{index}:{chash}\n".encode())
    return digest.hexdigest()[:16]


@dataclass
class StableCorpus:
    """A corpus build with stable indices, not yet written: ``corpus`` (CORPUS_SCHEMA, sorted by index),
    the updated ``table``, the partition ``keys`` that hold prompts, ``versions`` per key, the
    ``edits`` against the corpus stored before and the prompt count (``sizes``) per key."""

    corpus: pl.DataFrame
    table: IndexTable
    keys: list[str]
    versions: dict[str, str]
    edits: EditCounts
    sizes: dict[str, int]


def stable_corpus(
    store, built: pl.DataFrame, partition_size: int, max_prompts: int | None, previous: pl.DataFrame | None
) -> StableCorpus:
    """Number a freshly built corpus (``build_corpus``'s, in corpus order) with stable indices.

    ``max_prompts``: keep the first N prompts in corpus order (sources in the given order, files sorted
    within a source, records in file order) before numbering; each keeps its own stable index, so
    lowering N drops the last ones (their indices become gaps) and raising it brings them back at their
    old indices. ``previous``: the corpus stored before (``index``, ``content_hash``, ``prompt_id``), or
    None; it seeds the table when none is stored yet and is what ``edits`` compares with."""
    if max_prompts is not None:
        built = built.head(max_prompts)
    columns = list(built.columns)
    table = load_index(store, previous)
    numbered, table = assign_indices(built.drop("index"), table)
    table = cut_ranges(table, partition_size)
    corpus = numbered.select(columns)
    keys = partition_keys_of(table, corpus["index"].to_list())
    groups = partition_prompts(corpus, keys)
    return StableCorpus(
        corpus,
        table,
        keys,
        {pk: prompt_version(rows) for pk, rows in groups.items()},
        edit_counts(previous, corpus),
        {pk: len(rows) for pk, rows in groups.items()},
    )
