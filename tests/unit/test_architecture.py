"""The package's shape, checked from its source (no model, no import of the package): no import cycle among the
modules of service/pagedserve (imports inside functions count; ``if TYPE_CHECKING:`` blocks do not), no module over
400 lines, the environment read in envs.py only, and the leaf modules (the types every layer shares) importing
nothing above them."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "service" / "pagedserve"
MAX_LINES = 400
LEAVES = {"pagedserve.request", "pagedserve.outputs", "pagedserve.sampling_params", "pagedserve.scheduler_output"}
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


def _import_nodes(tree: ast.AST, type_checking: bool = False):
    """Every Import / ImportFrom in the tree, at any depth, except under ``if TYPE_CHECKING:`` (unless
    ``type_checking``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
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


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports (package ``__init__`` modules included; imports under
    ``if TYPE_CHECKING:`` only with ``type_checking``)."""
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        deps: set[str] = set()
        for node in _import_nodes(tree, type_checking):
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


# ---- the step as a data contract (issue 40) ----------------------------------------------------------------------
def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_worker_imports_no_request_engine_or_core():
    """The worker reads plain step data only: nothing in worker/ imports request.py, engine/ or core/ (type-only
    imports counted)."""
    graph = import_graph(type_checking=True)
    bad = {m: sorted(d for d in deps if _under(d, "pagedserve.request", "pagedserve.engine", "pagedserve.core"))
           for m, deps in graph.items() if _under(m, "pagedserve.worker")}
    assert not {m: d for m, d in bad.items() if d}, bad


def test_builder_talks_to_the_executor_only():
    deps = import_graph(type_checking=True)["pagedserve.engine.builder"]
    assert not [d for d in deps if _under(d, "pagedserve.worker")], sorted(deps)


def _request_fields() -> set[str]:
    tree = ast.parse((PACKAGE / "request.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Request")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _request_writes(tree: ast.AST, fields: set[str]) -> list[int]:
    """Lines that assign, augment or delete an attribute named like a Request field (or its items), or call
    ``append_output_token``."""
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "append_output_token":
            lines.append(node.lineno)
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and sub.attr in fields and not \
                        (isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                    lines.append(node.lineno)
    return lines


def test_request_is_written_only_by_core_and_engine():
    """Outside core/ and engine/ no code assigns a Request field on another object (``x.status = ...``,
    ``del x.token_ids[...]``, ``x.append_output_token(...)``); ``self.<field>`` of a module's own classes aside.
    worker/ is left to the import rule above: it never holds a Request (its per-request state, built from the plain
    step data, has fields of the same names)."""
    fields = _request_fields() - {"index"}   # "index" is every position type's name (spans, tool calls)
    found = {}
    for name, path in _modules().items():
        if _under(name, "pagedserve.core", "pagedserve.engine", "pagedserve.request", "pagedserve.worker"):
            continue
        lines = _request_writes(ast.parse(path.read_text()), fields)
        if lines:
            found[name] = lines
    assert not found, f"Request fields written outside core/ and engine/: {found}"


def test_the_request_write_finder_sees_writes():
    tree = ast.parse("r.status = 1\nr.num_computed_tokens += 2\ndel r.token_ids[-1:]\nr.append_output_token(3)\n"
                     "self.status = 4\n")
    assert _request_writes(tree, _request_fields()) == [1, 2, 3, 4]


def test_only_core_reads_req_beam():
    """Beam groups are a scheduler policy (gangs, core/sched/beam_groups.py): no code outside core/ reads a
    request's ``.beam`` or ``.gang``."""
    found = {name: [n.lineno for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, ast.Attribute) and n.attr in ("beam", "gang")]
             for name, path in _modules().items() if not _under(name, "pagedserve.core")}
    assert not {k: v for k, v in found.items() if v}, found


if __name__ == "__main__":
    for pkg, deps in sorted(package_graph().items()):
        print(f"{pkg:20s} -> {', '.join(sorted(deps)) or '-'}")
