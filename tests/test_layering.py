"""The layers of DESIGN.md ("Layers, bottom to top"), read off the source with ``ast``: every
import of an fsharded module, at the top of a module or inside a function, points down the
table or stays in its layer; the top-level pieces of the package import each other in no
circle; and imports inside functions are for optional backends (or a command's startup)."""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fsharded"

# Bottom to top. A module may import modules of its own layer and of the layers below; the
# longest matching prefix decides a module's layer. DESIGN.md's table, as the code has it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("pytrees and hooks", ("fsharded._tree", "fsharded._memory_hooks", "fsharded._memory_tracker",
                           "fsharded._cext", "fsharded._moved")),
    ("mesh", ("fsharded.mesh",)),
    ("comm", ("fsharded.comm", "fsharded.distributed")),
    ("spmd", ("fsharded.spmd", "fsharded.lax", "fsharded.collectives")),
    ("kernels, random, precision", ("fsharded.kernels", "fsharded.random", "fsharded.precision")),
    ("parallel, optim, checkpoint", ("fsharded.parallel", "fsharded.optim", "fsharded.checkpoint")),
    ("step", ("fsharded.step",)),
    ("nn", ("fsharded.nn",)),
    ("models, config, inference", ("fsharded.models", "fsharded.config", "fsharded.inference")),
    ("tools", ("fsharded.tools", "fsharded.testing")),
    ("the package (fsharded/__init__.py)", ("fsharded",)),
    ("the app and the benchmarks", ("fsharded.__main__", "fsharded.tools.cli", "fsharded.tools.train",
                                    "fsharded.tools._generate", "fsharded.tools._serve", "fsharded.tools._train_resume",
                                    "fsharded.tools.demo",
                                    "fsharded.bench")),
]

# Imports that point up the table, each with its reason. Nothing else may.
UPWARD = {
    ("fsharded.mesh._mesh", "fsharded.comm"):
        "Mesh.from_torch / Mesh.to_torch: deprecated spellings of fs.comm.from_device_mesh / "
        "fs.comm.device_mesh, kept while users and spmd._transfer call them",
}

# Imports of fsharded modules inside functions: optional backends, imported when used (Triton
# kernels, the C++ extensions' loaders, torch.distributed.checkpoint), and the names below.
LAZY_TARGETS = ("fsharded.kernels._triton_", "fsharded.kernels.cpu_optim", "fsharded.checkpoint._dcp_reader")
LAZY = {
    ("fsharded.models.gpt", "fsharded.models.gpt_plans"):
        "gpt.tensor_parallel_specs and the other plan names, reached from the model module "
        "without the model importing its plans",
    **UPWARD,
}
# A command imports what its subcommand needs when it runs (``fsharded --help`` stays quick);
# the benchmarks import the peers and helpers of the one that runs.
LAZY_IMPORTERS = ("fsharded.tools.cli", "fsharded.bench")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


MODULES = _modules()


def layer(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    if rank is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS (and to DESIGN.md's table)")
    return rank


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """``(target module, line, inside a function)`` for every import of an fsharded module."""
    path = MODULES[module]
    out: list[tuple[str, int, bool]] = []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if path.name == "__init__.py" else 0)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, in_function) for a in child.names if a.name.startswith("fsharded"))
            elif isinstance(child, ast.ImportFrom):
                base = resolve(child)
                if base.startswith("fsharded"):
                    for a in child.names:
                        # ``from fsharded import comm`` imports a module; ``from fsharded import P`` a name
                        name = f"{base}.{a.name}"
                        out.append((name if name in MODULES else base, child.lineno, in_function))
            visit(child, nested)

    visit(ast.parse(path.read_text()), False)
    return out


EDGES = {m: _imports(m) for m in sorted(MODULES)}


def test_every_module_has_a_layer():
    for m in MODULES:
        layer(m)


def test_every_import_names_a_module_of_the_package():
    # an old name (fsharded.memory: the module moved to fsharded.tools.memory) is for users
    bad = [f"  {m}:{line} imports {t}" for m, edges in EDGES.items() for t, line, _ in edges if t not in MODULES]
    assert not bad, "imports of names that are not modules of fsharded:\n" + "\n".join(bad)


def test_no_import_points_up_the_layers():
    bad = []
    for m, edges in EDGES.items():
        for t, line, _ in edges:
            if t in MODULES and layer(t) > layer(m) and (m, t) not in UPWARD:
                bad.append(f"  {m}:{line} ({LAYERS[layer(m)][0]}) imports {t} ({LAYERS[layer(t)][0]})")
    assert not bad, "imports that point up DESIGN.md's layers:\n" + "\n".join(bad)


def test_the_allowed_exceptions_are_still_needed():
    used = {(m, t) for m, edges in EDGES.items() for t, _, _ in edges}
    assert not set(LAZY) - used, f"remove these from the test, nothing imports so: {set(LAZY) - used}"


def _top(module: str) -> str | None:
    """The top-level piece of the package a module belongs to (None: the package itself).
    ``fsharded/tools/`` groups modules of two layers (the tools below the package's
    ``__init__``, the app above the benchmarks: ``fsharded bench`` runs them, and one of
    them times ``fsharded train``), so each of its modules is a piece of its own."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "tools":
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else None


def test_no_circles_between_the_top_level_pieces():
    graph: dict[str, set[str]] = defaultdict(set)
    for m, edges in EDGES.items():
        for t, _, _ in edges:
            a, b = _top(m), _top(t)
            # the package's own __init__ imports every piece; pieces import it only by name
            if a and b and a != b and (m, t) not in UPWARD:
                graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"top-level pieces of fsharded that import each other: {circles}"


def test_imports_inside_functions_are_for_optional_backends():
    bad = []
    for m, edges in EDGES.items():
        if m.startswith(LAZY_IMPORTERS):
            continue
        for t, line, in_function in edges:
            if in_function and not t.startswith(LAZY_TARGETS) and (m, t) not in LAZY:
                bad.append(f"  {m}:{line} imports {t}")
    assert not bad, ("imports inside functions (put them at the top of the module; a circle they "
                     "would make is a layering problem):\n" + "\n".join(bad))


@pytest.mark.parametrize("upper, lower", [("fsharded.parallel.tensor", "fsharded.models"),
                                          ("fsharded.models.gpt", "fsharded.mesh"),
                                          ("fsharded._tree", "fsharded.mesh"),
                                          ("fsharded.comm", "fsharded.kernels")])
def test_the_named_arrows_are_gone(upper, lower):
    hits = [(m, t, line) for m, edges in EDGES.items() if m == upper or m.startswith(upper + ".")
            for t, line, _ in edges if t == lower or t.startswith(lower + ".")]
    assert not hits
