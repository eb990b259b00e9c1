"""What a completions run continues rather than generates from the first token: rows a lower cap cut
(:mod:`dflash_assets.generation.rows.continuation`), and the end of the run generated in chunks
(:mod:`dflash_assets.generation.rows.tail_chunks`); both need servers that continue a final assistant
message and the target's tokenizer, decided once per run by :meth:`ContinuationPlanner.gate`."""

from __future__ import annotations

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.rows.continuation import (
    FIRST_CONTINUING_SGLANG,
    continuable,
    history_free,
    sglang_predates_continuation,
)
from dflash_assets.generation.rows.records import THINK_OPEN
from dflash_assets.stages.resources.inference import InferenceServerResource


def installed_version(package: str) -> str | None:
    """``package``'s installed version in this interpreter, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def missing_directory(path: str) -> None:
    """Raise FileNotFoundError for a tokenizer path written as a directory (absolute, ``./``, ``../``,
    ``~``) that is not one: transformers would report it as a malformed hub id."""
    from pathlib import Path

    if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().is_dir():  # "org/name" may be a hub id
        raise FileNotFoundError(f"no such directory: {path}")


def load_target_builder(inference: InferenceServerResource, chat_template=None):
    """A SequenceBuilder on the target's tokenizer, from a local directory or a hub id already in the
    local cache (no network wait on a GPU node), its chat template replaced by the file ``chat_template``
    (``target_model.chat_template``, the servers' template) when given; it renders a conversation as the servers'
    engine hands it to the template (``inference.backend()``). Raises whatever loading raises (FileNotFoundError
    for a directory path that is not one, ChatTemplateError for an unreadable template)."""
    from transformers import AutoTokenizer

    from dflash_assets.data.sequence_builder import SequenceBuilder
    from dflash_assets.generation.engines.chat_render import read_chat_template

    path = str(inference.tokenizer_path())
    missing_directory(path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return SequenceBuilder(tokenizer, engine=inference.backend())


def check_tool_rendering(inference: InferenceServerResource, chat_template, prompts):
    """Before any request: when one of ``prompts`` (corpus rows: a DataFrame or dicts) uses tools
    (:func:`~dflash_assets.generation.engines.chat_render.uses_tools`), the target's template (``chat_template``, the
    file ``target_model.chat_template`` names, else the model's own) must render a probe conversation's tools, tool call
    and tool result (:func:`~dflash_assets.generation.engines.chat_render.check_renders_tools`), and the servers must
    run without a tool-call parser (rows keep the model's own markup and ids).

    Returns:
        the :class:`~dflash_assets.data.tokenization.SequenceBuilder` it loaded, None when no prompt uses tools.

    Raises:
        RangeRunError: the template leaves a part out or fails, the target's tokenizer does not load, or the
            servers' ``extra_args`` hold a tool-call parser flag; the message names the row, the key and the fix.
    """
    from dflash_assets.generation.engines.chat_render import ChatTemplateError, check_renders_tools, corpus_uses_tools
    from dflash_assets.generation.rows.range_plan import RangeRunError
    from dflash_assets.stages.resources.inference import tool_parser_flag

    first = corpus_uses_tools(prompts)
    if first is None:
        return None
    section = {"vllm": inference.vllm.extra_args, "sglang": inference.sglang.extra_args}.get(inference.mode, ())
    if flag := tool_parser_flag(section):
        raise RangeRunError(
            f"row {first} and others use tools, and resources.inference.{inference.mode}.extra_args holds {flag}: "
            "the server would parse the model's tool-call markup out of its reply, and the rows must keep it as "
            f"generated (the model's own output ids); remove {flag}"
        )
    where = f"the target model at {inference.tokenizer_path()}" + (
        f" with {chat_template}" if chat_template is not None else ""
    )
    try:
        builder = load_target_builder(inference, chat_template)
    except ChatTemplateError as exc:
        raise RangeRunError(str(exc)) from None
    except Exception as exc:
        raise RangeRunError(
            f"row {first} and others use tools, and the target's tokenizer did not load from "
            f"{inference.tokenizer_path()} to check that its chat template renders them "
            f"({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    try:
        check_renders_tools(builder.tokenizer, where, builder.engine)
    except ChatTemplateError as exc:
        raise RangeRunError(f"row {first}: {exc}") from None
    return builder


class ContinuationPlanner:
    """The continuation plan of one run (its ``settings``); :meth:`gate` is computed once. Safe to run in
    a thread: it logs nothing. ``parts``: the run's partitions with something to request (``todo``: corpus
    rows; ``existing``: index -> the stored or journaled row)."""

    def __init__(self, settings: GenerationSettings, chat_template=None) -> None:
        self.settings = settings
        self.chat_template = chat_template  # target_model.chat_template's file (the servers'), or None
        self._gate: tuple[str | None, bool, bool] | None = None

    def continuations(
        self, inference: InferenceServerResource, parts: list
    ) -> tuple[dict[int, dict], bool, str | None, bool]:
        """Rows to continue rather than regenerate (see :mod:`dflash_assets.generation.rows.continuation`).

        Returns ``(continuing, opened, note, problem)``: index -> the row as it is (not a copy);
        whether the target's generation prompt already ends with ``<think>`` (decides each prefix's
        layout); a line for the run log (None when no row was cut by a lower cap); whether that line
        reports a problem (a warning). ``continuing`` is empty, the line saying why, when the servers
        cannot continue (:meth:`gate`). Safe to run in a thread: it logs nothing.
        """
        settings = self.settings
        found = [
            (p, part.existing[p["index"]])
            for part in parts
            for p in part.todo
            if continuable(part.existing.get(p["index"]), settings)
        ]
        if not found:
            return {}, False, None, False
        why_not, problem, opened = self.gate(inference, found[0][0]["messages"])
        if why_not is not None:
            return (
                {},
                False,
                f"{len(found)} rows cut by a lower cap are regenerated from their first token: {why_not}",
                problem,
            )
        reused = sum(int(row["completion_tokens"]) for _, row in found)
        return (
            {p["index"]: row for p, row in found},
            opened,
            f"{len(found)} rows cut by a lower cap are continued from the {reused:,} tokens they have "
            f"(continue_final_message; max_tokens = {settings.max_output_tokens} minus each row's tokens)",
            False,
        )

    def plan(self, inference: InferenceServerResource, parts: list):
        """:meth:`continuations` and :meth:`tail`, in that order (one thread, while servers start)."""
        found = self.continuations(inference, parts)
        return found, self.tail(inference, parts, found[0])

    def gate(self, inference: InferenceServerResource, messages: list[dict]) -> tuple[str | None, bool, bool]:
        """Whether these servers can continue a row: ``(why_not, problem, opened)``. ``why_not`` is None
        when they can; else it says why not (``continue_truncated`` off, not SGLang, an SGLang before
        ``continue_final_message``, a target tokenizer that does not load or render: the ``problem``
        cases). ``opened``: the target's generation prompt (rendered for ``messages``) ends with
        ``<think>``. Computed once per run."""
        if self._gate is not None:
            return self._gate
        why_not, problem, opened = None, False, False
        if not inference.client.continue_truncated:
            why_not = "inference.client.continue_truncated is false"
        elif inference.backend() != "sglang":
            why_not = f"continue_final_message is SGLang's and these servers are {inference.backend()!r}"
        elif (
            inference.mode == "sglang"
            and inference.sglang.launch_module.startswith("sglang.")
            and sglang_predates_continuation(installed := installed_version("sglang"))
        ):
            # the servers run with this interpreter, so its SGLang is theirs
            why_not = f"the installed SGLang {installed} predates continue_final_message ({FIRST_CONTINUING_SGLANG})"
            problem = True
        else:
            try:
                builder = load_target_builder(inference, self.chat_template)
                # the generation prompt's ending is the template's, not the conversation's: render one
                opened = builder.prompt_text(messages, self.settings.enable_thinking).rstrip("\n").endswith(THINK_OPEN)
            except Exception as exc:
                why_not, problem = (
                    (
                        f"the target's tokenizer did not load from {inference.tokenizer_path()} (a directory, or a "
                        f"hub id in the local cache) or did not render ({type(exc).__name__}: {str(exc)[:200]})"
                    ),
                    True,
                )
        self._gate = (why_not, problem, opened)
        return self._gate

    def tail(
        self, inference: InferenceServerResource, parts: list, continuing: dict[int, dict]
    ) -> tuple[tuple[int, bool] | None, str | None, bool]:
        """Whether the end of this run is generated in chunks (``inference.client.tail_chunk_tokens``,
        :mod:`dflash_assets.generation.rows.tail_chunks`): ``((chunk_tokens, opened) or None, note, problem)``.
        Off (None) when not configured or the sampling is not history-free; not possible (a warning)
        when the servers cannot continue. ``continuing``: :meth:`continuations`' rows (not chunked: they
        are continued whole). Safe to run in a thread: it logs nothing."""
        settings, chunk = self.settings, inference.client.tail_chunk_tokens
        if not chunk:
            return None, None, False
        if chunk >= settings.max_output_tokens:
            return (
                None,
                (
                    f"inference.client.tail_chunk_tokens is not used: {chunk} is not below the cap "
                    f"{settings.max_output_tokens}"
                ),
                False,
            )
        if not history_free(settings):
            return (
                None,
                (
                    "inference.client.tail_chunk_tokens is ignored: a seed or a presence/repetition penalty makes a "
                    "continued row differ from one generated whole"
                ),
                False,
            )
        fresh = [p for part in parts for p in part.todo if p["index"] not in continuing]
        if not fresh:
            return None, None, False
        why_not, _problem, opened = self.gate(inference, fresh[0]["messages"])
        if why_not is not None:
            return None, f"inference.client.tail_chunk_tokens is not used: {why_not}", True
        return (chunk, opened), None, False
