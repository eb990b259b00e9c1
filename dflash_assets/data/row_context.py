"""Which context a completions row is tokenized with, and why a row is not one of the corpus's (no Dagster).

A regeneration row answers the corpus's prompt at its ``index``: its context is that corpus row's ``messages`` and
``tools``, and the row is the corpus's while its ``prompt_hash`` is the corpus's ``content_hash`` there. An on-policy
row (:mod:`dflash_assets.data.on_policy`) carries its own context (``messages``, ``tools``: JSON text of the
conversation as sent) and is a turn of the conversation the corpus starts at ``index // TURN_STRIDE``; it is the
corpus's while that corpus row is still that conversation's, offering the same tools.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import polars as pl

from dflash_assets.data.on_policy import TURN_STRIDE
from dflash_assets.generation.rows.records import PROMPT_TOO_LONG

__all__ = ["CORPUS_INDEX", "CorpusRows", "other_conversation", "other_prompt"]

#: The column an on-policy tokenized table adds (and only it, so a regeneration table's bytes stay what they were):
#: the corpus index of the row its conversation started from (``index // TURN_STRIDE``), whose content hash
#: ``prompt_hash`` is. Readers take a row's corpus row as ``corpus_index`` when present, else ``index``.
CORPUS_INDEX = "corpus_index"


class CorpusRows:
    """The corpus rows of a partition (``prompts``: ``index``, ``messages``, ``content_hash``, ``tools`` when the
    corpus has them, ``conversation_id`` for ``on_policy``), as the completions rows to tokenize are matched
    against them: regeneration rows (``on_policy`` False) or on-policy turns."""

    def __init__(self, prompts: pl.DataFrame, on_policy: bool):
        index = prompts["index"].to_list()
        self.on_policy = on_policy
        self.messages = dict(zip(index, prompts["messages"].to_list()))
        self.tools = dict(zip(index, prompts["tools"].to_list())) if "tools" in prompts.columns else {}  # old: none
        self.hashes = dict(zip(index, prompts["content_hash"].to_list()))
        self.conversations = dict(zip(index, prompts["conversation_id"].to_list())) if on_policy else {}

    def other(self, row: dict[str, Any]) -> str | None:
        """Why ``row`` is not one of this corpus's (:func:`other_conversation` / :func:`other_prompt`), or None."""
        if self.on_policy:
            return other_conversation(row, self.hashes, self.conversations, self.tools)
        return other_prompt(row, self.hashes)

    def contexts(self, rows: list[dict[str, Any]]) -> tuple[list[list[dict[str, Any]]], list[str | None]]:
        """``(messages, tools)`` per row, to render its prompt with: an on-policy turn's own (its context exactly as
        sent), else the corpus row's at its index."""
        if self.on_policy:
            return [json.loads(row["messages"]) for row in rows], [row["tools"] for row in rows]
        return [self.messages[row["index"]] for row in rows], [self.tools.get(row["index"]) for row in rows]

    def rows_to_tokenize(self, completions: pl.DataFrame, truncated: str) -> tuple[list[dict], list[dict], Counter]:
        """``(rows to tokenize, rows set aside as {index, reason}, counts)`` of ``completions`` by index: a row not
        the corpus's (``other_prompt``), an error row, a prompt never sent as too long, and with ``truncated``
        ``drop`` a row the cap cut, are set aside."""
        aside, counts, todo = [], Counter(), []
        for row in completions.sort("index").iter_rows(named=True):
            idx = row["index"]
            # joined by index AND prompt: a row made for another prompt (or for a removed one) is never tokenized
            if (other := self.other(row)) is not None:
                counts["other_prompt"] += 1
                aside.append({"index": idx, "reason": other})
            elif row.get("error"):
                counts["error_rows"] += 1
                aside.append({"index": idx, "reason": f"error row: {row['error'][:200]}"})
            elif row["finish_reason"] == PROMPT_TOO_LONG:  # never sent: nothing the model wrote
                counts["prompt_too_long"] += 1
                aside.append({"index": idx, "reason": f"{PROMPT_TOO_LONG}: never sent ({row['prompt_tokens']} tokens)"})
            elif row["finish_reason"] != "stop" and truncated == "drop":
                counts["dropped_truncated"] += 1
                aside.append({"index": idx, "reason": f"finish_reason {row['finish_reason']} (policy truncated=drop)"})
            else:
                todo.append(row)
        return todo, aside, counts


def other_prompt(row: dict[str, Any], hash_by_index: dict[int, str]) -> str | None:
    """Why a regeneration row does not answer the corpus's prompt at its index, or None."""
    idx = row["index"]
    if idx not in hash_by_index:
        return "prompt removed: the corpus has no prompt at this index"
    if row.get("prompt_hash") != hash_by_index[idx]:
        return (
            f"prompt changed: the row answers prompt {row.get('prompt_hash')}, the corpus has "
            f"{hash_by_index[idx]} at this index; rerun completions for this partition"
        )
    return None


def other_conversation(
    row: dict[str, Any], hash_by_index: dict[int, str], conversation_by_index: dict, tools_by_index: dict
) -> str | None:
    """Why an on-policy row is not a turn of a conversation the corpus still starts at ``index // TURN_STRIDE``
    with the tools the row was generated with, or None."""
    anchor, cid = row["index"] // TURN_STRIDE, row.get("conversation_id")
    fix = "rerun completions for this partition (mode: on_policy)"
    if anchor not in hash_by_index:
        return f"conversation removed: the corpus has no row at index {anchor}, where {cid} started; {fix}"
    if (there := conversation_by_index.get(anchor)) != cid:
        return f"conversation changed: the corpus row at {anchor} is of {there}, not {cid}; {fix}"
    if (row.get("tools") or None) != (tools_by_index.get(anchor) or None):
        return f"tools changed: the corpus offers other tools in {cid} than this turn was generated with; {fix}"
    return None
