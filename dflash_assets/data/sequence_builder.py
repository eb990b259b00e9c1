"""Per-row token sequences from a completions row: :class:`SequenceBuilder` renders a context as the serving
engine hands it to the chat template and lays out ``input_ids`` from the generation boundary, the server's ids
where it gave them (no Dagster imports; :mod:`dflash_assets.data.tokenization` tokenizes whole partitions with it).
"""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from dflash_assets.common.conversation import api_messages, api_tools
from dflash_assets.data.token_bytes import byte_level_token_bytes
from dflash_assets.generation.engines.engine_render import engine_of, render_engine_inputs, template_inputs
from dflash_assets.generation.rows.records import (
    IDS_RENDERED,
    IDS_SERVER,
    THINK_CLOSE,
    THINK_OPEN,
    completion_layout,
)

__all__ = ["BATCH_ROWS", "Built", "SequenceBuilder", "TokenizationError", "row_thinking", "server_ids"]

BATCH_ROWS = 128  # rows per batched tokenizer call


class TokenizationError(ValueError):
    """A row cannot be tokenized faithfully (the message says why and how to fix it)."""


class Built(NamedTuple):
    """One row's training sequence: ``input_ids`` (the loss mask is 0 before ``prompt_len``, 1 from it), where
    its ids come from (``source``: :data:`~dflash_assets.generation.rows.records.IDS_SERVER` or ``IDS_RENDERED``),
    the project's own rendering of its context (``rendered``: the check against the server's ids) and the engine
    whose hand-over that rendering reproduced."""

    input_ids: list[int]
    prompt_len: int
    source: str
    rendered: list[int]
    engine: str


def server_ids(row: dict[str, Any]) -> bool:
    """Whether a completions row's training ids are the server's: it says so (``ids_source``; a row made before
    the column never is) and holds both its prompt ids and its generated ids."""
    return (
        row.get("ids_source") == IDS_SERVER
        and row.get("prompt_token_ids") is not None
        and row.get("output_token_ids") is not None
    )


class SequenceBuilder:
    """Builds ``input_ids`` / ``loss_mask`` for completions rows with one tokenizer.

    Args:
        tokenizer: a transformers tokenizer with a chat template (the target's).
        end_token: the end-of-turn token appended to ``stop`` rows; default ``<|im_end|>`` when the
            vocabulary has it, else the tokenizer's eos token.
    """

    def __init__(self, tokenizer, end_token: str | None = None, engine: str | None = None):
        self.tokenizer = tokenizer
        #: whose hand-over to the template renderings reproduce (:func:`~dflash_assets.generation.engines.engine_render.
        #: template_inputs`) when a row names none: the servers' engine (``inference.backend()``)
        self.engine = engine_of(engine)
        vocab = tokenizer.get_vocab()
        if end_token is None:
            end_token = "<|im_end|>" if "<|im_end|>" in vocab else tokenizer.eos_token
        if end_token not in vocab:
            raise TokenizationError(f"end token {end_token!r} is not in the tokenizer's vocabulary")
        self.end_token, self.end_token_id = end_token, vocab[end_token]
        self.has_think_tokens = THINK_OPEN in vocab and THINK_CLOSE in vocab
        template = tokenizer.chat_template or ""
        self.template_knows_thinking = "enable_thinking" in template

    def prompt_text(
        self,
        messages: list[dict[str, Any]],
        enable_thinking: bool,
        tools: str | list | None = None,
        engine: str | None = None,
    ):
        """The chat template rendered with the generation prompt, as the server (``engine``, default
        :attr:`engine`) renders it."""
        return self.prompt_texts([messages], [enable_thinking], [tools], None if engine is None else [engine])[0]

    def template_kwargs(self, enable_thinking: bool) -> dict[str, Any]:
        """The request's ``chat_template_kwargs`` as they reach the template: ``enable_thinking`` where the
        template reads it (vLLM passes only what the template reads; SGLang passes it whatever)."""
        return {"enable_thinking": enable_thinking} if self.template_knows_thinking else {}

    def prompt_texts(
        self,
        conversations: list[list[dict[str, Any]]],
        enable_thinking: list[bool],
        tools: list[str | list | None] | None = None,
        engines: list[str | None] | None = None,
    ) -> list[str]:
        """:meth:`prompt_text` of many conversations (stored messages and tools, handed to the template as each
        one's engine hands them: :func:`~dflash_assets.generation.engines.engine_render.template_inputs`;
        ``engines`` None: :attr:`engine` for all), in one batched ``apply_chat_template`` call per engine,
        ``enable_thinking`` value and tools list (a fifth faster than one per conversation). ``tools``: each one's
        stored tools."""
        out: list[str] = [""] * len(conversations)
        offered = [api_tools(t) for t in tools] if tools is not None else [None] * len(conversations)
        engines = [engine_of(e) if e else self.engine for e in engines] if engines else [self.engine] * len(out)
        groups: dict[tuple[str, bool, str], list[int]] = {}
        for k, (engine, flag, listed) in enumerate(zip(engines, enable_thinking, offered, strict=True)):
            key = (engine, flag, "" if listed is None else json.dumps(listed, sort_keys=True))
            groups.setdefault(key, []).append(k)
        for (engine, flag, _), where in sorted(groups.items()):
            inputs = [
                template_inputs(engine, api_messages(conversations[k]), offered[k], self.template_kwargs(flag))
                for k in where
            ]
            rendered = render_engine_inputs(self.tokenizer, engine, [i[0] for i in inputs], inputs[0][1], inputs[0][2])
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
        enable_thinking = row_thinking(row)
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
        return (
            built.input_ids,
            [0] * built.prompt_len + [1] * (len(built.input_ids) - built.prompt_len),
            built.prompt_len,
        )

    def build_many(
        self,
        rows: list[dict[str, Any]],
        messages: list[list[dict[str, Any]]],
        tools: list[str | list | None] | None = None,
    ) -> list[Built | TokenizationError]:
        """A :class:`Built` per row (the loss mask is 0 before ``prompt_len``, 1 from it), or the row's
        :class:`TokenizationError`; the same ids as :meth:`build` row by row. ``tools``: each row's
        conversation's stored tools (None: none offers any).

        A row whose ``ids_source`` is the server's (:data:`~dflash_assets.generation.rows.records.IDS_SERVER`: the
        reply gave its prompt ids and its generated ids) is exactly those ids, plus the end token of a ``stop``
        row whose ids lack it; any other row is the context rendered here (as the row's ``engine`` hands it to the
        template, else :attr:`engine`) followed by its generated ids, else its text encoded as emitted. Every row's
        rendering is kept (``rendered``), the check the caller holds against the server's ids.

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
        out: list[Built | TokenizationError] = []
        for start, plans, future in chunks:
            encoded = future.result()
            for row, plan in zip(rows[start : start + BATCH_ROWS], plans):
                if isinstance(plan, TokenizationError):
                    out.append(plan)
                    continue
                p, c, ids, engine = plan
                if ids is None:
                    ids = encoded[c] + [self.end_token_id] if row["finish_reason"] == "stop" else encoded[c]
                rendered = encoded[p]
                if server_ids(row):
                    prompt = [int(t) for t in row["prompt_token_ids"]]
                    out.append(Built(prompt + ids, len(prompt), IDS_SERVER, rendered, engine))
                else:
                    out.append(Built(rendered + ids, len(rendered), IDS_RENDERED, rendered, engine))
        return out

    def _plan(self, rows, messages, tools=None) -> tuple[list, list[str]]:
        """Per row ``(prompt text position, completion text position or None, output ids or None, engine)`` or
        its TokenizationError, and the texts to tokenize."""
        texts: list[str] = []
        plans: list[tuple[int, int | None, list[int] | None, str] | TokenizationError] = []
        engines = [engine_of(row.get("engine")) if row.get("engine") else self.engine for row in rows]
        thinking = [row_thinking(row) for row in rows]
        prompt_texts = self.prompt_texts(list(messages), thinking, tools, engines) if rows else []
        for row, prompt_text, engine in zip(rows, prompt_texts, engines, strict=True):
            if row.get("output_token_ids") is not None:
                ids = [int(t) for t in row["output_token_ids"]]
                if row["finish_reason"] == "stop" and (not ids or ids[-1] != self.end_token_id):
                    ids.append(self.end_token_id)
                texts.append(prompt_text)
                plans.append((len(texts) - 1, None, ids, engine))
                continue
            try:
                completion = self.completion_text(row, prompt_text)
            except TokenizationError as exc:
                plans.append(exc)
                continue
            texts += [prompt_text, completion]
            plans.append((len(texts) - 2, len(texts) - 1, None, engine))
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


def row_thinking(row: dict[str, Any]) -> bool:
    settings = row.get("settings")
    return _thinking_of(settings) if settings else True


@functools.lru_cache(maxsize=64)
def _thinking_of(settings: str) -> bool:
    """``enable_thinking`` of a row's settings JSON (a partition holds one or a few distinct strings)."""
    return bool(json.loads(settings).get("enable_thinking", True))
