"""The import graph of jaxserve, checkpoints and kernels_pallas, read from the source (ast), for the
structure test and docs/ARCHITECTURE.md: every `import` and `from ... import` of our own modules,
function-level ones included (a lazy import is still an arrow), `if TYPE_CHECKING:` blocks left out."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OURS = ("jaxserve", "checkpoints", "kernels_pallas")
JAX_ROOTS = ("jax", "jaxlib", "flax", "qwix", "tokamax", "orbax")


@dataclasses.dataclass
class Module:
    name: str                 # dotted, e.g. "jaxserve.engine.scheduler"
    path: Path
    lines: int
    docstring: str
    imports: set[str]         # our modules it imports (resolved to modules, not attributes)
    imports_jax: bool         # imports jax (or a library built on it) directly


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, name: str, is_package: bool) -> tuple[set[str], bool]:
    found: set[str] = set()
    jax = False
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                found.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.update(f"{mod}:{a.name}" for a in node.names)  # a module of mod, or an attribute of it
        todo.extend(ast.iter_child_nodes(node))
    jax = any(f.split(".")[0].split(":")[0] in JAX_ROOTS for f in found)
    return {f for f in found if f.split(".")[0].split(":")[0] in OURS}, jax


def load() -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for root in OURS:
        for path in sorted((REPO / root).rglob("*.py")):
            text = path.read_text()
            tree = ast.parse(text)
            name = _module_name(path)
            imports, jax = _imported(tree, name, path.name == "__init__.py")
            mods[name] = Module(name, path, len(text.splitlines()), ast.get_docstring(tree) or "", imports, jax)
    for m in mods.values():  # `from pkg import x`: the module pkg.x where there is one, else pkg
        m.imports = {_resolve(i, mods) for i in m.imports} & set(mods)
        m.imports.discard(m.name)
    return mods


def _resolve(imported: str, mods: dict[str, Module]) -> str:
    mod, _, attr = imported.partition(":")
    if attr and f"{mod}.{attr}" in mods:
        return f"{mod}.{attr}"
    return mod if mod in mods else mod.rsplit(".", 1)[0]


def package_of(name: str) -> str:
    """The room a module lives in: `jaxserve.engine.scheduler` -> `engine`; a top-level module of
    jaxserve is its own room (`jaxserve.default_model` -> `default_model`); checkpoints and
    kernels_pallas are rooms of their own."""
    parts = name.split(".")
    if parts[0] != "jaxserve":
        return parts[0]
    return parts[1] if len(parts) > 1 else "jaxserve"


def package_edges(mods: dict[str, Module]) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(from room, to room) -> the module imports that draw the arrow."""
    edges: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for m in mods.values():
        for i in m.imports:
            a, b = package_of(m.name), package_of(i)
            if a != b and i != "jaxserve":
                edges.setdefault((a, b), []).append((m.name, i))
    return edges


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out
