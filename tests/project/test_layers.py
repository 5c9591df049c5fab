"""The code layout (docs/design.md §7), read from the source with `ast` (nothing is imported):
`launcher` and `trainer` never import each other (their contract is workerenv.py), the parts of
each (subpackages and top-level modules) depend on each other without a cycle, and no module is
over 400 lines. Imports inside functions and under TYPE_CHECKING count: a lazy import is still a
dependency (`LAZY_BACK_EDGES` names the one the trainer allows, and why)."""

from __future__ import annotations

import ast
import graphlib
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from tests.support import REPO


def _modules(package: str) -> Iterator[tuple[str, Path]]:
    """(dotted module name, path) of every module of ``package``."""
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


@cache
def _parsed(path: Path) -> tuple[ast.Module, frozenset[int]]:
    """The module's tree, and the ids of the nodes inside its functions."""
    tree = ast.parse(path.read_text(), str(path))
    return tree, frozenset(id(node) for fn in ast.walk(tree)
                           if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
                           for node in ast.walk(fn))


def _imports(module: str, path: Path, *, eager_only: bool = False) -> Iterator[str]:
    """Every module name ``path`` imports; ``from pkg import name`` yields ``pkg.name`` too, so
    that importing a submodule that way counts as importing it. ``eager_only``: only the
    imports that run when the module is imported (not those inside functions)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree, lazy = _parsed(path)
    for node in ast.walk(tree):
        if eager_only and id(node) in lazy:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


#: Folders whose subpackages are parts of their own: ``trainer.parallel.zero``, not
#: ``trainer.parallel``, depends on ``trainer.parallel.data``.
GROUPS = {"trainer.parallel"}


def _part(module: str) -> str:
    """The part of a package a module belongs to: ``launcher.head``, ``launcher.cli``,
    ``trainer.parallel.zero``, ..."""
    names = module.split(".")
    return ".".join(names[:3] if ".".join(names[:2]) in GROUPS else names[:2])


def test_launcher_and_trainer_never_import_each_other():
    crossings = [f"{module} imports {name}"
                 for side, other in (("launcher", "trainer"), ("trainer", "launcher"))
                 for module, path in _modules(side)
                 for name in _imports(module, path)
                 if name == other or name.startswith(other + ".")]
    assert crossings == [], "launcher and trainer meet only in workerenv.py"


def _graph(package: str) -> dict[str, set[str]]:
    """Part -> the parts it imports, over every module of ``package``."""
    modules = dict(_modules(package))
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        part = _part(module)
        targets = {_part(name) for name in _imports(module, path) if name in modules}
        graph.setdefault(part, set()).update(targets - {part})
    return graph


def _topological(graph: dict[str, set[str]], package: str) -> list[str]:
    try:
        return list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle between parts of {package}: "
                             f"{' -> '.join(exc.args[1])}") from None


#: Trainer edges that close a cycle and are allowed, each only through imports inside functions
#: (checked below): GPTConfig checks its MoE fields and GPT installs MoE layers when
#: ``moe_experts > 0``, while trainer.parallel.expert builds its experts on the model's layers.
LAZY_BACK_EDGES = {("trainer.model", "trainer.parallel.expert")}


def test_the_parts_of_the_launcher_import_each_other_without_a_cycle():
    order = _topological(_graph("launcher"), "launcher")
    assert {"launcher.head", "launcher.transport", "launcher.pmi", "launcher.output"} <= set(order)


def test_the_parts_of_the_trainer_import_each_other_without_a_cycle():
    graph = _graph("trainer")
    for source, target in LAZY_BACK_EDGES:
        graph[source].discard(target)
    order = _topological(graph, "trainer")
    # bottom-up, as trainer/__init__.py describes it
    assert order.index("trainer.model") < order.index("trainer.config") < order.index(
        "trainer.training") < order.index("trainer.train")


def test_the_allowed_back_edge_is_an_import_inside_functions_only():
    for source, target in sorted(LAZY_BACK_EDGES):
        assert target in _graph("trainer")[source], f"{source} -> {target} is gone: drop it"
        eager = [f"{module} imports {name}" for module, path in _modules(source.split(".")[0])
                 if _part(module) == source for name in _imports(module, path, eager_only=True)
                 if _part(name) == target]
        assert eager == [], "a module-level import makes the back edge a real cycle"


@pytest.mark.parametrize("package", ["launcher", "trainer"])
def test_no_module_imports_itself_through_other_modules(package: str) -> None:
    # Edges to a module's own ancestor packages are left out: ``from trainer.checkpoint import
    # checksum`` inside trainer/checkpoint names the package only to reach its submodule.
    modules = dict(_modules(package))
    graph = {module: {name for name in _imports(module, path) if name in modules
                      and name != module and not module.startswith(name + ".")}
             for module, path in modules.items()}
    _topological(graph, package)


def test_no_module_of_the_launcher_or_the_trainer_is_over_400_lines():
    long = {str(path.relative_to(REPO)): lines for package in ("launcher", "trainer")
            for _, path in _modules(package)
            if (lines := len(path.read_text().splitlines())) > 400}
    assert long == {}, "split each along a seam of what it does"


EP_NAME = re.compile(r"(^|_)(ep|edp)($|_)|expert_?parallel", re.IGNORECASE)
EP_TEXT = re.compile(r"\b(ep|edp)\b|expert.parallel", re.IGNORECASE)
EP_KNOWERS = ["trainer/comm/topology.py", "trainer/config/sections.py",
              "trainer/plan/__main__.py", "trainer/plan/estimate.py", "trainer/plan/report.py",
              "trainer/plan/routing.py", "trainer/plan/sends.py", "trainer/plan/traffic.py",
              "trainer/training/plan_check.py"]
"""The files outside trainer/parallel/expert whose code names expert parallelism: the mesh's axes,
the ``--ep`` option (docs/design.md §4, "A feature stays in its folder"), and the layout planner,
whose subject is every axis of a layout."""


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the string statements (module, class, function and attribute docstrings)."""
    return {id(stmt.value) for node in ast.walk(tree)
            for stmt in (node.body if isinstance(getattr(node, "body", None), list) else [])
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)}


def _names_ep(path: Path) -> bool:
    """Whether the code of ``path`` (not its comments or docstrings) names the ep axis: an
    identifier ``ep``/``edp``/``ep_*``, or a string such as ``"ep"`` or ``--ep``."""
    tree, _ = _parsed(path)
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docs and EP_TEXT.search(node.value):
                return True
            continue
        name = (node.id if isinstance(node, ast.Name) else node.attr
                if isinstance(node, ast.Attribute) else node.arg
                if isinstance(node, ast.arg | ast.keyword) else node.name
                if isinstance(node, ast.FunctionDef | ast.ClassDef) else None)
        if name and EP_NAME.search(name):
            return True
    return False


def test_expert_parallelism_is_named_outside_its_folder_only_by_the_mesh_axes_and_its_option():
    expert = REPO / "trainer" / "parallel" / "expert"
    knowers = [str(path.relative_to(REPO)) for _, path in _modules("trainer")
               if not path.is_relative_to(expert) and _names_ep(path)]
    assert knowers == EP_KNOWERS, "let the feature place itself (trainer.placement.PlacesItself)"
