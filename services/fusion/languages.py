"""How each language is judged: where its code goes, how it is compiled (if it is) and run, and
which layer holds its toolchain. Pure data and text; no I/O.

The commands follow what SandboxFusion runs for each language (a C++17 `g++ -O2` build, `go build`,
`javac` of the file named after the public class, ...), so what a program may rely on is the same."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

WORKDIR = "/workspace"  # the sandbox's own empty directory: code, files and fetched paths are relative to it


@dataclass(frozen=True)
class Plan:
    source: str  # file name of the code, in WORKDIR
    run: list[str]
    compile: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)


_JAVA_CLASS = re.compile(r"public\s+(?:final\s+|abstract\s+)*class\s+([A-Za-z_$][A-Za-z0-9_$]*)")


def _java(code: str) -> Plan:
    # javac insists that a public class lives in a file of its name.
    found = _JAVA_CLASS.search(code)
    name = found.group(1) if found else "Main"
    return Plan(source=f"{name}.java", compile=["javac", "-encoding", "UTF-8", f"{name}.java"],
                run=["java", "-cp", ".", name])


_PLANS = {
    "python": lambda code: Plan(source="main.py", run=["python3", "main.py"]),
    "bash": lambda code: Plan(source="main.sh", run=["bash", "main.sh"]),
    "nodejs": lambda code: Plan(source="main.js", run=["node", "main.js"]),
    "cpp": lambda code: Plan(source="main.cpp", compile=["g++", "-std=c++17", "-O2", "-o", "main", "main.cpp"],
                             run=["./main"]),
    # The module cache and build cache go under HOME (/workspace); a single file needs no go.mod.
    "go": lambda code: Plan(source="main.go", compile=["go", "build", "-o", "main", "main.go"], run=["./main"],
                            env={"GO111MODULE": "off", "GOCACHE": f"{WORKDIR}/.cache/go-build"}),
    "java": _java,
}

LANGUAGES = tuple(_PLANS)


def plan(language: str, code: str) -> Plan | None:
    """The plan for `language`, or None when this endpoint does not judge it."""
    make = _PLANS.get(language)
    return make(code) if make else None


def default_layer(language: str) -> str:
    """The layer `sandfleet fusion layers` builds for `language`."""
    return f"lang-{language}"


def layer_map(setting: str) -> dict[str, str]:
    """Every language's layer: `lang-<language>`, unless `setting` ("python=py-3,cpp=toolchains")
    names another."""
    layers = {lang: default_layer(lang) for lang in LANGUAGES}
    for item in filter(None, (part.strip() for part in setting.split(","))):
        lang, sep, layer = item.partition("=")
        if not sep or lang.strip() not in layers or not layer.strip():
            raise ValueError(f"{item!r}: expected LANGUAGE=LAYER with LANGUAGE one of {', '.join(LANGUAGES)}")
        layers[lang.strip()] = layer.strip()
    return layers


def in_workdir(path: str) -> str:
    """A request's file path in the sandbox: relative paths are relative to WORKDIR."""
    return path if path.startswith("/") else f"{WORKDIR}/{path}"
