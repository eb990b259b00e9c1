"""Token sequences and loss masks from the generation boundary (no Dagster imports).

``input_ids = prompt_ids + completion_ids``: ``prompt_ids`` is the chat template applied to the prompt messages
and tools as the servers hand them to it (:func:`~dflash_assets.generation.engines.chat_render.template_messages`), with
the generation prompt and the row's template settings (thinking on/off); ``completion_ids`` are the server's
generated ids, else the completion re-tokenized exactly as emitted. ``loss_mask`` is 0 on the prompt (earlier
turns, tool results, tool schemas) and 1 on the completion (reasoning, thinking markers, tool-call markup, answer,
and the end-of-turn token of ``stop`` rows). The assistant turn is never re-rendered through the template: that is
where masks go wrong. Rows with the server's ``prompt_token_ids`` are checked against the rendering.

On-policy rows (``completions/<pk>.on_policy.parquet``, :mod:`dflash_assets.data.on_policy`) carry their own
context: ``prompt_ids`` is the row's ``messages`` and ``tools`` rendered the same way (the rendering the on-policy
stage checked against the server's ``prompt_token_ids``), and each row is checked against the corpus row its
conversation started from (:data:`CORPUS_INDEX`) instead of a corpus row at its own index.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from dflash_assets.common.conversation import api_tools
from dflash_assets.data.on_policy import TURN_STRIDE
from dflash_assets.data.row_context import CORPUS_INDEX, CorpusRows
from dflash_assets.generation.engines.chat_render import check_prompt_tokens, template_messages
from dflash_assets.generation.rows.records import THINK_CLOSE, THINK_OPEN, completion_layout

BATCH_ROWS = 128  # rows per batched tokenizer call

TOKENIZED_SCHEMA = {
    "index": pl.Int64,
    "prompt_id": pl.String,
    "prompt_hash": pl.String,  # the corpus's content_hash of the prompt these tokens start with
    "input_ids": pl.List(pl.Int32),
    "loss_mask": pl.List(pl.Int8),
    "prompt_len": pl.Int64,
    "num_loss_tokens": pl.Int64,
    "finish_reason": pl.String,
    "cut": pl.Boolean,
}
#: An on-policy table's schema: TOKENIZED_SCHEMA and :data:`~dflash_assets.data.row_context.CORPUS_INDEX`.
ON_POLICY_TOKENIZED_SCHEMA = {**TOKENIZED_SCHEMA, CORPUS_INDEX: pl.Int64}


class TokenizationError(ValueError):
    """A row cannot be tokenized faithfully (the message says why and how to fix it)."""


@dataclass(frozen=True)
class TokenizePolicy:
    """What to do with rows that are not plain finished completions.

    truncated: ``drop`` (default) or ``keep`` a ``length`` row, without an end token.
    over_max_length: ``drop`` (default) or ``cut`` a sequence longer than ``max_length`` tokens.
    Error rows are always skipped.
    """

    max_length: int = 3072
    truncated: str = "drop"
    over_max_length: str = "drop"

    def __post_init__(self):
        if self.truncated not in ("drop", "keep") or self.over_max_length not in ("drop", "cut"):
            raise ValueError(f"bad policy {self}: truncated in drop|keep, over_max_length in drop|cut")


# GPT-2's byte-to-character map (printable bytes stand for themselves, the other 68 are written as
# U+0100 onwards), which byte-level BPE vocabularies are written in (Radford et al. 2019, the released
# encoder.py). As a str.translate table from a token's characters to latin-1 characters of its bytes.
def _byte_level_translation() -> dict[int, int]:
    kept = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    shifted = [b for b in range(256) if b not in kept]
    return {256 + n: b for n, b in enumerate(shifted)}


def byte_level_token_bytes(tokenizer, sample: int = 2000) -> np.ndarray | None:
    """``table[id]`` = the bytes token ``id`` decodes to, for a Rust tokenizer whose decoder is ByteLevel
    (added tokens: their content's UTF-8); None for any other tokenizer.

    Checked against the tokenizer itself on every added token and ``sample`` regular ones spread over the
    vocabulary: each one's bytes, where they form whole characters, must equal its Rust
    ``decode([id], skip_special_tokens=False)``, else None (the caller then uses the Rust decoder).

    Returns:
        an object array of ``bytes`` of length ``max id + 1`` (missing ids: ``b""``), or None.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel" or not hasattr(
        backend, "get_added_tokens_decoder"
    ):
        return None  # tokenizers.decoders.ByteLevel alone (a Sequence of decoders may change the text)
    translation = _byte_level_translation()
    added = {token.content: i for i, token in backend.get_added_tokens_decoder().items()}
    vocab = backend.get_vocab(with_added_tokens=True)
    table = np.full(max(vocab.values()) + 1, b"", dtype=object)
    for token, i in vocab.items():
        if token in added:
            table[i] = token.encode()
            continue
        try:
            table[i] = token.translate(translation).encode("latin-1")
        except UnicodeEncodeError:
            return None  # a character outside the byte alphabet: not a byte-level vocabulary
    regular = sorted(i for t, i in vocab.items() if t not in added)
    probe = sorted(set(added.values()) | set(regular[:: max(1, len(regular) // sample)]))
    for i, text in zip(probe, backend.decode_batch([[i] for i in probe], skip_special_tokens=False)):
        try:
            mine = table[i].decode("utf-8")
        except UnicodeDecodeError:
            continue  # a partial character on its own: both sides show replacement characters
        if mine != text:
            return None
    return table


class SequenceBuilder:
    """Builds ``input_ids`` / ``loss_mask`` for completions rows with one tokenizer.

    Args:
        tokenizer: a transformers tokenizer with a chat template (the target's).
        end_token: the end-of-turn token appended to ``stop`` rows; default ``<|im_end|>`` when the
            vocabulary has it, else the tokenizer's eos token.
    """

    def __init__(self, tokenizer, end_token: str | None = None):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        if end_token is None:
            end_token = "<|im_end|>" if "<|im_end|>" in vocab else tokenizer.eos_token
        if end_token not in vocab:
            raise TokenizationError(f"end token {end_token!r} is not in the tokenizer's vocabulary")
        self.end_token, self.end_token_id = end_token, vocab[end_token]
        self.has_think_tokens = THINK_OPEN in vocab and THINK_CLOSE in vocab
        template = tokenizer.chat_template or ""
        self.template_knows_thinking = "enable_thinking" in template

    def prompt_text(self, messages: list[dict[str, Any]], enable_thinking: bool, tools: str | list | None = None):
        """The chat template rendered with the generation prompt, as the server rendered it."""
        return self.prompt_texts([messages], [enable_thinking], [tools])[0]

    def prompt_texts(
        self,
        conversations: list[list[dict[str, Any]]],
        enable_thinking: list[bool],
        tools: list[str | list | None] | None = None,
    ) -> list[str]:
        """:meth:`prompt_text` of many conversations (stored messages, through :func:`~dflash_assets.data.
        chat_render.template_messages`), in one batched ``apply_chat_template`` call per ``enable_thinking``
        value and tools list (a fifth faster than one per conversation). ``tools``: each one's stored tools."""
        out: list[str] = [""] * len(conversations)
        offered = [api_tools(t) for t in tools] if tools is not None else [None] * len(conversations)
        groups: dict[tuple[bool, str], list[int]] = {}
        for k, (flag, listed) in enumerate(zip(enable_thinking, offered, strict=True)):
            groups.setdefault((flag, "" if listed is None else json.dumps(listed, sort_keys=True)), []).append(k)
        for (flag, _), where in sorted(groups.items()):
            kwargs: dict[str, Any] = {"enable_thinking": flag} if self.template_knows_thinking else {}
            if offered[where[0]] is not None:
                kwargs["tools"] = offered[where[0]]
            rendered = self.tokenizer.apply_chat_template(
                [template_messages(conversations[k]) for k in where],
                add_generation_prompt=True,
                tokenize=False,
                **kwargs,
            )
            for k, text in zip(where, rendered):
                out[k] = text
        return out

    def prompt_lengths(
        self,
        conversations: list[list[dict[str, Any]]],
        enable_thinking: bool,
        tools: list[str | list | None] | None = None,
    ) -> list[int]:
        """Tokens of each conversation's prompt as the server renders it: the chat template with the
        generation prompt and the thinking flag, tokenized without added special tokens (the
        ``prompt_len`` :meth:`build_many` gives). Batched by ``BATCH_ROWS``; rendering the next batch overlaps
        tokenizing this one, as in :meth:`build_many`."""
        futures = []
        with ThreadPoolExecutor(max_workers=1) as pool:
            for start in range(0, len(conversations), BATCH_ROWS):
                batch = conversations[start : start + BATCH_ROWS]
                listed = tools[start : start + BATCH_ROWS] if tools is not None else None
                futures.append(
                    pool.submit(self.encode_texts, self.prompt_texts(batch, [enable_thinking] * len(batch), listed))
                )
        return [len(ids) for future in futures for ids in future.result()]

    def completion_text(self, row: dict[str, Any], prompt_text: str) -> str:
        """The completion as the model emitted it: ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}`` (Qwen3
        layout; the opening tag omitted when the generation prompt already ends with it), or the answer alone.

        Raises:
            TokenizationError: the row has reasoning but the tokenizer has no thinking markers, or the
                row was made with thinking off yet holds reasoning.
        """
        reasoning, answer = row.get("reasoning_content"), row.get("content") or ""
        enable_thinking = _row_thinking(row)
        if reasoning is None:
            return answer
        if not self.has_think_tokens:
            raise TokenizationError(
                f"row {row['index']}: has reasoning text but the tokenizer has no {THINK_OPEN}/{THINK_CLOSE} tokens; "
                "tokenize with the target model's own tokenizer"
            )
        if not enable_thinking:
            raise TokenizationError(
                f"row {row['index']}: generated with enable_thinking=false but holds reasoning text; "
                "its settings disagree with what the template would render"
            )
        opened = prompt_text.rstrip("\n").endswith(THINK_OPEN)
        return completion_layout(reasoning, answer, bool(row.get("truncated_in_reasoning")), opened)

    def build(
        self, row: dict[str, Any], messages: list[dict[str, Any]], tools: str | list | None = None
    ) -> tuple[list[int], list[int], int]:
        """``(input_ids, loss_mask, prompt_len)`` for one completions row (``tools``: its conversation's).

        Raises:
            TokenizationError: see :meth:`completion_text`.
        """
        built = self.build_many([row], [messages], [tools])[0]
        if isinstance(built, TokenizationError):
            raise built
        input_ids, prompt_len = built
        return input_ids, [0] * prompt_len + [1] * (len(input_ids) - prompt_len), prompt_len

    def build_many(
        self,
        rows: list[dict[str, Any]],
        messages: list[list[dict[str, Any]]],
        tools: list[str | list | None] | None = None,
    ) -> list[tuple[list[int], int] | TokenizationError]:
        """``(input_ids, prompt_len)`` per row (the loss mask is 0 before ``prompt_len``, 1 from it), or the
        row's :class:`TokenizationError`; the same ids as :meth:`build` row by row. ``tools``: each row's
        conversation's stored tools (None: none offers any).

        Texts are tokenized in batched calls of ``BATCH_ROWS`` rows (per-row calls cost 3x the tokenization
        itself) on a worker thread, while this thread renders the next rows' chat templates (the Rust
        tokenizer releases the GIL, so rendering overlaps tokenizing).
        """
        chunks = []
        with ThreadPoolExecutor(max_workers=1) as pool:
            for start in range(0, len(rows), BATCH_ROWS):
                listed = tools[start : start + BATCH_ROWS] if tools is not None else None
                plans, texts = self._plan(
                    rows[start : start + BATCH_ROWS], messages[start : start + BATCH_ROWS], listed
                )
                chunks.append((start, plans, pool.submit(self.encode_texts, texts)))
        out: list[tuple[list[int], int] | TokenizationError] = []
        for start, plans, future in chunks:
            encoded = future.result()
            for row, plan in zip(rows[start : start + BATCH_ROWS], plans):
                if isinstance(plan, TokenizationError):
                    out.append(plan)
                    continue
                p, c, ids = plan
                if ids is None:
                    ids = encoded[c] + [self.end_token_id] if row["finish_reason"] == "stop" else encoded[c]
                out.append((encoded[p] + ids, len(encoded[p])))
        return out

    def _plan(self, rows, messages, tools=None) -> tuple[list, list[str]]:
        """Per row ``(prompt text position, completion text position or None, server ids or None)`` or its
        TokenizationError, and the texts to tokenize."""
        texts: list[str] = []
        plans: list[tuple[int, int | None, list[int] | None] | TokenizationError] = []
        prompt_texts = self.prompt_texts(list(messages), [_row_thinking(row) for row in rows], tools) if rows else []
        for row, prompt_text in zip(rows, prompt_texts, strict=True):
            if row.get("output_token_ids") is not None:
                ids = [int(t) for t in row["output_token_ids"]]
                if row["finish_reason"] == "stop" and (not ids or ids[-1] != self.end_token_id):
                    ids.append(self.end_token_id)
                texts.append(prompt_text)
                plans.append((len(texts) - 1, None, ids))
                continue
            try:
                completion = self.completion_text(row, prompt_text)
            except TokenizationError as exc:
                plans.append(exc)
                continue
            texts += [prompt_text, completion]
            plans.append((len(texts) - 2, len(texts) - 1, None))
        return plans, texts

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """``tokenizer(texts, add_special_tokens=False)["input_ids"]``: through the Rust tokenizer's
        ``encode_batch_fast`` (no character offsets: ~0.7 of the time of the transformers call) when its
        settings are those the transformers call would use (no truncation, no padding, same special-token
        splitting), else through the transformers call."""
        if not texts:
            return []
        backend = self._fast_backend()
        if backend is not None:
            return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    def _fast_backend(self):
        """The Rust tokenizer when it encodes exactly as ``tokenizer(texts, add_special_tokens=False)``, else None."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if (
            backend is None
            or not hasattr(backend, "encode_batch_fast")
            or hasattr(self.tokenizer, "_switch_to_input_mode")
        ):
            return None  # no Rust tokenizer, an old one, or one whose __call__ switches source/target modes
        split = bool(getattr(self.tokenizer, "split_special_tokens", False))
        if backend.truncation is not None or backend.padding is not None or backend.encode_special_tokens != split:
            return None
        return backend

    def decode_completions(self, rows: list[tuple[list[int], int, str]]) -> list[str]:
        """:meth:`decode_completion` for many ``(input_ids, prompt_len, finish_reason)`` rows in one batched
        call (the Rust tokenizer decodes the batch in parallel; per-row calls cost the stage ~half its speed)."""
        ids = []
        for input_ids, prompt_len, finish_reason in rows:
            part = input_ids[prompt_len:]
            if finish_reason == "stop" and part and part[-1] == self.end_token_id:
                part = part[:-1]
            ids.append(part)
        if not ids:
            return []
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            # the Rust tokenizer's own batch decode: what tokenizer.decode returns per row without the
            # Python conversions transformers' batch_decode makes (they cost more than the decoding)
            return backend.decode_batch(ids, skip_special_tokens=False)
        return self.tokenizer.batch_decode(ids, skip_special_tokens=False)

    def decode_spans(self, flat_ids: np.ndarray, spans: list[tuple[int, int, str]]) -> list[str]:
        """Completion texts of rows laid out in one flat id array, as :meth:`decode_completions` returns them.

        Args:
            flat_ids: every row's ``input_ids`` end to end (the values buffer of an Arrow list column), int.
            spans: per row ``(start, end, finish_reason)``: the completion is ``flat_ids[start:end]``; a
                ``stop`` row's trailing end token is dropped.

        For a byte-level BPE tokenizer (GPT-2 / Qwen / SmolLM2 family) the ids are joined through a table
        of each token's bytes (:func:`byte_level_token_bytes`), ~4x faster than the Rust batch decode and
        equal to it; any other tokenizer goes through :meth:`decode_completions`.
        """
        table = self._token_bytes
        if table is None:
            return self.decode_completions([(flat_ids[a:b].tolist(), 0, finish) for a, b, finish in spans])
        out = []
        for start, end, finish in spans:
            if finish == "stop" and end > start and flat_ids[end - 1] == self.end_token_id:
                end -= 1
            out.append(b"".join(table[flat_ids[start:end]]).decode("utf-8", errors="replace"))
        return out

    @functools.cached_property
    def _token_bytes(self) -> np.ndarray | None:
        return byte_level_token_bytes(self.tokenizer)  # built on first use (~0.05 s)

    def decode_completion(self, input_ids: list[int], prompt_len: int, finish_reason: str) -> str:
        """Text of the completion part (end token removed), for the round-trip check."""
        ids = input_ids[prompt_len:]
        if finish_reason == "stop" and ids and ids[-1] == self.end_token_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def _row_thinking(row: dict[str, Any]) -> bool:
    settings = row.get("settings")
    return _thinking_of(settings) if settings else True


@functools.lru_cache(maxsize=64)
def _thinking_of(settings: str) -> bool:
    """``enable_thinking`` of a row's settings JSON (a partition holds one or a few distinct strings)."""
    return bool(json.loads(settings).get("enable_thinking", True))


def tokenize_partition(
    completions: pl.DataFrame,
    prompts: pl.DataFrame,
    builder: SequenceBuilder,
    policy: TokenizePolicy,
    on_policy: bool = False,
) -> tuple[pl.DataFrame, pl.DataFrame, Counter]:
    """Tokenize one partition (one batched tokenizer call, see :meth:`SequenceBuilder.build_many`).

    Args:
        completions: rows with the completions schema; with ``on_policy``, on-policy rows
            (:data:`~dflash_assets.data.on_policy.ON_POLICY_SCHEMA`: their context in ``messages`` / ``tools``).
        prompts: corpus rows (``index``, ``messages``, ``content_hash``, ``tools`` when the corpus has them;
            ``conversation_id`` for ``on_policy``) of the partition. A regeneration row whose ``prompt_hash`` is not
            the corpus's ``content_hash`` at its index is set aside (counted as ``other_prompt``), never paired
            with the corpus's messages. An on-policy row is set aside the same way when the corpus row at
            ``index // TURN_STRIDE`` (its conversation's first) is gone, is of another conversation, or offers
            other tools than the row was generated with.
        on_policy: the rows are on-policy turns: each one's context is its own ``messages`` + ``tools``; the
            table gets :data:`CORPUS_INDEX` and ``prompt_hash`` is its conversation's first corpus row's hash.

    Raises:
        PromptTokensMismatch: a row's ``prompt_token_ids`` (the server's) are not the prompt ids rendered here
            (the message names the first such row and token); nothing of the partition is written.

    Returns:
        ``(tokenized, set_aside, counts)``: TOKENIZED_SCHEMA rows (ON_POLICY_TOKENIZED_SCHEMA with ``on_policy``)
        sorted by ``index``; rows not kept with ``index`` and ``reason``; counts by outcome (kept,
        dropped_truncated, dropped_over_max_length, cut, error_rows, prompt_too_long, tokenization_errors,
        other_prompt).
    """
    corpus = CorpusRows(prompts, on_policy)
    todo, aside, counts = corpus.rows_to_tokenize(completions, policy.truncated)
    built = builder.build_many(todo, *corpus.contexts(todo))
    built_rows = [(row, b[0][: b[1]]) for row, b in zip(todo, built) if not isinstance(b, TokenizationError)]
    if compared := check_prompt_tokens(*zip(*built_rows), decode=builder.tokenizer.decode) if built_rows else 0:
        counts["prompt_ids_checked"] = compared
    kept_rows, kept_ids, prompt_lens, cuts = [], [], [], []
    for row, result in zip(todo, built):
        idx = row["index"]
        if isinstance(result, TokenizationError):
            counts["tokenization_errors"] += 1
            aside.append({"index": idx, "reason": str(result)})
            continue
        input_ids, prompt_len = result
        cut = False
        if len(input_ids) > policy.max_length:
            if policy.over_max_length == "drop" or prompt_len >= policy.max_length:
                counts["dropped_over_max_length"] += 1
                aside.append({"index": idx, "reason": f"{len(input_ids)} tokens > max_length {policy.max_length}"})
                continue
            input_ids, cut = input_ids[: policy.max_length], True
            counts["cut"] += 1
        counts["kept"] += 1
        if on_policy:  # the corpus's hash of the conversation's first row: what later stages check it against
            anchor = idx // TURN_STRIDE
            row = {**row, "prompt_hash": corpus.hashes[anchor], CORPUS_INDEX: anchor}
        kept_rows.append(row)
        kept_ids.append(input_ids)
        prompt_lens.append(prompt_len)
        cuts.append(cut)
    tokenized = _tokenized_frame(kept_rows, kept_ids, prompt_lens, cuts, on_policy)
    aside_df = pl.DataFrame(aside, schema={"index": pl.Int64, "reason": pl.String}).sort("index")
    return tokenized, aside_df, counts


def _tokenized_frame(
    rows: list[dict], input_ids: list[list[int]], prompt_lens: list[int], cuts: list[bool], on_policy: bool = False
) -> pl.DataFrame:
    """TOKENIZED_SCHEMA frame (ON_POLICY_TOKENIZED_SCHEMA with ``on_policy``, even when empty) built from flat
    arrays + offsets (building list columns from Python lists of lists costs as much as the tokenization);
    ``loss_mask`` = 0 before ``prompt_len``, 1 from it."""
    schema = ON_POLICY_TOKENIZED_SCHEMA if on_policy else TOKENIZED_SCHEMA
    if not rows:
        return pl.DataFrame(schema=schema)
    lengths = np.fromiter((len(ids) for ids in input_ids), dtype=np.int64, count=len(input_ids))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat_ids = np.fromiter(itertools.chain.from_iterable(input_ids), dtype=np.int32, count=int(offsets[-1]))
    starts, prompt = np.repeat(offsets[:-1], lengths), np.repeat(np.asarray(prompt_lens, dtype=np.int64), lengths)
    flat_mask = ((np.arange(offsets[-1], dtype=np.int64) - starts) >= prompt).astype(np.int8)
    pa_offsets = pa.array(offsets, type=pa.int64())
    return pl.DataFrame(
        {
            "index": pl.Series([r["index"] for r in rows], dtype=pl.Int64),
            "prompt_id": pl.Series([r["prompt_id"] for r in rows], dtype=pl.String),
            "prompt_hash": pl.Series([r["prompt_hash"] for r in rows], dtype=pl.String),
            "input_ids": pl.from_arrow(pa.LargeListArray.from_arrays(pa_offsets, pa.array(flat_ids))),
            "loss_mask": pl.from_arrow(pa.LargeListArray.from_arrays(pa_offsets, pa.array(flat_mask))),
            "prompt_len": pl.Series(prompt_lens, dtype=pl.Int64),
            "num_loss_tokens": pl.Series(lengths - np.asarray(prompt_lens, dtype=np.int64), dtype=pl.Int64),
            "finish_reason": pl.Series([r["finish_reason"] for r in rows], dtype=pl.String),
            "cut": pl.Series(cuts, dtype=pl.Boolean),
            **({CORPUS_INDEX: pl.Series([r[CORPUS_INDEX] for r in rows], dtype=pl.Int64)} if on_policy else {}),
        }
    ).cast(schema)


def degenerate_mask_mode(num_loss_tokens: list[int], small: int = 16, share: float = 0.5) -> tuple[int, float] | None:
    """The empty-answer signature: more than ``share`` of rows with the same ``num_loss_tokens <= small``.

    Returns ``(length, share)`` of that mode, or None when the distribution is healthy.
    """
    if not num_loss_tokens:
        return None
    length, count = Counter(num_loss_tokens).most_common(1)[0]
    frac = count / len(num_loss_tokens)
    return (length, frac) if length <= small and frac > share else None
