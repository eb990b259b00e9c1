"""Index-range partition keys shared by every per-prompt stage (no Dagster imports).

Keys are fixed-width, zero-padded, inclusive ranges (``0000000-0000999``) so they sort correctly as
strings in the Dagster UI. Prompt indices are stable across corpus builds (:mod:`dflash_assets.data.prompt_index`),
so a range may have gaps and ranges cut before keep their bounds; new indices get new ranges of
``partition_size``. The Dagster partitions definition over these keys is
:data:`dflash_assets.orchestration.partitions.prompt_ranges`.
"""

from __future__ import annotations

import re

KEY_DIGITS = 7
_KEY_RE = re.compile(rf"^(\d{{{KEY_DIGITS}}})-(\d{{{KEY_DIGITS}}})$")


def partition_keys(num_rows: int, partition_size: int) -> list[str]:
    """Keys covering indexes ``0 .. num_rows-1`` in ranges of ``partition_size`` (last one shorter).

    Raises:
        ValueError: ``partition_size < 1`` or ``num_rows`` does not fit in the key width.
    """
    if partition_size < 1:
        raise ValueError(f"partition_size must be >= 1, got {partition_size}")
    if num_rows > 10**KEY_DIGITS:
        raise ValueError(f"{num_rows} rows exceed the {KEY_DIGITS}-digit partition key width")
    return [
        f"{start:0{KEY_DIGITS}d}-{min(start + partition_size, num_rows) - 1:0{KEY_DIGITS}d}"
        for start in range(0, num_rows, partition_size)
    ]


def range_key(first: int, last: int) -> str:
    """The key of the inclusive index range ``first..last`` (``range_key(0, 999) == '0000000-0000999'``)."""
    return f"{first:0{KEY_DIGITS}d}-{last:0{KEY_DIGITS}d}"


def key_range(partition_key: str) -> tuple[int, int]:
    """``(first, last)`` prompt index of a key, both inclusive.

    Raises:
        ValueError: the key is not of the form ``NNNNNNN-NNNNNNN`` with first <= last.
    """
    match = _KEY_RE.match(partition_key)
    if not match or int(match.group(1)) > int(match.group(2)):
        raise ValueError(f"bad partition key {partition_key!r}: expected e.g. '0000000-0000999'")
    return int(match.group(1)), int(match.group(2))
