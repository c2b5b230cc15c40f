"""The request's way, measured statically: from the chat handler to the upstream call, how many stops and returns.

``python -m bench.request_walk [--root DIR] [--json] [--show]`` parses every module of ``DIR/gateway`` (default:
this checkout) with :mod:`ast` — nothing is imported — and walks the call graph.

**Definitions.**

- *Start*: the handler of ``POST /v1/chat/completions``: the function defined in ``gateway/api/completions.py``
  whose name contains ``chat`` (a nested function of ``attach`` today).
- *End*: ``UpstreamPool.open`` in ``gateway/upstream/pool.py`` (the upstream HTTP call). The walk does not enter it.
- *Calls* are resolved as far as static typing allows: ``f()`` (a function of the same module, an imported function,
  a class with its own ``__init__``), ``mod.f()`` (an imported module), ``self.m()`` (the class and its bases in
  ``gateway/``), ``self.a.m()`` / ``x.m()`` / ``self.a.b.m()`` where the type of ``a``/``x`` is known from an
  annotation (a parameter, a class-level or ``self.a: T`` annotation, an ``__init__`` parameter assigned to
  ``self.a``) or from a constructor call (``x = T(...)``, ``self.a = T(...)``); ``T | None`` counts as ``T``.
  Calls inside nested functions and lambdas belong to the function that contains them. Anything else (a call on
  a value of unknown type, a library call) is not followed.
- *On the way*: a function is on the request's way when the end is reachable from it (the end included).
- The *walk* goes depth-first from the start, callees in source order, each function once. It *enters* the
  functions on the way (follows their calls) and *visits* every gateway function they call: a callee off the way
  (routing, policy, the cache lookup, metering, the relay, the response) is a stop too — the request passes
  through it — but the walk comes straight back from it. *Stops*: the functions visited (start and end
  included). *Modules*: the distinct modules among them. *Returns*: in the visit order, the stops whose module
  differs from the previous stop's and was already visited before — the walk moving back into a module it had
  left.
- Limits: a call through a value of unknown type (a callable parameter or attribute, ``functools.partial``) is
  not followed, so a function that reaches the upstream only through such a callable is off the way; a lambda's
  calls count for the function that contains it.

Exit status 0; ``--max-stops N --max-returns M`` make it exit 1 when the walk exceeds either bound.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

FuncId = tuple[str, str]  # (module, qualified name: "f", "Class.m", "outer.<locals>.inner")


@dataclass
class ClassInfo:
    """A class: its methods, its attributes' types (class names, resolved to (module, name)) and its bases."""

    module: str
    name: str
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    attrs: dict[str, tuple[str, str]] = field(default_factory=dict)
    bases: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class ModuleInfo:
    """A module: its top-level functions, classes and imports (local name → module or (module, symbol))."""

    name: str
    tree: ast.Module
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    classes: dict[str, ClassInfo] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)  # alias → module
    symbols: dict[str, tuple[str, str]] = field(default_factory=dict)  # alias → (module, name)


class Graph:
    """The call graph of one tree's ``gateway`` package."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mods: dict[str, ModuleInfo] = {}
        self.funcs: dict[FuncId, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self.owner: dict[FuncId, ClassInfo | None] = {}
        self._callees: dict[FuncId, list[FuncId]] = {}
        for path in sorted((root / "gateway").rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join(parts)
            self.mods[name] = self._index(name, ast.parse(path.read_text(), str(path)), path.name == "__init__.py")
        for mod in self.mods.values():
            for cls in mod.classes.values():
                self._class_attrs(mod, cls)

    # -- indexing ------------------------------------------------------------------------------------------
    def _index(self, name: str, tree: ast.Module, package: bool) -> ModuleInfo:
        mod = ModuleInfo(name, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        mod.modules[a.asname] = a.name
                    else:
                        mod.modules[a.name.split(".")[0]] = a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
                for a in node.names:
                    mod.symbols[a.asname or a.name] = (node.module, a.name)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                mod.functions[node.name] = node
                self._add_func((name, node.name), node, None)
            elif isinstance(node, ast.ClassDef):
                cls = ClassInfo(name, node.name)
                mod.classes[node.name] = cls
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        cls.methods[item.name] = item
                        self._add_func((name, f"{node.name}.{item.name}"), item, cls)
        return mod

    def _add_func(self, fid: FuncId, node: ast.FunctionDef | ast.AsyncFunctionDef, cls: ClassInfo | None) -> None:
        self.funcs[fid] = node
        self.owner[fid] = cls
        for sub in ast.walk(node):  # nested functions are their own stops, reached through their name
            if sub is not node and isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                self.funcs.setdefault((fid[0], f"{fid[1]}.<locals>.{sub.name}"), sub)
                self.owner.setdefault((fid[0], f"{fid[1]}.<locals>.{sub.name}"), cls)

    def _class_attrs(self, mod: ModuleInfo, cls: ClassInfo) -> None:
        node = next(n for n in mod.tree.body if isinstance(n, ast.ClassDef) and n.name == cls.name)
        for b in node.bases:
            t = self.type_of_annotation(mod, b)
            if t is not None:
                cls.bases.append(t)
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                t = self.type_of_annotation(mod, item.annotation)
                if t is not None:
                    cls.attrs[item.target.id] = t
        for meth in cls.methods.values():
            params = self._params(mod, meth)
            for sub in ast.walk(meth):
                target: ast.expr | None = None
                t: tuple[str, str] | None = None
                if isinstance(sub, ast.AnnAssign):
                    target, t = sub.target, self.type_of_annotation(mod, sub.annotation)
                elif isinstance(sub, ast.Assign) and len(sub.targets) == 1:
                    target = sub.targets[0]
                    t = self._type_of_value(mod, sub.value, params)
                if (t is not None and isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self"):
                    cls.attrs.setdefault(target.attr, t)

    def _params(self, mod: ModuleInfo, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, tuple[str, str]]:
        out: dict[str, tuple[str, str]] = {}
        a = fn.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
            if arg.annotation is not None:
                t = self.type_of_annotation(mod, arg.annotation)
                if t is not None:
                    out[arg.arg] = t
        return out

    def _type_of_value(self, mod: ModuleInfo, value: ast.expr,
                       names: dict[str, tuple[str, str]]) -> tuple[str, str] | None:
        if isinstance(value, ast.Name):
            return names.get(value.id)
        if isinstance(value, ast.Call):
            t = self.type_of_annotation(mod, value.func)
            return t if t is not None and self.cls(t) is not None else None
        if isinstance(value, ast.BoolOp):  # ``x or Default(...)``
            for v in value.values:
                t = self._type_of_value(mod, v, names)
                if t is not None:
                    return t
        if isinstance(value, ast.IfExp):
            return self._type_of_value(mod, value.body, names) or self._type_of_value(mod, value.orelse, names)
        return None

    def resolve_symbol(self, module: str, name: str) -> tuple[str, str]:
        """Follow re-exports: (module, name) → where it is defined."""
        for _ in range(5):
            mod = self.mods.get(module)
            if mod is None or name in mod.functions or name in mod.classes or name not in mod.symbols:
                return module, name
            module, name = mod.symbols[name]
        return module, name

    def type_of_annotation(self, mod: ModuleInfo, ann: ast.expr | None) -> tuple[str, str] | None:
        """The gateway class an annotation (or a class reference) names; ``T | None`` and ``Optional[T]`` → T."""
        if ann is None:
            return None
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            try:
                ann = ast.parse(ann.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
            return self.type_of_annotation(mod, ann.left) or self.type_of_annotation(mod, ann.right)
        if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Optional":
            return self.type_of_annotation(mod, ann.slice)
        if isinstance(ann, ast.Name):
            if ann.id in mod.classes:
                return mod.name, ann.id
            if ann.id in mod.symbols:
                return self.resolve_symbol(*mod.symbols[ann.id])
        if isinstance(ann, ast.Attribute) and isinstance(ann.value, ast.Name) and ann.value.id in mod.modules:
            return self.resolve_symbol(mod.modules[ann.value.id], ann.attr)
        return None

    def cls(self, t: tuple[str, str]) -> ClassInfo | None:
        mod = self.mods.get(t[0])
        return mod.classes.get(t[1]) if mod is not None else None

    def method(self, t: tuple[str, str], name: str) -> FuncId | None:
        """``name`` looked up on class ``t`` and its gateway bases."""
        seen: set[tuple[str, str]] = set()
        todo = [t]
        while todo:
            cur = todo.pop(0)
            if cur in seen:
                continue
            seen.add(cur)
            c = self.cls(cur)
            if c is None:
                continue
            if name in c.methods:
                return c.module, f"{c.name}.{name}"
            todo += c.bases
        return None

    def attr_type(self, t: tuple[str, str], name: str) -> tuple[str, str] | None:
        c = self.cls(t)
        while c is not None:
            if name in c.attrs:
                return c.attrs[name]
            c = self.cls(c.bases[0]) if c.bases else None
        return None

    # -- calls ---------------------------------------------------------------------------------------------
    def callees(self, fid: FuncId) -> list[FuncId]:
        """The gateway functions ``fid`` calls, in source order, each once."""
        if fid not in self._callees:
            self._callees[fid] = self._find_callees(fid)
        return self._callees[fid]

    def _find_callees(self, fid: FuncId) -> list[FuncId]:
        mod = self.mods[fid[0]]
        fn = self.funcs[fid]
        cls = self.owner.get(fid)
        names = self._params(mod, fn)
        # locals: ``x = T(...)`` / ``x: T``, and the enclosing function's parameters for a nested function
        outer = fid[1].split(".<locals>.")[0] if ".<locals>." in fid[1] else None
        if outer is not None and (mod.name, outer) in self.funcs:
            names = {**self._params(mod, self.funcs[(mod.name, outer)]), **names}
        for sub in ast.walk(fn):
            if isinstance(sub, ast.Assign) and len(sub.targets) == 1 and isinstance(sub.targets[0], ast.Name):
                t = self._type_of_value(mod, sub.value, names)
                if t is not None:
                    names.setdefault(sub.targets[0].id, t)
            elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                t = self.type_of_annotation(mod, sub.annotation)
                if t is not None:
                    names.setdefault(sub.target.id, t)
        calls = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call)),
                       key=lambda n: (n.lineno, n.col_offset))
        out: list[FuncId] = []
        for call in calls:
            target = self._resolve(mod, cls, names, call.func, fid)
            if target is not None and target != fid and target not in out:
                out.append(target)
        return out

    def _value_type(self, mod: ModuleInfo, cls: ClassInfo | None, names: dict[str, tuple[str, str]],
                    expr: ast.expr) -> tuple[str, str] | None:
        if isinstance(expr, ast.Name):
            if expr.id == "self" and cls is not None:
                return cls.module, cls.name
            return names.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = self._value_type(mod, cls, names, expr.value)
            return self.attr_type(base, expr.attr) if base is not None else None
        return None

    def _resolve(self, mod: ModuleInfo, cls: ClassInfo | None, names: dict[str, tuple[str, str]],
                 func: ast.expr, caller: FuncId) -> FuncId | None:
        if isinstance(func, ast.Name):
            nested = (mod.name, f"{caller[1].split('.<locals>.')[0]}.<locals>.{func.id}")
            if nested in self.funcs:
                return nested
            if func.id in mod.functions:
                return mod.name, func.id
            if func.id in mod.classes:
                return self.method((mod.name, func.id), "__init__")
            if func.id in mod.symbols:
                m, n = self.resolve_symbol(*mod.symbols[func.id])
                if (m, n) in self.funcs:
                    return m, n
                if self.cls((m, n)) is not None:
                    return self.method((m, n), "__init__")
            return None
        if not isinstance(func, ast.Attribute):
            return None
        if isinstance(func.value, ast.Name) and func.value.id in mod.modules and func.value.id not in names:
            m, n = self.resolve_symbol(mod.modules[func.value.id], func.attr)
            if (m, n) in self.funcs:
                return m, n
            return self.method((m, n), "__init__") if self.cls((m, n)) is not None else None
        if isinstance(func.value, ast.Name) and func.value.id in mod.symbols and func.value.id not in names:
            sm, sn = mod.symbols[func.value.id]
            full = f"{sm}.{sn}"
            if full in self.mods:  # ``from gateway.pipeline import policy`` → policy.check_tier()
                m, n = self.resolve_symbol(full, func.attr)
                if (m, n) in self.funcs:
                    return m, n
                return self.method((m, n), "__init__") if self.cls((m, n)) is not None else None
            owner = self.resolve_symbol(sm, sn)
            if self.cls(owner) is not None:  # ``Class.staticmethod()``
                return self.method(owner, func.attr)
        t = self._value_type(mod, cls, names, func.value)
        return self.method(t, func.attr) if t is not None else None

    # -- the walk ------------------------------------------------------------------------------------------
    def find_start(self) -> FuncId:
        """The chat handler: ``gateway.api.completions`` ``serve`` (the routes bind it to an endpoint), else a
        function of that module named for chat (the parent tree's ``attach.<locals>.chat_completions``)."""
        mod = "gateway.api.completions"
        if (mod, "serve") in self.funcs:
            return (mod, "serve")
        for fid in self.funcs:
            if fid[0] == mod and "chat" in fid[1].rsplit(".", 1)[-1]:
                return fid
        raise LookupError(f"no chat handler in {mod}")

    def reaching(self, end: FuncId) -> set[FuncId]:
        """Every function from which ``end`` is reachable (``end`` included)."""
        rev: dict[FuncId, set[FuncId]] = {}
        for fid in self.funcs:
            if fid == end:
                continue
            for c in self.callees(fid):
                rev.setdefault(c, set()).add(fid)
        out = {end}
        todo = [end]
        while todo:
            for p in rev.get(todo.pop(), ()):
                if p not in out:
                    out.add(p)
                    todo.append(p)
        return out

    def walk(self, start: FuncId, end: FuncId) -> list[FuncId]:
        """The stops, in visit order (see the module doc)."""
        way = self.reaching(end)
        order: list[FuncId] = []
        seen: set[FuncId] = set()
        todo: list[FuncId] = [start]  # an explicit stack: depth first, callees in source order
        while todo:
            fid = todo.pop()
            if fid in seen:
                continue
            seen.add(fid)
            order.append(fid)
            if fid != end and fid in way:
                todo += reversed([c for c in self.callees(fid) if c not in seen])
        return order


END: FuncId = ("gateway.upstream.pool", "UpstreamPool.open")


@dataclass
class Walk:
    """One tree's walk: the counts and the stops in visit order (``module:function``)."""

    stops: int
    modules: int
    returns: int
    reached_upstream: bool
    walk: list[str]


def measure(root: Path) -> Walk:
    """The walk of the tree at ``root`` (see the module doc)."""
    g = Graph(root)
    order = g.walk(g.find_start(), END)
    returns = 0
    visited: set[str] = set()
    prev: str | None = None
    for mod, _ in order:
        if mod != prev and mod in visited:
            returns += 1
        visited.add(mod)
        prev = mod
    return Walk(len(order), len(visited), returns, END in order, [f"{m}:{f}" for m, f in order])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="checkout to measure")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--show", action="store_true", help="list the stops in walk order")
    ap.add_argument("--max-stops", type=int)
    ap.add_argument("--max-returns", type=int)
    args = ap.parse_args(argv)
    res = measure(args.root)
    if args.json:
        print(json.dumps(asdict(res), indent=2))
    else:
        print(f"{args.root}: {res.stops} stops in {res.modules} modules, {res.returns} returns"
              f"{'' if res.reached_upstream else ' (the upstream call was not reached)'}")
        if args.show:
            for s in res.walk:
                print("  ", s)
    over = ((args.max_stops is not None and res.stops > args.max_stops)
            or (args.max_returns is not None and res.returns > args.max_returns))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
