"""Optional parts of the install: what `pip install 'sandfleet[<extra>]'` adds, and whether it is here.

`pip install sandfleet` is a client (the SDK, the CLI's client commands). Running a node takes
the `node` extra; exporting spans the `tracing` extra (part of `node`). What an extra holds is
read from the package's own metadata, so pyproject.toml stays the one list.
"""

from __future__ import annotations

import importlib.metadata
import re

DISTRIBUTION = "sandfleet"
_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


class MissingExtra(Exception):
    """This install lacks an optional part; the message is one line saying what to install."""

    def __init__(self, extra: str, purpose: str, missing: list[str]) -> None:
        super().__init__(f"{purpose} needs the '{extra}' extra: pip install '{DISTRIBUTION}[{extra}]' "
                         f"(not installed: {', '.join(missing)})")
        self.extra, self.missing = extra, missing


def _requirements(extra: str, seen: frozenset[str] = frozenset()) -> list[str]:
    """Distribution names an extra brings, its own nested extras (`sandfleet[tracing]`) expanded."""
    names = []
    for req in importlib.metadata.requires(DISTRIBUTION) or []:
        spec, _, marker = req.partition(";")
        if extra not in _EXTRA.findall(marker):
            continue
        match = _NAME.match(spec)
        if match is None:
            continue
        name, nested = match.group(1), match.group(2) or ""
        if name.lower() == DISTRIBUTION:
            for inner in (e.strip() for e in nested.split(",")):
                if inner and inner not in seen:
                    names += _requirements(inner, seen | {extra})
        else:
            names.append(name)
    return names


def missing(extra: str) -> list[str]:
    """The distributions of `extra` that are not installed ([] in a source tree run without
    installing: nothing to compare with, an import will tell)."""
    try:
        wanted = _requirements(extra)
    except importlib.metadata.PackageNotFoundError:
        return []
    absent = []
    for name in wanted:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            absent.append(name)
    return absent


def require(extra: str, purpose: str) -> None:
    """Raise MissingExtra unless every distribution of `extra` is installed."""
    absent = missing(extra)
    if absent:
        raise MissingExtra(extra, purpose, absent)
