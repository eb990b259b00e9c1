"""Follow-up requests of rows generated in parts (:mod:`dflash_assets.generation.rows.tail_chunks`), queued
per server for :meth:`~dflash_assets.generation.client.completion_client.CompletionClient.generate`."""

from __future__ import annotations

import collections
from typing import Any


class FollowUpLanes:
    """Follow-up requests waiting to be sent, one FIFO lane per server that made the part before.

    :meth:`take` for a slot just freed on server ``freed`` gives the oldest of that server's lane (its
    prefix cache holds the part before: no prefill), unless that lane is shorter than the longest one by
    more than ``steal_margin`` items: then the longest lane's follow-up with the fewest tokens so far
    (the cheapest prefix to prefill anew). Round-robin within a lane keeps every long row moving;
    balancing the lanes keeps one server from finishing the run alone. Measured in
    ``bench/bench_node.py`` (scenario ``tail``): with lanes and no balancing one server ended the run
    with a queue while the others idled; with one global FIFO, a third of the prefixes missed the cache.
    """

    def __init__(self, steal_margin: int) -> None:
        self.steal_margin = steal_margin
        self._lanes: dict[str, collections.deque[tuple[int, int, dict[str, Any]]]] = collections.defaultdict(
            collections.deque
        )
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, server: str, tokens: int, index: int, body: dict[str, Any]) -> None:
        """Queue ``body`` for row ``index``, whose parts so far (``tokens``) came from ``server``."""
        self._lanes[server].append((tokens, index, body))
        self._count += 1

    def take(self, freed: str | None) -> tuple[int, dict[str, Any], str | None] | None:
        """``(index, body, server to send it to)`` for a slot freed on ``freed``, or None when empty."""
        if not self._count:
            return None
        lane = self._lanes.get(freed) if freed is not None else None
        longest = max(self._lanes.values(), key=len)
        self._count -= 1
        if lane and len(longest) - len(lane) <= self.steal_margin:
            _, index, body = lane.popleft()
            return index, body, freed
        k = min(enumerate(longest), key=lambda item: item[1][0])[0]  # one pass (deque indexing is O(n))
        _, index, body = longest[k]
        del longest[k]
        return index, body, freed
