"""The prefill that routing a conversation's turns to one server saves, on a simulated node (no GPU, no server).

With ``turns: every`` an agentic conversation gives one completions row per assistant turn, and turn k+1's
prompt starts with turn k's whole prompt (the same system turn and tool schemas, the same earlier messages, the
same ``<|im_start|>assistant`` header). The completions stage routes the turns of one conversation to one server
(``CompletionClient.route_server``, a stable hash of the ``conversation_id``) so that server's prefix cache holds
that shared context; this bench measures what that saves against the client's routing without it (the least
loaded server, i.e. round robin over requests in order).

What is real: the rows (the project's corpus builder on BFCL's multi-turn tasks from the ``bfcl-eval`` wheel,
``turns: every``, ``tools=used`` as the embedded default, train split), their prompt token ids (the embedded
SmolLM2 tokenizer with the shipped ``smollm2_tools.jinja`` template, as the servers render them) and the
routing decision (``CompletionClient.route_server`` itself). What is simulated, and how: each server's prefix
cache is a paged KV cache as vLLM's automatic prefix caching keeps it (full pages of ``--page-size`` 16 tokens,
matched by a hash of the page and every page before it; least recently used pages evicted first, a sequence's
last pages before its first) with ``--capacity`` tokens of room (default 270,000: the stub SGLang server's KV
pool for a 27-32B model on one GPU); a request finds cached what requests sent to its server before it left
there (an earlier turn's prefill is over before the next turn arrives: prefill takes tens of milliseconds,
decoding seconds), and every routed turn goes to its server (the client sends a turn elsewhere only when its
server holds twice its share of the client's slots, not modelled). Generated tokens are not cached (a row's
next turn continues the source's assistant message, not the regenerated one), nor shared between servers.
Single-turn rows would only add cache pressure, equal for both routings: left out.

Prints, per number of servers (2, 4 and 7, the user's node), the prompt tokens prefilled with and without
affinity and their ratio. Headline: the ratio on 7 servers (goal <= 0.5: affinity at least halves prefill).

    python bench/bench_prefix_affinity.py [--tasks N] [--capacity TOKENS] [--page-size 16]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from headline import headline

from dflash_assets.data.shapes import build_corpus
from dflash_assets.generation.client.completion_client import CompletionClient
from dflash_assets.generation.engines.chat_render import read_chat_template, render_prompt, resolve_template_path
from dflash_assets.generation.engines.local_model import ensure_local_model

GOAL = 0.5
SERVERS = (2, 4, 7)


class PagedPrefixCache:
    """One server's prefix cache, in pages of ``page_size`` tokens, ``capacity`` tokens in all.

    A page is known by a hash of its tokens and of every page before it, so a hit is always a prefix. Pages
    are kept least-recently-used first; a request touches its pages last page first, so a sequence's first
    pages (shared by more requests) outlive its last ones.
    """

    def __init__(self, capacity: int, page_size: int) -> None:
        self.page_size = page_size
        self.max_pages = max(1, capacity // page_size)
        self._pages: OrderedDict[int, None] = OrderedDict()

    def _chain(self, ids: list[int]) -> list[int]:
        keys, parent = [], 0
        for start in range(0, len(ids) - self.page_size + 1, self.page_size):
            parent = hash((parent, tuple(ids[start : start + self.page_size])))
            keys.append(parent)
        return keys

    def prefill(self, ids: list[int]) -> int:
        """Serve a prompt of token ids ``ids``: returns the tokens it must prefill (those past its longest cached
        prefix of whole pages), then caches its whole pages."""
        keys = self._chain(ids)
        hit = next((k for k, key in enumerate(keys) if key not in self._pages), len(keys))
        for key in reversed(keys):  # most recent: the first page
            self._pages[key] = None
            self._pages.move_to_end(key)
        while len(self._pages) > self.max_pages:
            self._pages.popitem(last=False)
        return len(ids) - hit * self.page_size


def prompt_rows(tasks: int) -> list[tuple[str, list[int]]]:
    """``(conversation_id, prompt token ids)`` of every row of BFCL's first ``tasks`` training tasks, in corpus
    order, rendered with the embedded model's tokenizer and the shipped tools template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_local_model()))
    tokenizer.chat_template = read_chat_template(resolve_template_path("smollm2_tools.jinja"))
    corpus = build_corpus([f"bfcl:multi_turn_base?limit={tasks}&tools=used&split=train"], turns="every").corpus
    rows = []
    for row in corpus.iter_rows(named=True):
        text = render_prompt(tokenizer, row["messages"], row.get("tools"))
        rows.append((row["conversation_id"], tokenizer(text, add_special_tokens=False)["input_ids"]))
    return rows


def prefilled(rows: list[tuple[str, list[int]]], servers: int, affinity: bool, capacity: int, page_size: int) -> int:
    """Prompt tokens prefilled over ``servers`` simulated servers: a conversation with more than one row goes to
    ``CompletionClient.route_server`` of its id (``affinity``), every other request round robin in order."""
    client = CompletionClient([f"http://10.0.0.{k + 1}:30000/v1" for k in range(servers)])
    caches = {s.label: PagedPrefixCache(capacity, page_size) for s in client._servers}
    labels = list(caches)
    turns: dict[str, int] = {}
    for conversation, _ in rows:
        turns[conversation] = turns.get(conversation, 0) + 1
    next_server = itertools.cycle(labels)
    total = 0
    for conversation, ids in rows:
        routed = affinity and turns[conversation] > 1  # as the completions stage routes (range_stream)
        label = str(client.route_server(conversation)) if routed else next(next_server)
        total += caches[label].prefill(ids)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=100, help="BFCL training tasks (conversations)")
    parser.add_argument("--capacity", type=int, default=270_000, help="each server's prefix cache, tokens")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per cached page (vLLM's block size)")
    args = parser.parse_args()

    started = time.monotonic()
    rows = prompt_rows(args.tasks)
    prompt_tokens = sum(len(ids) for _, ids in rows)
    conversations = len({c for c, _ in rows})
    print(
        f"{len(rows)} rows (assistant turns) of {conversations} BFCL conversations, {prompt_tokens:,} prompt tokens "
        f"(mean {prompt_tokens / len(rows):,.0f}); rendered in {time.monotonic() - started:.1f} s; "
        f"cache {args.capacity:,} tokens per server, pages of {args.page_size}"
    )
    ratio = None
    for servers in SERVERS:
        without = prefilled(rows, servers, False, args.capacity, args.page_size)
        with_affinity = prefilled(rows, servers, True, args.capacity, args.page_size)
        ratio = with_affinity / without
        print(
            f"{servers} servers: prefilled without affinity {without:,} tokens ({without / prompt_tokens:.1%} of "
            f"prompt tokens), with {with_affinity:,} ({with_affinity / prompt_tokens:.1%}): ratio {ratio:.3f}"
        )
    headline(
        f"prompt tokens prefilled with conversation affinity / without, {SERVERS[-1]} simulated servers, "
        f"{len(rows)} turns of {conversations} BFCL conversations (simulated prefix caches, real rows and routing)",
        ratio,
        f"<= {GOAL}",
        ratio <= GOAL,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
