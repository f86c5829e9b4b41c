"""The package's shape, checked from its source (no model, no import of the package): no import cycle among the
modules of service/pagedserve (imports inside functions count; ``if TYPE_CHECKING:`` blocks do not), no module over
400 lines, the environment read in envs.py only, and the leaf modules (the types every layer shares) importing
nothing above them."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "service" / "pagedserve"
MAX_LINES = 400
LEAVES = {"pagedserve.request", "pagedserve.outputs", "pagedserve.sampling_params"}
BELOW_LEAVES = {"pagedserve.config", "pagedserve.errors"}   # what a leaf may import besides other leaves


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("pagedserve",) + path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom in the tree, at any depth, except under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(module: str, is_package: bool, node: ast.ImportFrom | ast.Import, known: set[str]) -> set[str]:
    """The package modules ``node`` imports (a relative import resolved against ``module``; ``from pkg import
    name`` counts ``pkg.name`` when that is a module, else ``pkg``)."""
    if isinstance(node, ast.Import):
        bases = [alias.name for alias in node.names]
        return {_nearest(b, known) for b in bases if b.split(".")[0] == "pagedserve"} - {None}
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base.split(".")[0] != "pagedserve":
        return set()
    found = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.add(sub if sub in known else _nearest(base, known))
    return found - {None}


def _nearest(name: str, known: set[str]) -> str | None:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (package ``__init__`` modules included)."""
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        deps: set[str] = set()
        for node in _import_nodes(tree):
            deps |= _resolve(name, path.name == "__init__.py", node, known)
        # importing a.b.c runs a/__init__ and a/b/__init__ too
        for dep in list(deps):
            parts = dep.split(".")
            deps |= {".".join(parts[:i]) for i in range(2, len(parts)) if ".".join(parts[:i]) in known}
        deps.discard(name)
        graph[name] = {d for d in deps if not name.startswith(d + ".")}   # a module's own packages run first
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    tree = ast.parse("def f():\n    from .b import x\n")
    deps = set().union(*(_resolve("pagedserve.a", False, n, {"pagedserve.a", "pagedserve.b"})
                         for n in _import_nodes(tree)))
    assert deps == {"pagedserve.b"}
    assert find_cycle({"pagedserve.a": deps, "pagedserve.b": {"pagedserve.a"}}) is not None
    guarded = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import x\n")
    assert not any(_resolve("pagedserve.a", False, n, {"pagedserve.a", "pagedserve.b"}) for n in _import_nodes(guarded))


def test_no_module_over_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_only_envs_reads_the_environment():
    readers = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if p.name != "envs.py" or p.parent != PACKAGE
               if "os.environ" in p.read_text() or "os.getenv" in p.read_text()]
    assert not readers, f"read the environment outside envs.py: {readers}"


def test_leaf_modules_import_nothing_above_them():
    graph = import_graph()
    for leaf in LEAVES:
        above = graph[leaf] - LEAVES - BELOW_LEAVES - {"pagedserve"}
        assert not above, f"{leaf} imports {sorted(above)}"


def package_graph() -> dict[str, set[str]]:
    """Top-level package (or module) -> the ones it imports: the picture in the architecture note."""
    def top(name: str) -> str:
        parts = name.split(".")
        return parts[1] if len(parts) > 1 else parts[0]
    out: dict[str, set[str]] = {}
    for module, deps in import_graph().items():
        out.setdefault(top(module), set()).update(top(d) for d in deps if top(d) != top(module))
    return out


def test_no_cycle_between_packages():
    """Packages too import one way (e.g. engine -> executor -> worker -> sample, never back)."""
    cycle = find_cycle(package_graph())
    assert cycle is None, "package cycle: " + " -> ".join(cycle)


if __name__ == "__main__":
    for pkg, deps in sorted(package_graph().items()):
        print(f"{pkg:20s} -> {', '.join(sorted(deps)) or '-'}")
