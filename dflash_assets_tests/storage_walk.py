"""The walk of a resource parameter through the package, read from the source (``ast``; nothing imported), and
how often it climbs back up the rooms (issue 51).

**The walk.** Start at an asset function and one of its parameters (``dflash_drafter``'s ``storage``). Read the
function's calls in source order; a call *carries* the value when an argument is the parameter itself or a
value made from it (a name bound to it, or a method of it that returns one of the package's classes, such as
``storage.open()``, a ``Storage``), and a method called on it carries it too. Each call that carries it to a
function or method of the package (resolved through the module's imports, the parameters' annotations and the
methods' return annotations) is a *stay*: the walk enters the callee, the value bound to the parameters it was
passed to, and goes on there, depth first. A function is entered once (the first time), so the stays are the
functions the value reaches, in the order a reader following it meets them.

**Rooms and climbs.** A stay's room is where its module lives, top to bottom as docs/design.md draws them
(:data:`RANKS`): ``app``, ``assets``; inside ``stages/`` a stage's own code (``stages/drafter``,
``stages/hidden_states``, ...) above what several stages share (``storage_plan``, ``stored_inputs``, ``forecast``,
``config_schema``) above the resources; then ``orchestration``, ``data``, ``generation/*``, ``dflash/*``,
``storage``, ``common``. A *climb back up* is a stay whose room is higher than the stay before it: the reader, down
in the store, has to come back up to a stage's code to follow the value on.

``python -m dflash_assets_tests.storage_walk`` prints the walk of ``dflash_drafter``'s ``storage`` and its count.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dflash_assets"
STAGES_SHARED = ("storage_plan", "stored_inputs", "forecast", "config_schema")


def _ranks() -> dict[str, float]:
    """Rooms top to bottom (test_layout's ``ROOMS`` and ``SUBROOMS``, with ``stages/`` cut in three); a stay in a
    room of a smaller rank after one of a larger rank is a climb back up."""
    from dflash_assets_tests.test_layout import ROOMS, SUBROOMS

    ranks: dict[str, float] = {}
    for i, room in enumerate(ROOMS):
        if room == "stages":
            ranks.update({"stages/<stage>": i, "stages/<shared>": i + 0.3, "stages/resources": i + 0.6})
        elif room in SUBROOMS:
            ranks.update({f"{room}/{sub}": i + j / 10 for j, sub in enumerate(SUBROOMS[room])})
        else:
            ranks[room] = i
    return ranks


RANKS = _ranks()


def room_of(module: str) -> str:
    """The room of a module of the package, as :data:`RANKS` names it (``stages/drafter`` for a stage's code)."""
    parts = module.split(".")[1:] or ["common"]
    top = parts[0]
    if top in ("definitions", "__main__"):
        return "app"
    if top == "stages" and len(parts) > 1:
        if parts[1] == "resources":
            return "stages/resources"
        return "stages/<shared>" if parts[1] in STAGES_SHARED else f"stages/{parts[1]}"
    if top in ("generation", "dflash") and len(parts) > 2:
        return f"{top}/{parts[1]}"
    return top


def rank_of(room: str) -> float:
    if room.startswith("stages/") and room not in RANKS:
        return RANKS["stages/<stage>"]
    return RANKS[room]


@dataclass(frozen=True)
class Stay:
    module: str
    function: str  # "name" or "Class.name"
    line: int

    @property
    def room(self) -> str:
        return room_of(self.module)

    def __str__(self) -> str:
        return f"{self.room:<22} {self.module.removeprefix('dflash_assets.')}:{self.function} (line {self.line})"


@dataclass
class Walk:
    stays: list[Stay] = field(default_factory=list)

    @property
    def climbs(self) -> list[tuple[Stay, Stay]]:
        """``(from, to)`` of each stay whose room is higher than the one before it."""
        return [(a, b) for a, b in zip(self.stays, self.stays[1:]) if rank_of(b.room) < rank_of(a.room)]

    @property
    def rooms(self) -> list[str]:
        return sorted({s.room for s in self.stays}, key=rank_of)


class _Index:
    """Every module of the package: its functions, classes (with methods and bases) and imports."""

    def __init__(self) -> None:
        self.trees: dict[str, ast.Module] = {}
        for path in sorted(PACKAGE.rglob("*.py")):
            parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            self.trees[".".join(parts)] = ast.parse(path.read_text(), str(path))
        self.functions = {
            m: {n.name: n for n in t.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for m, t in self.trees.items()
        }
        self.classes = {m: {n.name: n for n in t.body if isinstance(n, ast.ClassDef)} for m, t in self.trees.items()}
        self.imports = {m: self._imports(m, t) for m, t in self.trees.items()}

    def _imports(self, module: str, tree: ast.Module) -> dict[str, tuple[str, str | None]]:
        """``{local name: (module, name or None for the module itself)}``; lazy imports included."""
        out: dict[str, tuple[str, str | None]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    out[a.asname or a.name] = (full, None) if full in self.trees else (node.module, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        out[a.asname] = (a.name, None)
        return out

    def symbol(self, module: str, name: str) -> tuple[str, ast.AST] | None:
        """The definition ``name`` means in ``module`` (a function or class of the package), or None."""
        for _ in range(5):  # follows an import to the module that defines it
            if module not in self.trees:
                return None
            if name in self.functions[module]:
                return module, self.functions[module][name]
            if name in self.classes[module]:
                return module, self.classes[module][name]
            target = self.imports[module].get(name)
            if target is None or target[1] is None:
                return None
            module, name = target
        return None

    def method(self, module: str, cls: ast.ClassDef, name: str) -> tuple[str, ast.AST, str] | None:
        """``(module, def, "Class.name")`` of method ``name`` of ``cls`` or of its bases in the package."""
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                return module, item, f"{cls.name}.{name}"
        for base in cls.bases:
            found = self.type_of(module, base)
            if found is not None:
                hit = self.method(found[0], found[1], name)
                if hit is not None:
                    return hit
        return None

    def type_of(self, module: str, annotation: ast.AST | None) -> tuple[str, ast.ClassDef] | None:
        """The package class an annotation names (``X``, ``m.X``, ``"X"``, ``X | None``), or None."""
        if annotation is None:
            return None
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                annotation = ast.parse(annotation.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(annotation, ast.BinOp):
            return self.type_of(module, annotation.left) or self.type_of(module, annotation.right)
        if isinstance(annotation, ast.Name):
            found = self.symbol(module, annotation.id)
        elif isinstance(annotation, ast.Attribute) and isinstance(annotation.value, ast.Name):
            target = self.imports[module].get(annotation.value.id)
            found = self.symbol(target[0], annotation.attr) if target and target[1] is None else None
        else:
            return None
        return found if found is not None and isinstance(found[1], ast.ClassDef) else None


def _end(node: ast.AST) -> tuple[int, int, int]:
    """Where ``node`` ends; an assignment after the value it binds (which ends where it does)."""
    return (node.end_lineno or 0, node.end_col_offset or 0, isinstance(node, ast.Assign))


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    return [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]


class _Walker:
    def __init__(self) -> None:
        self.index = _Index()
        self.walk = Walk()
        self.seen: set[tuple[str, int]] = set()

    def enter(self, module: str, fn, qualname: str, carried: dict[str, tuple | None], cls=None, outer=None) -> None:
        key = (module, fn.lineno)
        if key in self.seen:
            return
        self.seen.add(key)
        self.walk.stays.append(Stay(module, qualname, fn.lineno))
        nested = {n.name: n for n in ast.walk(fn) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        nested.pop(fn.name, None)
        nested.update(outer or {})
        carried = dict(carried)
        # in the order Python evaluates them: a call's arguments before the call, a value before its name is bound
        nodes = sorted(
            (n for n in ast.walk(fn) if isinstance(n, (ast.Call, ast.Assign, ast.withitem))),
            key=lambda n: _end(n.context_expr if isinstance(n, ast.withitem) else n),
        )
        for node in nodes:
            if isinstance(node, ast.Assign):
                kind = self.carries(module, node.value, carried, cls)
                if kind is not False:
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            carried[target.id] = kind
            elif isinstance(node, ast.withitem):
                kind = self.carries(module, node.context_expr, carried, cls)
                if kind is not False and isinstance(node.optional_vars, ast.Name):
                    carried[node.optional_vars.id] = kind
            else:
                self.follow(module, node, carried, cls, nested)

    def carries(self, module: str, expr: ast.AST, carried: dict, cls) -> tuple | bool | None:
        """The type (or None, unknown) of the carried value ``expr`` is, or False when it carries none."""
        if isinstance(expr, ast.Name):
            return carried.get(expr.id, False)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            receiver = self.carries(module, expr.func.value, carried, cls)
            if receiver:
                hit = self.index.method(receiver[0], receiver[1], expr.func.attr)
                if hit is not None:
                    returned = self.index.type_of(hit[0], hit[1].returns)
                    return returned if returned is not None else False
        return False

    def follow(self, module: str, call: ast.Call, carried: dict, cls, nested: dict) -> None:
        args = [(i, a) for i, a in enumerate(call.args)] + [(k.arg, k.value) for k in call.keywords if k.arg]
        passed = {slot: kind for slot, a in args if (kind := self.carries(module, a, carried, cls)) is not False}
        func = call.func
        target = receiver_kind = None
        if isinstance(func, ast.Name):
            if func.id in nested:
                inner = nested[func.id]
                if passed or any(isinstance(n, ast.Name) and n.id in carried for n in ast.walk(inner)):
                    bound = {k: v for k, v in carried.items() if k not in {p.arg for p in _params(inner)}}
                    bound.update(self.bind(module, inner, passed, 0))
                    self.enter(module, inner, f"{inner.name} (nested)", bound, cls, nested)
                return
            target = self.index.symbol(module, func.id)
        elif isinstance(func, ast.Attribute):
            receiver_kind = self.carries(module, func.value, carried, cls)
            if receiver_kind:
                hit = self.index.method(receiver_kind[0], receiver_kind[1], func.attr)
                if hit is not None:
                    self.enter(hit[0], hit[1], hit[2], {"self": receiver_kind, **self.bind(hit[0], hit[1], passed, 1)})
                return
            if isinstance(func.value, ast.Name):
                if func.value.id == "self" and cls is not None and passed:
                    hit = self.index.method(cls[0], cls[1], func.attr)
                    if hit is not None:
                        self.enter(hit[0], hit[1], hit[2], {**self.bind(hit[0], hit[1], passed, 1)}, cls)
                    return
                imported = self.index.imports[module].get(func.value.id)
                if imported and imported[1] is None:
                    target = self.index.symbol(imported[0], func.attr)
        if target is None or not passed:
            return
        where, node = target
        if isinstance(node, ast.ClassDef):
            hit = self.index.method(where, node, "__init__")
            if hit is not None:
                self.enter(hit[0], hit[1], hit[2], self.bind(hit[0], hit[1], passed, 1), (where, node))
            return
        self.enter(where, node, node.name, self.bind(where, node, passed, 0))

    def bind(self, module: str, fn, passed: dict, skip: int) -> dict:
        """``{parameter: type}`` of the callee's parameters the carried values were passed to."""
        params = _params(fn)
        positional = [*fn.args.posonlyargs, *fn.args.args][skip:]
        out = {}
        for slot, kind in passed.items():
            param = positional[slot] if isinstance(slot, int) and slot < len(positional) else None
            if isinstance(slot, str):
                param = next((p for p in params if p.arg == slot), None)
            if param is not None:
                out[param.arg] = self.index.type_of(module, param.annotation) or kind
        return out


def walk_parameter(module: str, function: str, parameter: str) -> Walk:
    """The walk of ``parameter`` of ``function`` (an asset function of ``module``) through the package."""
    walker = _Walker()
    fn = walker.index.functions[module][function]
    param = next(p for p in _params(fn) if p.arg == parameter)
    walker.enter(module, fn, function, {parameter: walker.index.type_of(module, param.annotation)})
    return walker.walk


def drafter_storage_walk() -> Walk:
    """The walk of the ``dflash_drafter`` asset's ``storage`` parameter."""
    return walk_parameter("dflash_assets.assets.drafter", "dflash_drafter", "storage")


if __name__ == "__main__":
    walk = drafter_storage_walk()
    for i, stay in enumerate(walk.stays, 1):
        climb = " <- climbs back up" if i > 1 and rank_of(stay.room) < rank_of(walk.stays[i - 2].room) else ""
        print(f"{i:3d} {stay}{climb}")
    print(f"{len(walk.stays)} stays in {len(walk.rooms)} rooms, {len(walk.climbs)} climbs back up")
