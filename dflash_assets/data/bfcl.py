"""Agentic tool conversations from the Berkeley Function Calling Leaderboard (no Dagster imports).

The ``bfcl-eval`` wheel (Apache 2.0; installed with ``pip install --no-deps``: only its data files and its
executable tool classes are used, nothing that needs its dependencies) ships multi-turn tasks: a user asks, over
several turns, for work done with the tools of a few simulated services (an in-memory file system, a messaging
app, a trading bot, a vehicle, ...), and a ground-truth list of calls per turn. This module

- loads the tasks of a category (:func:`load_tasks`, :class:`BfclTask`);
- turns each service's function docs into an OpenAI ``tools`` list with valid JSON schemas (:func:`openai_tools`);
- executes calls against the task's own instances of the services (:class:`ToolEnvironment`): every result is
  text, an error result (``{"error": ...}``) for an unknown function, bad arguments or an exception, never a crash;
- replays a task's ground truth as an OpenAI-shape conversation record (:func:`ground_truth_record`);
- backs the corpus source ``bfcl:<category>[?limit=N][&split=train|heldout|all][&tools=involved|used]``
  (:func:`source_file`: the records written once as a JSONL file in the cache, read like any prompt file).

Only the services listed in :data:`CLASSES` run: each keeps its state in memory (the file system is a tree of
Python objects; none opens a file, a socket or a process), and a task needing another service (web search,
memory stores) is refused, never run.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

__all__ = [
    "BFCL_VERSION",
    "CATEGORIES",
    "CLASSES",
    "INSTALL_COMMAND",
    "SOURCE_PREFIX",
    "SPLITS",
    "BfclError",
    "BfclTask",
    "ToolEnvironment",
    "bfcl_split",
    "function_docs",
    "ground_truth_record",
    "json_schema",
    "load_tasks",
    "openai_tools",
    "parse_call",
    "source_file",
    "source_records",
]

BFCL_VERSION = "2026.3.23"
INSTALL_COMMAND = f"pip install --no-deps bfcl-eval=={BFCL_VERSION}"  # as in README commands 1 and 2
SOURCE_PREFIX = "bfcl:"
CATEGORIES = ("multi_turn_base",)
SPLITS = ("train", "heldout", "all")
TOOL_CHOICES = ("involved", "used")  # the functions offered: the services', or those the ground truth calls
#: Records written by this version of the replay: bumped when the records change, so a cached file is rewritten.
RECORD_FORMAT = 1
#: The services run, class name -> module under ``func_source_code`` (= its doc file's stem in
#: ``data/multi_turn_func_doc``), as the wheel's ``constants/executable_backend_config.py`` maps them.
CLASSES = {
    "GorillaFileSystem": "gorilla_file_system",
    "MathAPI": "math_api",
    "MessageAPI": "message_api",
    "TwitterAPI": "posting_api",
    "TicketAPI": "ticket_api",
    "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking",
    "VehicleControlAPI": "vehicle_control",
}
STATELESS = {"MathAPI"}  # no scenario to load (the wheel's own executor skips _load_scenario for it)
_SOURCE_PACKAGE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
#: BFCL doc types -> JSON schema types ("any": no type, any JSON value)
_TYPES = {"dict": "object", "float": "number", "tuple": "array", "list": "array", "int": "integer", "bool": "boolean"}
_HELDOUT_PER_10 = 2  # share of tasks held out for evaluation, out of 10


class BfclError(ValueError):
    """bfcl-eval is missing, a source spec is malformed, or a task cannot be replayed; the message says the fix."""


@dataclass(frozen=True)
class BfclTask:
    """One multi-turn task. ``turns``: per turn, its user messages (``[{"role": "user", "content": str}]``);
    ``ground_truth``: per turn, the calls as Python call text (``"mv(source='a', destination='b')"``);
    ``initial_config``: per class name, the scenario its instance starts from; ``excluded_functions``: names
    the task does not offer."""

    id: str
    turns: list[list[dict[str, Any]]]
    ground_truth: list[list[str]]
    initial_config: dict[str, Any]
    involved_classes: list[str]
    excluded_functions: list[str]


def _package_dir() -> Path:
    """The installed ``bfcl_eval`` package directory (found, not imported)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise BfclError(f"the bfcl-eval package is not installed; install it with: {INSTALL_COMMAND}")
    return Path(next(iter(spec.submodule_search_locations)))


def installed_version() -> str:
    """The installed bfcl-eval version (the records depend on it). Raises BfclError when it is not installed."""
    _package_dir()
    return importlib.metadata.version("bfcl-eval")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_tasks(category: str = "multi_turn_base") -> list[BfclTask]:
    """The category's tasks in file order, each with its ground truth.

    Raises:
        BfclError: unknown category, bfcl-eval not installed, a task and its answer out of step, or a task
            involving a service outside :data:`CLASSES`.
    """
    if category not in CATEGORIES:
        raise BfclError(f"unknown BFCL category {category!r}; categories: {list(CATEGORIES)}")
    data = _package_dir() / "data"
    name = f"BFCL_v4_{category}.json"
    answers = {a["id"]: a["ground_truth"] for a in _jsonl(data / "possible_answer" / name)}
    tasks = []
    for raw in _jsonl(data / name):
        task_id = raw["id"]
        other = sorted(set(raw["involved_classes"]) - set(CLASSES))
        if other:
            raise BfclError(f"task {task_id} involves {other}, which are not run (only {sorted(CLASSES)})")
        truth = answers.get(task_id)
        if truth is None or len(truth) != len(raw["question"]):
            raise BfclError(f"task {task_id}: the ground truth does not give one list of calls per turn")
        tasks.append(
            BfclTask(
                task_id,
                raw["question"],
                truth,
                raw.get("initial_config") or {},
                list(raw["involved_classes"]),
                list(raw.get("excluded_function") or []),
            )
        )
    return tasks


def function_docs(class_name: str) -> list[dict[str, Any]]:
    """The BFCL function docs of one service (``{"name", "description", "parameters", "response"}``), in order.

    Raises:
        BfclError: a class outside :data:`CLASSES`, or bfcl-eval not installed.
    """
    if class_name not in CLASSES:
        raise BfclError(f"unknown BFCL class {class_name!r}; classes run: {sorted(CLASSES)}")
    return _jsonl(_package_dir() / "data" / "multi_turn_func_doc" / f"{CLASSES[class_name]}.json")


def json_schema(doc: Any) -> Any:
    """A BFCL parameter doc as a JSON schema: types ``dict`` -> ``object``, ``float`` -> ``number``, ``tuple`` ->
    ``array`` (and the like), ``any`` -> no ``type`` (any value), recursively through ``properties``, ``items`` and
    ``additionalProperties``; other keys (description, enum, default, required) kept."""
    if not isinstance(doc, dict):
        return doc
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key == "type":
            if value != "any":
                out["type"] = _TYPES.get(value, value)
        elif key == "properties":
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = json_schema(value)
        else:
            out[key] = value
    return out


def openai_tools(class_names: list[str], excluded: list[str] = ()) -> list[dict[str, Any]]:
    """The OpenAI ``tools`` list of the services' functions less ``excluded``: ``[{"type": "function", "function":
    {"name", "description", "parameters"}}]``, ``parameters`` an ``object`` schema (:func:`json_schema`), classes
    in the given order, functions in doc order."""
    tools = []
    for class_name in class_names:
        for doc in function_docs(class_name):
            if doc["name"] in excluded:
                continue
            parameters = json_schema(doc.get("parameters") or {})
            parameters = {**parameters, "type": "object"}
            parameters.setdefault("properties", {})
            function = {"name": doc["name"], "description": doc.get("description", ""), "parameters": parameters}
            tools.append({"type": "function", "function": function})
    return tools


def parse_call(call: str, parameter_order: dict[str, list[str]]) -> tuple[str, dict[str, Any]]:
    """``(name, arguments)`` of one ground-truth call text (``"mv(source='a', destination='b')"``), parsed with
    ``ast`` (literal values only, never evaluated): keyword arguments as given, positional ones named by the
    function's parameter order in its docs (``parameter_order``: function name -> parameter names).

    Raises:
        BfclError: not a single call of a plain name with literal arguments, an unknown function with positional
            arguments, more positional arguments than parameters, or an argument given twice.
    """
    try:
        node = ast.parse(call.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError("not a call of a function name")
        name = node.func.id
        positional = [ast.literal_eval(a) for a in node.args]
        keywords = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        if len(keywords) != len(node.keywords):
            raise ValueError("** arguments")
    except (SyntaxError, ValueError) as exc:
        raise BfclError(f"call {call!r} cannot be read: {exc}") from None
    order = parameter_order.get(name, [])
    if len(positional) > len(order):
        raise BfclError(f"call {call!r}: {len(positional)} positional arguments do not fit the parameters {order}")
    arguments = dict(zip(order, positional))
    for param, value in keywords.items():
        if param in arguments:
            raise BfclError(f"call {call!r}: argument {param!r} given twice")
        arguments[param] = value
    return name, arguments


def _result_text(value: Any) -> str:
    """A call's return value as text: its JSON (non-JSON values, e.g. a set or a date, as their text)."""
    return json.dumps(value, ensure_ascii=False, default=str)


def _error_text(message: str) -> str:
    return json.dumps({"error": message}, ensure_ascii=False)


class ToolEnvironment:
    """The services of one task, each a fresh instance loaded with the task's ``initial_config`` (deep-copied:
    the task is never changed), executing calls in order; state carries from call to call, as in a session.

    ``tools``: the OpenAI tools list offered (the involved classes' functions less the excluded ones);
    ``parameter_order``: function name -> its parameter names in doc order. For on-policy turns: build one per
    conversation, execute the model's calls with :meth:`call` in order, and send back the texts as tool messages.

    Raises:
        BfclError: bfcl-eval is not installed, or the task involves a class outside :data:`CLASSES`.
    """

    def __init__(self, task: BfclTask) -> None:
        version = installed_version()  # raises the install hint first
        self.task = task
        self.version = version
        self.tools = openai_tools(task.involved_classes, task.excluded_functions)
        self.parameter_order = {
            t["function"]["name"]: list(t["function"]["parameters"]["properties"]) for t in self.tools
        }
        self._methods: dict[str, Any] = {}
        for class_name in task.involved_classes:
            if class_name not in CLASSES:
                raise BfclError(f"task {task.id}: class {class_name!r} is not run (only {sorted(CLASSES)})")
            module = importlib.import_module(f"{_SOURCE_PACKAGE}.{CLASSES[class_name]}")
            instance = getattr(module, class_name)()
            if class_name not in STATELESS:
                instance._load_scenario(copy.deepcopy(task.initial_config.get(class_name, {})), long_context=False)
            for name in self.parameter_order:
                if name not in self._methods and callable(getattr(type(instance), name, None)):
                    self._methods[name] = getattr(instance, name)

    def call(self, name: str, arguments: str | dict[str, Any]) -> str:
        """Execute one call: ``arguments`` is the JSON text of an object (as a model's tool call gives it) or the
        object. Returns the result text (JSON of the return value), or ``{"error": ...}`` text for an unknown or
        excluded function, arguments that are not a JSON object or do not fit the signature, or any exception the
        call raises. Never raises."""
        method = self._methods.get(name)
        if method is None:
            return _error_text(f"unknown function {name!r}; functions offered: {sorted(self._methods)}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                return _error_text(f"arguments of {name} are not JSON: {exc}")
        if not isinstance(arguments, dict):
            return _error_text(f"arguments of {name} must be a JSON object, got {type(arguments).__name__}")
        try:
            inspect.signature(method).bind(**arguments)
        except TypeError as exc:
            return _error_text(f"bad arguments for {name}: {exc}")
        try:
            return _result_text(method(**arguments))
        except Exception as exc:  # a tool's failure is the model's observation, never the pipeline's crash
            return _error_text(f"{name} raised {type(exc).__name__}: {exc}")


def ground_truth_record(task: BfclTask, tools: str = "involved") -> dict[str, Any]:
    """The task's ground-truth trajectory as an OpenAI-shape record ``{"id", "messages", "tools"}``, executed.

    Messages: no system message; per turn, its user message(s), then per ground-truth call an assistant message
    with one tool call (id ``call_<turn>_<k>``, ``k`` counting the turn's calls from 0; arguments the JSON text of
    the call's arguments, positional ones named as :func:`parse_call` does) followed by the tool message with the
    executed result (:meth:`ToolEnvironment.call`). No closing assistant text is invented after a turn's last call:
    the next user turn follows the last tool result, and the record ends with a tool message (or with the user
    message of a turn without calls; a turn without calls leaves two user messages in a row). With ``turns:
    every`` the corpus makes a row per assistant message plus one for that trailing message.

    ``tools``: ``involved`` (BFCL's setting: every function of the task's services but its excluded ones) or
    ``used`` (only the functions its ground truth calls, in the same order: contexts of ~1K tokens instead of
    3-5K, for a CPU demo; the conversation is the same, the model is offered less to choose from).

    Raises:
        BfclError: a ground-truth call cannot be parsed (see :func:`parse_call`), or bfcl-eval is not installed.
    """
    env = ToolEnvironment(task)
    messages: list[dict[str, Any]] = []
    for turn, (users, calls) in enumerate(zip(task.turns, task.ground_truth)):
        messages.extend({"role": m["role"], "content": m["content"]} for m in users)
        for k, call in enumerate(calls):
            name, arguments = parse_call(call, env.parameter_order)
            arguments_text = json.dumps(arguments, ensure_ascii=False)
            call_id = f"call_{turn}_{k}"
            tool_call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments_text}}
            messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "name": name, "content": env.call(name, arguments)}
            )
    offered = env.tools
    if tools == "used":
        called = {m["tool_calls"][0]["function"]["name"] for m in messages if m.get("tool_calls")}
        offered = [t for t in offered if t["function"]["name"] in called]
    return {"id": task.id, "messages": messages, "tools": offered}


def bfcl_split(task_id: str) -> str:
    """``"heldout"`` for about 2 tasks in 10, else ``"train"``: by a hash of the task id alone, so a task's side
    never changes with the wheel version, the order or the other tasks. The corpus source takes the train side
    by default; an evaluation can take the held-out one (``split=heldout``)."""
    bucket = int(hashlib.sha256(f"bfcl-split:{task_id}".encode()).hexdigest()[:8], 16) % 10
    return "heldout" if bucket < _HELDOUT_PER_10 else "train"


#: The largest ``limit=`` taken: more than any category holds, few enough digits for a directory name.
MAX_LIMIT = 1_000_000


def _said(spec: str) -> str:
    """``spec`` as an error quotes it: its first 120 characters (a 5000-digit limit is not repeated)."""
    return repr(spec if len(spec) <= 120 else spec[:120] + "...")


def _parse_spec(spec: str) -> tuple[str, int | None, str, str]:
    """``(category, limit, split, tools)`` of a ``bfcl:<category>[?limit=N][&split=...][&tools=involved|used]``
    spec.

    Raises:
        BfclError: naming the source and the option: an unknown category or option, an option given twice, a
            ``#...`` suffix, a limit that is not a whole number from 1 to :data:`MAX_LIMIT` in ASCII digits
            (``limit=²`` passed ``str.isdigit``; a 300-digit one made a directory name too long, a 5000-digit one
            hit Python's int conversion limit), or another value outside its words.
    """
    parts = urlsplit(spec[len(SOURCE_PREFIX) :])
    category = parts.path
    if category not in CATEGORIES:
        raise BfclError(f"source {_said(spec)}: unknown BFCL category {category!r}; categories: {list(CATEGORIES)}")
    options = f"options: limit=N (1 to {MAX_LIMIT}), split={'|'.join(SPLITS)}, tools={'|'.join(TOOL_CHOICES)}"
    if "#" in spec:
        raise BfclError(f"source {_said(spec)}: a '#...' suffix is not an option; remove it ({options})")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    names = [name for name, _ in pairs]
    unknown = sorted(set(names) - {"limit", "split", "tools"})
    if unknown:
        raise BfclError(f"source {_said(spec)}: unknown option(s) {unknown}; {options}")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise BfclError(f"source {_said(spec)}: option(s) {twice} given more than once; give each once ({options})")
    query = dict(pairs)
    limit = None
    if "limit" in query:
        text = query["limit"]
        if not (re.fullmatch(r"[0-9]{1,7}", text) and 1 <= int(text) <= MAX_LIMIT):
            raise BfclError(
                f"source {_said(spec)}: limit must be a positive integer (1 to {MAX_LIMIT}, digits 0-9), got "
                f"{_said(text)}"
            )
        limit = int(text)
    split = query.get("split", "train")
    if split not in SPLITS:
        raise BfclError(f"source {_said(spec)}: split must be one of {list(SPLITS)}, got {_said(split)}")
    tools = query.get("tools", "involved")
    if tools not in TOOL_CHOICES:
        raise BfclError(f"source {_said(spec)}: tools must be one of {list(TOOL_CHOICES)}, got {_said(tools)}")
    return category, limit, split, tools


def check_source_spec(spec: str) -> str:
    """``spec`` unchanged when it is not a ``bfcl:`` source or its options are well formed (the config's start-up
    check runs it on every source, issue 50).

    Raises:
        BfclError: as :func:`source_records` for a malformed spec, before any task is read."""
    if spec.startswith(SOURCE_PREFIX):
        _parse_spec(spec)
    return spec


def source_records(spec: str) -> list[dict[str, Any]]:
    """The records a ``bfcl:`` source spec gives: its category's tasks on the chosen side of :func:`bfcl_split`
    (default ``train``; ``all`` for both), in file order, the first ``limit`` of them, each replayed by
    :func:`ground_truth_record`.

    Raises:
        BfclError: a malformed spec (naming the option), bfcl-eval not installed, or a task that cannot be replayed.
    """
    category, limit, split, tools = _parse_spec(spec)
    tasks = [t for t in load_tasks(category) if split == "all" or bfcl_split(t.id) == split]
    return [ground_truth_record(t, tools) for t in tasks[:limit]]


def source_file(spec: str, cache: Path) -> Path:
    """The JSONL file holding a ``bfcl:`` source's records (:func:`source_records`), written once (atomically)
    under ``cache/bfcl/`` in a directory named by the wheel version, the record format and the spec's options,
    then reused: the same wheel gives the same file, so the same rows, content hashes and indices. The file is
    named ``bfcl_<category>.jsonl``, so the corpus's source name (and ``conversation_id`` prefix) is
    ``bfcl_<category>`` whatever the limit or split.

    Raises:
        BfclError: as :func:`source_records`.
    """
    category, limit, split, tools = _parse_spec(spec)
    directory = cache / "bfcl" / f"bfcl-eval-{installed_version()}-r{RECORD_FORMAT}" / split
    directory = directory / (f"limit-{limit}" if limit else "all-tasks") / f"tools-{tools}"
    path = directory / f"bfcl_{category}.jsonl"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    records = source_records(spec)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".bfcl-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")  # key order kept: tools render in it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
