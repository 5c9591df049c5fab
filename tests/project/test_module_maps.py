"""The module maps (the docstrings of ``launcher/__init__.py``, ``trainer/__init__.py`` and of
every package's ``__init__.py``) stay true, read from the source with `ast`: every module and
subpackage is named in its package's map or in the root map, every entry of a map is a module
or subpackage that exists, and every dotted name a map cites (``trainer.parallel.zero.layout``,
``trainer.model.config.MoEConfig``) resolves to a module or to a name defined in one."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from tests.support import REPO

ROOTS = ("launcher", "trainer")
#: A map entry: "    name    what it is" (two spaces at least) or "    name/ what it holds".
ENTRY = re.compile(r"^    ([a-z_]+/(?=\s)|[a-z_]+(?=\s{2}))\s+\S", re.MULTILINE)
CITED = re.compile(r"`((?:launcher|trainer)(?:\.\w+)+)`")


def map_entries(doc: str) -> set[str]:
    """The entries of a docstring's map: its first table of indented lines (a later table is
    something else, such as the fields of a contract: ``launcher/hang``'s `Diagnosis`)."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("    ")), len(lines))
    end = next((i for i in range(start, len(lines)) if lines[i][:1].strip()), len(lines))
    return set(ENTRY.findall("\n".join(lines[start:end])))


def packages(root: str) -> list[Path]:
    return sorted(p.parent for p in (REPO / root).rglob("__init__.py"))


def parts(package: Path) -> set[str]:
    """The modules and subpackages of ``package`` (``name`` and ``name/``)."""
    return ({p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
            | {p.name + "/" for p in package.iterdir() if (p / "__init__.py").is_file()})


@cache
def docstring(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""


@pytest.mark.parametrize("root", ROOTS)
def test_the_root_map_names_every_top_level_module_and_package_and_nothing_else(root: str
                                                                              ) -> None:
    entries = map_entries(docstring(REPO / root))
    assert entries == parts(REPO / root)


@pytest.mark.parametrize("package", [p for r in ROOTS for p in packages(r)],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_module_of_a_package_is_named_in_its_map_and_every_entry_exists(
        package: Path) -> None:
    root = REPO / package.relative_to(REPO).parts[0]
    maps = docstring(package) + "\n" + docstring(root)
    missing = [name for name in sorted(parts(package))
               if not re.search(rf"\b{re.escape(name.rstrip('/'))}\b", maps)]
    assert missing == [], f"{package.relative_to(REPO)}: not in any module map"
    if package != root:
        unknown = map_entries(docstring(package)) - parts(package) - \
            {p.rstrip("/") for p in parts(package)}
        assert unknown == set(), f"{package.relative_to(REPO)}: map entries that do not exist"


def defined(module: Path) -> set[str]:
    """The names a module defines at its top level (classes, functions, assignments,
    imports)."""
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def resolves(dotted: str) -> bool:
    """A module, a package, or a name defined in one (the longest module prefix)."""
    pieces = dotted.split(".")
    for cut in range(len(pieces), 0, -1):
        path = REPO.joinpath(*pieces[:cut])
        module = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if module.is_file():
            rest = pieces[cut:]
            return not rest or rest[0] in defined(module) or \
                (path.is_dir() and resolves(".".join([*pieces[:cut], rest[0]])) and
                 len(rest) == 1)
    return False


@pytest.mark.parametrize("package", [p for r in ROOTS for p in packages(r)],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_name_a_map_cites_exists(package: Path) -> None:
    broken = [name for name in CITED.findall(docstring(package)) if not resolves(name)]
    assert broken == [], f"{package.relative_to(REPO)} cites what does not exist"
