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
request (:meth:`~dflash_assets.generation.client.completion_client.CompletionClient.generate`'s ``follow_up``) built as
a cap raise's continuation is (:mod:`dflash_assets.generation.rows.continuation`: SGLang
``continue_final_message``, the text so far as the final assistant message), to the server that wrote
the text so far (its radix cache still holds it), until the row stops or reaches the cap.

The row is what one request makes for the reason :mod:`~dflash_assets.generation.rows.continuation` gives
(history-free sampling only), with its costs: SGLang re-tokenizes the text at each seam (a seam can
re-split a word), so such rows keep no ``output_token_ids``, and each chunk re-sends its prefix. Every
chunk, the first included, asks for raw text (``separate_reasoning: false``): a reasoning parser strips
the whitespace around the thinking, and a prefix must be what the model wrote, ``\n\n`` at a cut
included. The row is split into thinking and answer once, from the whole text. Chunk parts live in
memory only: a run killed mid-row sends that row again from its first token.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.rows.continuation import NOT_CONTINUED, continuation_body
from dflash_assets.generation.rows.records import THINK_CLOSE, THINK_OPEN, row_from_result


class TailChunker:
    """Which requests of a run are chunked, their follow-ups, and the rows they make.

    Args:
        settings: the run's generation settings (``max_output_tokens`` is the cap every row keeps).
        model: the ``model`` field of requests.
        adapt_body: the server pool's body adapter
            (:meth:`~dflash_assets.generation.servers.pool.ServerPool.adapt_body`).
        opened: the target's generation prompt already ends with ``<think>`` (so the model's text starts
            inside the thinking).
        chunk_tokens: ``max_tokens`` of each chunk (tokens); at or above the cap nothing is chunked.
        window_rows: how many of the stream's last fresh prompts are chunked (0: none).
        total_rows: fresh prompts in the stream (positions count from 1 to it).

    Thread use: :meth:`first_body` on the thread consuming the item stream, :meth:`follow_up` on the
    client's event loop, :meth:`final_row` on the journal writer; a row's state passes from one to the
    next through the client and the results queue, and is never touched by two at once.
    """

    def __init__(
        self,
        settings: GenerationSettings,
        model: str,
        adapt_body: Callable[[dict[str, Any]], dict[str, Any]],
        opened: bool,
        chunk_tokens: int,
        window_rows: int,
        total_rows: int,
    ) -> None:
        self.settings, self.model, self.adapt_body, self.opened = settings, model, adapt_body, opened
        self.chunk_tokens = chunk_tokens
        chunking = 0 < chunk_tokens < settings.max_output_tokens and window_rows > 0
        self.first_chunked = total_rows - window_rows + 1 if chunking else total_rows + 1
        self._rows: dict[int, dict[str, Any]] = {}  # index -> text so far, tokens, requests, first reply's counts
        self.rows_chunked = 0  # rows whose first request was a chunk
        self.follow_ups = 0  # continuation requests asked for

    def first_body(self, position: int, prompt: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        """``body`` for the fresh prompt at ``position`` (1-based) of the stream: capped at the chunk, raw
        text back, when the position is in the window (the prompt then becomes a chunked row)."""
        if position < self.first_chunked:
            return body
        index = int(prompt["index"])
        self._rows[index] = {
            "prompt": prompt,
            "text": "",
            "tokens": 0,
            "requests": 0,
            "latency_s": 0.0,
            "attempts": 0,
            "prompt_tokens": None,
            "error": None,
        }
        self.rows_chunked += 1
        return {
            **body,
            "max_tokens": min(self.chunk_tokens, self.settings.max_output_tokens),
            "separate_reasoning": False,
        }

    def _raw(self, result: Any, first: bool) -> str:
        """The text ``result`` adds, as the model wrote it. A server that split it anyway (no
        ``separate_reasoning`` support) is laid out the Qwen3 way, its parser's trimming not undone."""
        if result.reasoning_content is None:
            return result.content or ""
        head = f"{THINK_OPEN}\n" if first and not self.opened else ""
        tail = f"\n{THINK_CLOSE}\n\n{result.content}" if result.content else ""
        return head + result.reasoning_content + tail

    def follow_up(self, result: Any) -> dict[str, Any] | None:
        """The next chunk's body for ``result`` (a
        :class:`~dflash_assets.generation.client.completion_client.CompletionResult`),
        or None when its row is final: not chunked, failed, stopped, at the cap, or a continuation the
        server answered afresh (a new ``<think>``:
        :data:`~dflash_assets.generation.rows.continuation.NOT_CONTINUED`)."""
        state = self._rows.get(result.index)
        if state is None:
            return None
        first = state["requests"] == 0
        state["requests"] += 1
        state["latency_s"] += float(result.latency_s)
        state["attempts"] += int(result.attempts)
        if result.error is not None:
            return None
        piece = self._raw(result, first)
        if not first and piece.lstrip().startswith(THINK_OPEN):
            state["error"] = NOT_CONTINUED
            return None
        if first:
            state["prompt_tokens"] = result.prompt_tokens  # later replies count the prefix as prompt too
        state["text"] += piece
        state["tokens"] += int(result.completion_tokens or 0)
        done = state["tokens"]
        if result.finish_reason != "length" or not result.completion_tokens or done >= self.settings.max_output_tokens:
            return None
        self.follow_ups += 1
        prompt = state["prompt"]
        body = continuation_body(
            self.settings,
            self.model,
            prompt["messages"],
            {"completion_tokens": done},
            state["text"],
            result.index,
            prompt.get("tools"),
        )
        body["max_tokens"] = min(self.chunk_tokens, self.settings.max_output_tokens - done)
        return self.adapt_body(body)

    def final_row(self, result: Any, prompt: dict[str, Any]) -> dict[str, Any] | None:
        """The row a chunked prompt's last ``result`` completes, None for a prompt that was not chunked.
        Thinking and answer are split from the whole text (the generation prompt's ``<think>`` put back
        when ``opened``); ``completion_tokens``, ``latency_s`` and ``attempts`` are the requests' sums,
        ``prompt_tokens`` the first's; ``tail_chunks`` = the requests when more than one (then no
        ``output_token_ids``: the server re-tokenized the text at each seam); a failed chunk or one
        answered afresh gives an error row (the next run requests the row again from its first token)."""
        state = self._rows.pop(result.index, None)
        if state is None:
            return None
        requests = state["requests"]
        error = result.error or state["error"]
        text = (f"{THINK_OPEN}\n" if self.opened else "") + state["text"]
        whole = SimpleNamespace(
            content=None if error else text,
            reasoning_content=None,
            finish_reason=None if error else result.finish_reason,
            prompt_tokens=state["prompt_tokens"],
            completion_tokens=None if error else state["tokens"],
            output_token_ids=result.output_token_ids if requests == 1 and not error else None,  # one request: its ids
            output_token_ids_source=getattr(result, "output_token_ids_source", None),
            prompt_token_ids=getattr(result, "prompt_token_ids", None) if requests == 1 and not error else None,
            latency_s=state["latency_s"],
            server=result.server,
            attempts=state["attempts"],
            error=error,
            origin=getattr(result, "origin", None),
        )
        row = row_from_result(whole, prompt, self.settings)
        row["tail_chunks"] = requests if requests > 1 else 0
        return row
