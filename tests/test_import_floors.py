"""The package's import structure, read from the source with `ast` (nothing is imported): no
two modules reach each other through any chain of imports, no module takes another's private
name, and nothing low imports anything high (docs/architecture.md's floors). Function-local and
`TYPE_CHECKING` imports count: a circle hidden in a function is still a circle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "radixserve"

# What each room must never import (docs/architecture.md, "Floors"). A key is a top-level
# module or package of radixserve; "torch" stands for PyTorch.
NEVER_IMPORTS: dict[str, set[str]] = {
    "config": {"*"},
    "outputs": {"*"},
    "sampling_params": {"*"},
    "sequences": {"*"},
    "home": {"*"},
    "cache": {"torch", "engine", "model", "layers", "kernels", "server", "replicas"},
    "kv_tier": {"torch", "engine", "model", "layers", "kernels", "server", "replicas"},
    "kv_events": {"engine", "model", "layers", "kernels", "server", "replicas"},
    "kernels": {"engine", "model", "layers", "server", "replicas"},
    "layers": {"engine", "model", "server", "replicas"},
    "model": {"engine", "server", "replicas"},
    "engine": {"server", "replicas", "provider_caching", "lint", "bench"},
    "provider_caching": {"engine", "server", "replicas"},
    "lint": {"engine", "server", "replicas"},
    "server": {"replicas", "serve", "cli"},
    "replicas": {"serve", "cli"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_package() -> dict[str, tuple[Path, ast.Module]]:
    return {module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, tree: ast.Module,
               modules: dict) -> list[tuple[str, str | None]]:
    """(module imported, name taken from it or None) for every import in the file, resolved
    to radixserve modules; `from pkg import sub` names the submodule."""
    is_package = path.name == "__init__.py"
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub, None) if sub in modules else (base, alias.name))
    return found


def import_graph() -> tuple[dict[str, set[str]], list[str], dict[str, set[str]]]:
    """Module edges inside radixserve, private-name imports, and every module's imports of
    top-level rooms (radixserve's or "torch")."""
    modules = read_package()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    private: list[str] = []
    rooms: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, tree) in modules.items():
        for target, taken in imports_of(name, path, tree, modules):
            head = target.split(".")
            if head[0] == "torch":
                rooms[name].add("torch")
            if head[0] != "radixserve" or target == name:
                continue
            if len(head) > 1:
                rooms[name].add(head[1])
            # A package's __init__ importing its own submodules is its interface, not a circle.
            if path.name == "__init__.py" and target.startswith(name + "."):
                continue
            if target in modules:
                edges[name].add(target)
            if taken and taken.startswith("_") and not taken.startswith("__"):
                private.append(f"{name} imports {target}.{taken}")
    return edges, private, rooms


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_reaches_itself_through_its_imports():
    edges, _, _ = import_graph()
    assert circles(edges) == []


def test_the_circle_finder_sees_a_three_module_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_name():
    _, private, _ = import_graph()
    assert private == []


def test_nothing_low_imports_anything_high():
    _, _, rooms = import_graph()
    broken = []
    for name, imported in rooms.items():
        room = name.split(".")[1] if "." in name else name
        forbidden = NEVER_IMPORTS.get(room, set())
        own = {room}
        bad = (imported - own) if "*" in forbidden else (imported & forbidden)
        broken += [f"{name} imports {target}" for target in sorted(bad)]
    assert broken == []
