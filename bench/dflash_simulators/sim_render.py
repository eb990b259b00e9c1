"""The GPU-node simulator's prompt rendering, with a real tokenizer (``sglang_stub --sim-tokenizer``): a chat
request's prompt ids as SGLang 0.5.23 makes them, and reply ids that decode to the reply's text.

SGLang's chat endpoint (``serving_chat.OpenAIServingChat._process_messages``, ``_apply_jinja_template``,
``_render_and_encode_chat_template``) hands the template the request's messages and, unless ``tool_choice`` is
"none", its tools as its own ``Tool`` model dumps them; renders the text with ``add_generation_prompt`` and the
request's ``chat_template_kwargs``; encodes it (``tokenizer.encode``, which adds no special token to a Qwen or
SmolLM2 prompt); and, for ``continue_final_message``, leaves the last assistant message out of the rendering and
appends its text's ids (``_append_assistant_prefix_to_prompt_ids``). The dumps are
:mod:`dflash_assets.generation.engines.engine_render`'s, which ``dflash_assets_tests/test_sglang_contract.py``
holds against SGLang's own code; the simulator uses them rather than a copy so that what it serves is what that
test judged.

Where it differs from SGLang (besides running no model): the reply's ids are drawn (one id for a thinking token,
one for an answer token, :meth:`SimRenderer.reply_ids`) and its text is their decoding, all of it in ``content``:
no reasoning parser splits it (the embedded model writes no ``<think>``); a template that fails on the tools as
dumped is not retried with bare functions here (:func:`~dflash_assets.generation.engines.engine_render.
render_engine_inputs` does that only where the engine is named ``sglang``, which it is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_assets.generation.engines.engine_render import render_engine_inputs, sglang_messages, sglang_tool


class SimRenderer:
    """SGLang's rendering of requests for the served model at ``model_path`` with the ``chat_template`` file
    (``--chat-template``; None: the model's own)."""

    def __init__(self, model_path: str, chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        if chat_template:
            self.tokenizer.chat_template = Path(chat_template).read_text(encoding="utf-8")
        encode = self.tokenizer.encode
        self.think_id, self.answer_id = (
            encode(" t", add_special_tokens=False)[0],
            encode(" a", add_special_tokens=False)[0],
        )

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """The ids SGLang would put in ``choices[0].prompt_token_ids`` for the chat request ``body``."""
        messages = list(body.get("messages") or [])
        continued = (
            bool(body.get("continue_final_message")) and bool(messages) and messages[-1].get("role") == "assistant"
        )
        prefix = messages[-1].get("content") if continued else None
        shaped = sglang_messages(messages, continue_final_message=continued)
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        dumped = [sglang_tool(t) for t in tools] if tools else None
        kwargs = {"add_generation_prompt": True, **(body.get("chat_template_kwargs") or {})}
        text = render_engine_inputs(self.tokenizer, "sglang", [shaped], dumped, kwargs)[0]
        ids = list(self.tokenizer.encode(text))
        if isinstance(prefix, str) and prefix:
            ids += self.tokenizer.encode(prefix, add_special_tokens=False)
        return ids

    def reply_ids(self, thinking: int, answering: int) -> list[int]:
        """The ids of a reply of ``thinking`` thinking and ``answering`` answer tokens (words ``t`` and ``a``)."""
        return [self.think_id] * thinking + [self.answer_id] * answering

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)
