"""The floors of the code base, read from every `import` (at module level or lazily inside a
function) of every .py file of our packages, with `ast`: nothing runs.

    schemas/               the ground floor: imports nothing of ours (but itself)
    linuxnode/             the node's library: nothing of ours but schemas.ustar (a tree's wire format,
                           which the SDK reads and writes too)
    sandfleet/             the SDK: no node code (linuxnode, services, agents) and no loadtest
    services/<a>           no other service (services/<b>) and no agent: they meet on the bus
    agents/<x>             no service
    loadtest/              public interfaces only: the SDK, the bus and schemas, linuxnode

A service or agent runs as a process (`python -m services.placement`): starting one by its
module name is not an import, and is allowed anywhere.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

OURS = ("sandfleet", "linuxnode", "schemas", "services", "agents", "loadtest")
# A package whose parts are separate units: `services.placement` and `services.launcher`.
SPLIT = ("services", "agents")


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository
    line: int
    module: str  # absolute, e.g. services.launcher.starting

    def __str__(self) -> str:
        return f"{self.path}:{self.line} → {self.module}"


def unit(module: str) -> str:
    """The unit a module belongs to: `services.launcher` for services.launcher.starting,
    `schemas` for schemas.node, '' for anything not ours."""
    parts = module.split(".")
    if parts[0] not in OURS:
        return ""
    return ".".join(parts[:2]) if parts[0] in SPLIT and len(parts) > 1 else parts[0]


def imports(source: str, path: str, module: str) -> Iterator[Import]:
    """Every import in `source` (the file of `module`), relative ones made absolute; for
    `from services import placement` the module imported is services.placement."""
    is_package = path.endswith("__init__.py")
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # A name from a bare package may be one of its modules: judge it as one.
                split_root = base in SPLIT and alias.name != "*"
                yield Import(path, node.lineno, f"{base}.{alias.name}" if split_root else base)


@dataclass(frozen=True)
class Floor:
    name: str
    importers: str  # a top-level package of ours
    forbidden: tuple[str, ...]  # top-level packages it must not import
    other_units: bool = False  # nor another unit of its own package (services/<a> → services/<b>)
    allowed: tuple[str, ...] = ()  # modules of a forbidden package it may import all the same

    def broken_by(self, imp: Import, importer: str) -> bool:
        target = unit(imp.module)
        if not target or imp.module in self.allowed:
            return False
        if target.split(".")[0] in self.forbidden:
            return True
        return self.other_units and target.split(".")[0] == self.importers and target != importer and "." in target


FLOORS = [
    Floor("linuxnode imports nothing of ours but a tree's wire format", "linuxnode",
          ("sandfleet", "schemas", "services", "agents", "loadtest"), allowed=("schemas.ustar",)),
    Floor("schemas import nothing of ours", "schemas", ("sandfleet", "linuxnode", "services", "agents", "loadtest")),
    Floor("the SDK imports no node code and no loadtest", "sandfleet", ("linuxnode", "services", "agents", "loadtest")),
    Floor("a service imports no other service and no agent", "services", ("agents", "loadtest"), other_units=True),
    Floor("an agent imports no service", "agents", ("services", "loadtest")),
    Floor("loadtest imports no service or agent", "loadtest", ("services", "agents")),
]


def module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def all_imports(package: str) -> Iterator[tuple[str, Import]]:
    """(importer's unit, import) for every import of every .py file under `package`."""
    for path in sorted((ROOT / package).rglob("*.py")):
        module = module_of(path)
        rel = str(path.relative_to(ROOT))
        for imp in imports(path.read_text(), rel, module):
            yield unit(module), imp


def offenders(floor: Floor) -> list[Import]:
    return [imp for importer, imp in all_imports(floor.importers) if floor.broken_by(imp, importer)]


@pytest.mark.parametrize("floor", FLOORS, ids=[f.name for f in FLOORS])
def test_floor(floor):
    found = offenders(floor)
    assert not found, f"{floor.name}; {len(found)} import(s) break it:\n" + "\n".join(f"  {i}" for i in found)


def test_every_package_is_checked():
    """A new top-level package of ours must get its floor here, not slip past every rule."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - {"tests"} == set(OURS)


SAMPLE = '''
import os
from schemas import node
from . import sibling
from ..launcher.starting import StartingMarks

def lazy():
    from agents.node.bpf import EgressPolicy
    import services.placement.ledger

class K:
    def m(self):
        from services import launcher, placement
'''


def test_the_reader_sees_lazy_relative_and_package_imports():
    """The checker itself: function-level, relative and `from <package> import <module>` imports
    all count, resolved to the module they name, with their line."""
    got = [(i.line, i.module) for i in imports(SAMPLE, "services/placement/handlers.py", "services.placement.handlers")]
    assert sorted(got) == [(2, "os"), (3, "schemas"), (4, "services.placement"), (5, "services.launcher.starting"),
                           (8, "agents.node.bpf"), (9, "services.placement.ledger"),
                           (13, "services.launcher"), (13, "services.placement")]
    floor = next(f for f in FLOORS if f.importers == "services")
    broken = sorted(str(i) for i in imports(SAMPLE, "services/placement/handlers.py", "services.placement.handlers")
                    if floor.broken_by(i, "services.placement"))
    assert broken == ["services/placement/handlers.py:13 → services.launcher",
                      "services/placement/handlers.py:5 → services.launcher.starting",
                      "services/placement/handlers.py:8 → agents.node.bpf"]
