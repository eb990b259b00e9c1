"""The package's layout rules (issues 28, 33): imports go down the layers of docs/design.md (app, assets,
stages, cores) and never in a circle (annotation-only imports counted), the cores import no Dagster, no config
type lives in an asset module, modules and asset bodies are of bounded size. Read from the source with
``ast``: nothing is imported."""

from __future__ import annotations

import ast
import re
import textwrap
import warnings
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dflash_assets"
SIMULATORS = PACKAGE.parent / "bench" / "dflash_simulators"  # import package dflash_simulators
# A module past WARN_MODULE_LINES is worth a look, not a failure: split it where its concern changes, never at a line
# count (issue 51). Past MAX_MODULE_LINES it is a wall, and fails.
WARN_MODULE_LINES = 500
MAX_MODULE_LINES = 800
MAX_ASSET_BODY_LINES = 55
ASSET_DECORATORS = {"asset", "multi_asset", "graph_asset", "graph_multi_asset"}

# The rooms, top to bottom (docs/design.md, "Layout"): a module imports modules of its own room and of the rooms
# below, never above. Each room belongs to one of the four layers; the package root holds only the rooms,
# definitions.py and __main__.py (the app's), the package's own __init__ (its version: the bottom) and configs/.
LAYERS = ("app", "assets", "stages", "cores")
ROOMS = {
    "app": "app",
    "assets": "assets",
    "stages": "stages",
    "orchestration": "stages",
    "data": "cores",
    "generation": "cores",
    "dflash": "cores",
    "storage": "cores",
    "common": "cores",
}
# The rooms inside two rooms (issue 51), top to bottom as docs/design.md draws them: a module of a sub-room imports
# modules of its own sub-room and of the sub-rooms below it in the same room, never above; the room's folder holds
# only its sub-rooms and its own __init__.
SUBROOMS = {
    "generation": ("client", "rows", "servers", "engines", "processes", "api"),
    "dflash": ("training", "decoding", "export", "shards", "model", "target"),
}
# A folder of the package holds at most this many modules directly (its __init__ counted): past it, the prefixes
# of its files name the rooms waiting to be made.
MAX_FOLDER_MODULES = 20
ROOT_MODULES = {"definitions": "app", "__main__": "app"}
ROOT_ENTRIES = {"__init__.py", "__main__.py", "definitions.py", "configs", *ROOMS}
# Imports up the rooms that stay, each lazy (inside the function that needs it) and why. Add none lightly; each is
# named in docs/design.md. None left (issue 51).
UP_ALLOWED: set[tuple[str, str]] = set()
# The arrows back up to the assembly: definitions.py assembles the app's schedule and sensor and the stages' resources,
# and two app modules read what it assembled (the main job runs its assets with its resources; the summary reads its
# storage resource and check keys), imported once the shell has chosen the config file. docs/design.md names each.
ASSEMBLY = "dflash_assets.definitions"
ASSEMBLY_IMPORTERS = {"dflash_assets.app.main_job", "dflash_assets.app.summary"}

# A function (def to its last line, docstring included) of at most this many lines: past it, its parts want names
# (a class or steps that read as a table of contents, issue 51).
MAX_FUNCTION_LINES = 100
# The functions still over it, each being rewritten elsewhere; remove an entry once its function fits. None left.
LONG_FUNCTIONS_ALLOWED: set[str] = set()

# Files still over a limit, each to be split (issue 28); remove an entry once its file fits. None left.
OVER_MODULE_LIMIT: set[str] = set()
OVER_ASSET_BODY_LIMIT: set[str] = set()


def _modules() -> dict[str, Path]:
    """``{dotted module name: path}`` of every module in the package and in the simulators' package."""
    out = {}
    for root in (PACKAGE, SIMULATORS):
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement: at module level, inside functions, and under ``if TYPE_CHECKING:`` (an
    annotation is a dependency a reader must follow too)."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _import_graph() -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``; ``from pkg import mod`` counts as importing ``mod``."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif node.level == 0 and node.module:
                targets.add(node.module)
                targets.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path back to its start) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_path_within(graph, set(c)) for c in components]


def _path_within(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A cycle through the component's first module, for the failure message."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def test_cycle_finder_finds_a_cycle_and_no_false_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_imports_of_type_checking_blocks_are_counted():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\nelse:\n    import y\n"
        "def f():\n    import z\n"
    )
    names = sorted(a.name for node in _imports(tree) if isinstance(node, ast.Import) for a in node.names)
    assert names == ["x", "y", "z"]


def test_no_import_cycles():
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def room(module: str) -> str:
    """The room of a module of the package (``dflash_assets.x.y``): its folder ``x``, or the app for the root's
    definitions and ``__main__``; the package itself (its version) is in the bottom room. The simulators
    (``dflash_simulators``) are for tests and benches: "bench", above every room."""
    parts = module.split(".")
    if parts[0] == "dflash_simulators":
        return "bench"
    if len(parts) == 1:
        return list(ROOMS)[-1]
    return ROOT_MODULES.get(parts[1]) or parts[1]


def layer(module: str) -> str:
    """The layer of a module: its room's (``ROOMS``); "bench" for the simulators."""
    return "bench" if room(module) == "bench" else ROOMS[room(module)]


def test_room_and_layer_finders_name_each():
    assert room("dflash_assets.app.main_job") == "app" and layer("dflash_assets.app.main_job") == "app"
    assert room("dflash_assets.definitions") == "app"
    assert layer("dflash_assets.assets.drafter") == "assets"
    assert room("dflash_assets.stages.drafter.settings") == "stages"
    assert room("dflash_assets.orchestration.freshness") == "orchestration"
    assert layer("dflash_assets.orchestration.freshness") == "stages"
    assert (
        room("dflash_assets.generation.client.completion_client") == "generation"
        and layer("dflash_assets.generation.client.completion_client") == "cores"
    )
    assert room("dflash_assets") == "common"
    assert layer("dflash_simulators.sglang_stub") == "bench"


def test_the_package_root_holds_only_the_rooms():
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert entries == ROOT_ENTRIES, f"unexpected at the package root: {sorted(entries - ROOT_ENTRIES)}"
    for name in ROOMS:
        init = PACKAGE / name / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{name}/__init__.py must say what the room holds"


def _ups() -> list[tuple[str, str]]:
    graph = _import_graph()
    order = [*ROOMS]
    return [
        (m, d)
        for m in sorted(graph)
        for d in sorted(graph[m])
        if room(m) != "bench" and (room(d) == "bench" or order.index(room(d)) < order.index(room(m)))
    ]


def test_imports_go_down_the_rooms():
    up = [f"{m} ({room(m)}) -> {d} ({room(d)})" for m, d in _ups() if (m, d) not in UP_ALLOWED]
    assert not up, "imports up the rooms (docs/design.md, Layout): " + "; ".join(up)


def test_allowed_imports_up_still_exist():
    """An allowed arrow up that is gone is stale: remove it so the rule covers that pair again."""
    stale = UP_ALLOWED - set(_ups())
    assert not stale, f"remove from UP_ALLOWED: {sorted(stale)}"


def test_only_the_named_modules_import_the_assembly():
    graph = _import_graph()
    importers = {m for m, deps in graph.items() if ASSEMBLY in deps and room(m) != "bench"}
    assert importers == ASSEMBLY_IMPORTERS, f"modules importing {ASSEMBLY}: {sorted(importers)}"


def _source_path(module: str) -> str:
    """``app/main_job.py`` for ``dflash_assets.app.main_job``, as docs/design.md names files."""
    return module.removeprefix("dflash_assets.").replace(".", "/") + ".py"


def test_design_doc_names_every_arrow_back_up():
    """docs/design.md's Layout names each arrow back up that stays, as ```a.py` -> `b.py```."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    arrows = {*UP_ALLOWED, *((m, ASSEMBLY) for m in ASSEMBLY_IMPORTERS)}
    unnamed = [
        f"{_source_path(m)} -> {_source_path(d)}"
        for m, d in sorted(arrows)
        if f"`{_source_path(m)}` -> `{_source_path(d)}`" not in text
    ]
    assert not unnamed, f"arrows back up docs/design.md does not name: {unnamed}"


def test_design_doc_shows_the_rooms_in_order():
    """docs/design.md's picture of the layout lists the rooms top to bottom as ``ROOMS`` does."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    picture = text.split("## Layout", 1)[1].split("```")[1]
    drawn = [name for name in re.findall(r"^([a-z]+)/", picture, re.M) if name != "bench"]
    assert drawn == list(ROOMS), f"docs/design.md draws {drawn}, test_layout.ROOMS says {list(ROOMS)}"


def subroom(module: str) -> str | None:
    """The sub-room of a module of a room with sub-rooms (``dflash_assets.generation.client.attempts``: ``client``);
    None for other modules and for the room's own ``__init__``."""
    parts = module.split(".")
    if parts[0] != "dflash_assets" or len(parts) < 4 or parts[1] not in SUBROOMS:
        return None
    return parts[2]


def test_subroom_finder_names_each():
    assert subroom("dflash_assets.generation.client.attempts") == "client"
    assert subroom("dflash_assets.dflash.training") is None
    assert subroom("dflash_assets.dflash.training.loop") == "training"
    assert subroom("dflash_assets.data.tokenization") is None


def test_rooms_with_subrooms_hold_only_them():
    """``generation/`` and ``dflash/`` hold their sub-rooms (each a package whose ``__init__`` says what it holds
    and what it may import) and their own ``__init__``, nothing else."""
    for name, subrooms in SUBROOMS.items():
        folder = PACKAGE / name
        entries = {p.name for p in folder.iterdir() if p.name != "__pycache__"}
        assert entries == {"__init__.py", *subrooms}, f"{name}/ holds {sorted(entries)}, SUBROOMS says {subrooms}"
        for sub in subrooms:
            init = folder / sub / "__init__.py"
            assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), (
                f"{name}/{sub}/__init__.py must say what the room holds and what it may import"
            )


def test_imports_go_down_the_subrooms():
    graph = _import_graph()
    up = []
    for m in sorted(graph):
        for d in sorted(graph[m]):
            if room(m) != room(d) or room(m) not in SUBROOMS or subroom(m) is None or subroom(d) is None:
                continue
            order = SUBROOMS[room(m)]
            if order.index(subroom(d)) < order.index(subroom(m)):
                up.append(f"{m} ({subroom(m)}) -> {d} ({subroom(d)})")
    assert not up, "imports up the sub-rooms (docs/design.md, Layout): " + "; ".join(up)


def test_no_folder_holds_too_many_modules():
    crowded = {}
    for root in (PACKAGE, SIMULATORS):
        for folder in sorted({p.parent for p in root.rglob("*.py")}):
            count = len(list(folder.glob("*.py")))
            if count > MAX_FOLDER_MODULES:
                crowded[folder.relative_to(PACKAGE.parent).as_posix()] = count
    assert not crowded, f"folders over {MAX_FOLDER_MODULES} modules (cut them into rooms by role): {crowded}"


def test_design_doc_shows_the_subrooms_in_order():
    """docs/design.md's picture of the layout lists each room's sub-rooms, indented under it, as ``SUBROOMS``."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    picture = text.split("## Layout", 1)[1].split("```")[1]
    drawn: dict[str, list[str]] = {}
    current = None
    for line in picture.splitlines():
        if top := re.match(r"^([a-z]+)/", line):
            current = top.group(1)
        elif (sub := re.match(r"^ {2}([a-z_]+)/", line)) and current:
            drawn.setdefault(current, []).append(sub.group(1))
    assert drawn == {k: list(v) for k, v in SUBROOMS.items()}, (
        f"docs/design.md draws {drawn}, test_layout.SUBROOMS says {SUBROOMS}"
    )


def _layout_block_modules() -> dict[str, set[str]]:
    """``{folder: module file names named on its lines}`` of docs/design.md's "Package layout" block: a line at
    two spaces opens a room (``app/``), at four a folder inside it (``generation/client/``), and continued lines
    belong to the folder opened last."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    block = text.split("## Package layout", 1)[1].split("```")[1]
    named: dict[str, set[str]] = {}
    top = current = ""
    for line in block.strip("\n").splitlines()[1:]:  # after "dflash_assets/"
        if line and not line.startswith(" "):
            break  # bench/, docs/: outside the package
        if opened := re.match(r"^  ([a-z_]+)/", line):
            top = current = opened.group(1)
        elif opened := re.match(r"^ {4}([a-z_]+)/", line):
            current = f"{top}/{opened.group(1)}"
        named.setdefault(current, set()).update(re.findall(r"\b([a-z_0-9]+\.py)\b", line))
    return named


def test_design_doc_package_layout_names_every_module():
    named = _layout_block_modules()
    missing = {}
    for folder in sorted({p.parent for p in PACKAGE.rglob("*.py")} - {PACKAGE}):
        rel = folder.relative_to(PACKAGE).as_posix()
        modules = {p.name for p in folder.glob("*.py")} - {"__init__.py"}
        if rel not in named:
            missing[rel] = ["(the folder)"]
        elif left := sorted(modules - named[rel]):
            missing[rel] = left
    assert not missing, f"docs/design.md's package layout leaves out: {missing}"


def test_cores_import_no_dagster():
    offenders = []
    for name, path in _modules().items():
        if layer(name) != "cores":
            continue
        for node in _imports(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n == "dagster" or n.startswith(("dagster.", "dagster_")) for n in names):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offenders, (
        f"the cores (data/, generation/, dflash/, storage/, common/) must not import Dagster: {offenders}"
    )


def test_config_types_live_outside_asset_modules():
    """A stage's settings (a ``Config`` subclass) live with the code that reads them, so that code never
    imports an asset module for a type."""
    found = []
    for path in sorted((PACKAGE / "assets").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and any(
                (b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")) == "Config" for b in node.bases
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert not found, f"config types in asset modules (move them beside the code that uses them): {found}"


def test_a_stage_package_keeps_its_config_type_in_config_py():
    """A stage cut into a package (``stages/completions/``, ``drafter/``, ``evaluation/``) declares its ``Config``
    in its ``config.py``, named for the stage, whichever of its modules reads it (issue 51)."""
    found = []
    for package in sorted(p.parent for p in (PACKAGE / "stages").glob("*/config.py")):
        for path in sorted(package.glob("*.py")):
            if path.name == "config.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and any(
                    (b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")) == "Config" for b in node.bases
                ):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert not found, f"config types outside their stage's config.py: {found}"


def _defined(path: Path) -> set[str]:
    """Names a module binds itself at top level (functions, classes, assignments, also inside ``if``/``try``),
    not names it imports."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(sub.name)
            elif isinstance(sub, (ast.Assign, ast.AnnAssign)):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _sources() -> list[Path]:
    """Every Python file of the project: the package, its tests, the benches."""
    root = PACKAGE.parent
    files = [*PACKAGE.rglob("*.py"), *(root / "dflash_assets_tests").rglob("*.py"), *(root / "bench").rglob("*.py")]
    return [*sorted(files), root / "bench" / "run_all"]


def _script_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Imports of the Python scripts a file holds as string literals (run with ``python -c`` or written out
    for a subprocess); ``{...}`` fields of a script filled by ``str.format`` are read as ``None``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import " in node.value:
            text = textwrap.dedent(node.value)
            for source in (text, re.sub(r"\{[^{}]*\}", "None", text)):
                try:
                    found += _imports(ast.parse(source))
                    break
                except SyntaxError:
                    continue
    return found


def test_names_are_imported_from_the_module_that_defines_them():
    """No re-exports: a name moved to another module is imported from there, so a reader finds it in the
    module named, and the old module does not keep it alive."""
    modules = _modules()
    defined = {name: _defined(path) for name, path in modules.items()}
    through = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree) + _script_imports(tree):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                through += [
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.module}.{a.name}"
                    for a in node.names
                    if a.name not in defined[node.module] and f"{node.module}.{a.name}" not in modules
                ]
    assert not through, f"imported through a module that does not define them: {through}"


def test_no_private_names_are_imported_across_modules():
    """A name with a leading underscore is its module's own: a module of the package that needs another's makes it
    public there (named and documented), rather than reaching into it."""
    modules = _modules()
    reached = []
    for name, path in modules.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module in modules and node.module != name:
                reached += [
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not reached, f"private names imported from another module: {reached}"


def test_script_imports_are_read():
    script = '"""\n    import os\n    from a import b\n    x = {name!r}\n"""'
    tree = ast.parse(f"S = {script}\nT = 'not code: import this'\n")
    assert [type(n).__name__ for n in _script_imports(tree)] == ["Import", "ImportFrom"]


def test_all_lists_only_names_defined_there():
    lists = {}
    for name, path in _modules().items():
        for node in ast.parse(path.read_text(), str(path)).body:
            if not (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)):
                continue
            if extra := [e.value for e in node.value.elts if e.value not in _defined(path)]:
                lists[name] = extra
    assert not lists, f"__all__ re-exports names defined elsewhere: {lists}"


def test_module_sizes():
    """Past ``WARN_MODULE_LINES`` a warning names the module (look where its concern changes); past
    ``MAX_MODULE_LINES`` the test fails."""
    long, over = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > WARN_MODULE_LINES:
            long[rel] = lines
        if lines > MAX_MODULE_LINES and rel not in OVER_MODULE_LIMIT:
            over[rel] = lines
    if long:
        warnings.warn(
            f"modules over {WARN_MODULE_LINES} lines (split one where its concern changes, if it holds two): {long}",
            stacklevel=1,
        )
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {over}"


def _function_lengths(path: Path) -> dict[str, int]:
    """``{qualified name: lines from def to its end}`` of every function of a module, methods and nested ones
    included (``Class.method``, ``outer.inner``)."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[prefix + child.name] = child.end_lineno - child.lineno + 1
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return lengths


def test_function_length_finder_counts_def_to_end(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("class A:\n    def f(self):\n        def g():\n            pass\n        return g\n")
    assert _function_lengths(module) == {"A.f": 4, "A.f.g": 2}


def test_functions_are_short():
    long = {
        f"{path.relative_to(PACKAGE).as_posix()}:{name}": lines
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, lines in _function_lengths(path).items()
        if lines > MAX_FUNCTION_LINES
    }
    over = {name: lines for name, lines in long.items() if name not in LONG_FUNCTIONS_ALLOWED}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (name their parts): {over}"
    stale = sorted(LONG_FUNCTIONS_ALLOWED - set(long))
    assert not stale, f"remove from LONG_FUNCTIONS_ALLOWED: {stale}"


def _is_asset(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
    return name in ASSET_DECORATORS


def _asset_bodies(path: Path) -> dict[str, int]:
    """``{function: lines of its body}`` of the asset functions of a module: decorated with ``@dg.asset(...)``
    (or ``multi_asset``...), or passed to a decorator made apart (``deco = dg.asset(...)``; ``deco(fn)``)."""
    tree = ast.parse(path.read_text(), str(path))
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    made_apart = {
        t.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and _is_asset(n.value)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    applied = {
        a.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in made_apart
        for a in n.args
        if isinstance(a, ast.Name)
    }
    return {
        name: fn.end_lineno - fn.body[0].lineno + 1
        for name, fn in functions.items()
        if name in applied or any(_is_asset(d) for d in fn.decorator_list)
    }


def test_asset_body_finder_sees_both_spellings(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import dagster as dg\n@dg.asset(group_name='g')\ndef a():\n    x = 1\n    return x\n"
        "deco = dg.asset(pool='p')\ndef b():\n    return 1\nb = deco(b)\ndef c():\n    pass\n"
    )
    assert _asset_bodies(module) == {"a": 2, "b": 1}


def test_asset_bodies_are_short():
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in OVER_ASSET_BODY_LIMIT:
            continue
        for name, lines in _asset_bodies(path).items():
            if lines > MAX_ASSET_BODY_LINES:
                long[f"{rel}:{name}"] = lines
    assert not long, f"asset bodies over {MAX_ASSET_BODY_LINES} lines (move the work out of assets/): {long}"


def test_allow_lists_name_files_that_still_need_them():
    """An entry whose file now fits is stale: remove it so the rule covers that file again."""
    fitting = [rel for rel in OVER_MODULE_LIMIT if len((PACKAGE / rel).read_text().splitlines()) <= MAX_MODULE_LINES]
    assert not fitting, f"remove from OVER_MODULE_LIMIT: {fitting}"
    stale = [
        rel
        for rel in OVER_ASSET_BODY_LIMIT
        if all(lines <= MAX_ASSET_BODY_LINES for lines in _asset_bodies(PACKAGE / rel).values())
    ]
    assert not stale, f"remove from OVER_ASSET_BODY_LIMIT: {stale}"


def test_stage_lists_come_from_the_asset_graph():
    """The pipeline's order as MISSION.md describes it, derived from the assets' dependencies; a cycle is named."""
    import dagster as dg
    import pytest

    from dflash_assets.app.stage_order import FINAL_STAGES, PARTITION_STAGES, STAGE_ORDER, stage_order

    assert STAGE_ORDER[0] == "prompt_corpus"
    assert PARTITION_STAGES == ["completions", "tokenized_sequences", "hidden_states"]
    assert FINAL_STAGES == ["truncation_report", "dflash_drafter", "drafter_evaluation"]
    assert STAGE_ORDER.index("truncation_report") > STAGE_ORDER.index("completions")

    @dg.asset(deps=["b"])
    def a() -> None: ...

    @dg.asset(deps=["a"])
    def b() -> None: ...

    @dg.asset(deps=["a"])
    def c() -> None: ...

    with pytest.raises(ValueError, match=r"cycle among \['a', 'b', 'c'\]"):
        stage_order([a, b, c])

    @dg.asset
    def root() -> None: ...

    @dg.asset(deps=["root"])
    def leaf() -> None: ...

    assert stage_order([leaf, c, root]) == ["c", "root", "leaf"]  # upstream first, ties in the given order
