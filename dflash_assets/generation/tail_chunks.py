"""Generating the end of a run in chunks, so its last minutes keep every slot busy.

Why: a client that cannot know output lengths in advance sends prompts first come, first served; the
run then ends with the slots emptying one by one while the last long requests finish (one 4,096-token
request is ~47 s at 87.5 tok/s). On a 2,000-prompt run over 280 slots that idles ~15% of the node
(``bench/bench_drain.py``); on the user's 900K prompts, ~0.03%. Generating the last prompts in chunks,
each continued only after every fresh prompt has gone out, starts all of them early and lets the long
ones fill the slots the short ones leave: at zero cost 0.970 instead of 0.854 on that run (last 1,000
prompts at 512 tokens).

How: the last ``window_rows`` fresh prompts of the stream are sent with ``max_tokens`` = the chunk; a
reply cut there (``finish_reason`` length, fewer tokens than the cap) is continued by a follow-up
request (:meth:`~dflash_assets.generation.client.CompletionClient.generate`'s ``follow_up``) built as a
cap raise's continuation is (:mod:`dflash_assets.generation.continuation`: SGLang
``continue_final_message``, the text so far as the final assistant message), to the server that wrote
the text so far (its radix cache still holds it), until the row stops or reaches the cap.

The row is what one request makes for the reason :mod:`~dflash_assets.generation.continuation` gives
(history-free sampling only), with its costs: SGLang re-tokenizes the text at each seam (a seam can
re-split a word), so such rows keep no ``output_token_ids``, and each chunk re-sends its prefix. Chunk
parts live in memory only: a run killed mid-row sends that row again from its first token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dflash_assets.generation.continuation import continuation_body, merge_continuation, prefix_text
from dflash_assets.generation.records import row_from_result
from dflash_assets.settings import GenerationSettings


class TailChunker:
    """Which requests of a run are chunked, their follow-ups, and the rows they make.

    Args:
        settings: the run's generation settings (``max_output_tokens`` is the cap every row keeps).
        model: the ``model`` field of requests.
        adapt_body: the server pool's body adapter (:meth:`~dflash_assets.generation.servers.ServerPool.adapt_body`).
        opened: the target's generation prompt already ends with ``<think>`` (the prefix layout).
        chunk_tokens: ``max_tokens`` of each chunk (tokens); at or above the cap nothing is chunked.
        window_rows: how many of the stream's last fresh prompts are chunked.
        total_rows: fresh prompts in the stream (positions count from 1 to it).

    Thread use: :meth:`first_body` on the thread consuming the item stream, :meth:`follow_up` on the
    client's event loop, :meth:`final_row` on the journal writer; a row's state passes from one to the
    next and is never touched by two at once.
    """

    def __init__(self, settings: GenerationSettings, model: str, adapt_body: Callable[[dict[str, Any]], dict[str, Any]],
                 opened: bool, chunk_tokens: int, window_rows: int, total_rows: int) -> None:
        self.settings, self.model, self.adapt_body, self.opened = settings, model, adapt_body, opened
        self.chunk_tokens = chunk_tokens
        self.first_chunked = total_rows - window_rows + 1 if 0 < chunk_tokens < settings.max_output_tokens else total_rows + 1
        self._rows: dict[int, dict[str, Any] | None] = {}  # index -> the row so far (None: first chunk out)
        self._prompts: dict[int, dict[str, Any]] = {}
        self._chunks: dict[int, int] = {}
        self.rows_chunked = 0  # rows whose first request was a chunk
        self.follow_ups = 0  # continuation requests sent

    def first_body(self, position: int, prompt: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        """``body`` for the fresh prompt at ``position`` (1-based) of the stream: capped at the chunk
        when the position is in the window (the prompt then becomes a chunked row)."""
        if position < self.first_chunked:
            return body
        index = int(prompt["index"])
        self._rows[index], self._prompts[index], self._chunks[index] = None, prompt, 1
        self.rows_chunked += 1
        return {**body, "max_tokens": min(self.chunk_tokens, self.settings.max_output_tokens)}

    def follow_up(self, result: Any) -> dict[str, Any] | None:
        """The next chunk's body for ``result`` (a :class:`~dflash_assets.generation.client.CompletionResult`),
        or None when its row is final: not chunked, failed, stopped, or at the cap. A continuation the
        server answered afresh is final too (:func:`merge_continuation` makes it an error row)."""
        index = result.index
        if index not in self._rows or result.error is not None or result.finish_reason != "length":
            return None
        prior, prompt = self._rows[index], self._prompts[index]
        done = (int(prior["completion_tokens"]) if prior is not None else 0) + int(result.completion_tokens or 0)
        if done >= self.settings.max_output_tokens or not result.completion_tokens:
            return None
        row = merge_continuation(prior, result, prompt, self.settings) if prior is not None else row_from_result(result, prompt, self.settings)
        if row.get("error") is not None:
            return None
        self._rows[index] = row
        self._chunks[index] += 1
        self.follow_ups += 1
        body = continuation_body(self.settings, self.model, prompt["messages"], row, prefix_text(row, self.opened), index)
        body["max_tokens"] = min(self.chunk_tokens, self.settings.max_output_tokens - done)
        return self.adapt_body(body)

    def final_row(self, result: Any, prompt: dict[str, Any]) -> dict[str, Any] | None:
        """The row a chunked prompt's last ``result`` completes (its parts merged, ``tail_chunks`` = the
        requests that made it, ``continued_from_tokens`` 0: no earlier run wrote any of it); None for a
        prompt that was not chunked."""
        index = result.index
        if index not in self._rows:
            return None
        prior, chunks = self._rows.pop(index), self._chunks.pop(index)
        self._prompts.pop(index, None)
        if prior is None:
            return row_from_result(result, prompt, self.settings)  # done within its first chunk: one request
        row = merge_continuation(prior, result, prompt, self.settings)
        row["tail_chunks"] = chunks
        if row.get("error") is None:
            row["continued_from_tokens"] = 0
        return row
