"""Import layering, read from the source with `ast` (nothing is imported): `launcher` and
`trainer` never import each other (their contract is workerenv.py), and the parts of `launcher`
(its subpackages and top-level modules) depend on each other without a cycle. Imports inside
functions and under TYPE_CHECKING count: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Iterator
from pathlib import Path

from tests.support import REPO


def _modules(package: str) -> Iterator[tuple[str, Path]]:
    """(dotted module name, path) of every module of ``package``."""
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _imports(module: str, path: Path) -> Iterator[str]:
    """Every module name ``path`` imports; ``from pkg import name`` yields ``pkg.name`` too, so
    that importing a submodule that way counts as importing it."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _part(module: str) -> str:
    """The part of `launcher` a module belongs to: ``launcher.head``, ``launcher.cli``, ..."""
    return ".".join(module.split(".")[:2])


def test_launcher_and_trainer_never_import_each_other():
    crossings = [f"{module} imports {name}"
                 for side, other in (("launcher", "trainer"), ("trainer", "launcher"))
                 for module, path in _modules(side)
                 for name in _imports(module, path)
                 if name == other or name.startswith(other + ".")]
    assert crossings == [], "launcher and trainer meet only in workerenv.py"


def test_the_parts_of_the_launcher_import_each_other_without_a_cycle():
    modules = dict(_modules("launcher"))
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        part = _part(module)
        targets = {_part(name) for name in _imports(module, path) if name in modules}
        graph.setdefault(part, set()).update(targets - {part})
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle between parts of launcher: "
                             f"{' -> '.join(exc.args[1])}") from None
    assert {"launcher.head", "launcher.transport", "launcher.pmi"} <= set(order)
