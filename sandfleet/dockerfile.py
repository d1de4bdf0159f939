"""Dockerfile builds on sandfleet itself: each RUN in a sandbox over the stack so far, its
writable layer captured (a checkpoint) as the next layer, the result a named stack with the
image config the Dockerfile sets.

Why our own builder and not buildah: a RUN step is exactly a sandbox command, so it gets the
platform's confinement (cgroups, no network, seccomp, the node's runtime) instead of a second
privileged tool with its own runtime setup on the node; the layers it makes are ordinary
sandfleet layers, shared by digest like any other; and the build context never leaves the
caller's machine except as files written into a build sandbox (COPY), through the same file
API a user has, which resolves every path inside the sandbox's root.

Each step runs in a *build sandbox* (SandboxSpec.build): its system directories writable and
its root, inside its user namespace only, with the capabilities dpkg and apt need (chown,
fowner, dac_override, setuid/setgid...), so `RUN apt-get install` and writes to /usr or /etc
work as under docker; its network is what the build's allow rules open (none by default).

Taken: FROM (a layer or image name, or an image archive path, imported first), RUN, COPY and
ADD of local files (`--chown`, `--chmod`), ENV, WORKDIR, USER (the RUN steps after it run as
that user, and the image's commands too), SHELL, ENTRYPOINT, CMD, LABEL, ARG. EXPOSE, VOLUME,
STOPSIGNAL, HEALTHCHECK, ONBUILD and MAINTAINER are kept in the image's `not_applied`, as an
import lists what sandfleet does not do. Anything that would change what is built (a second
FROM, ADD of a URL or an archive, `COPY --from`, RUN flags) is a `DockerfileError` naming the
line. Parsing and planning are pure (here); the build on the platform is
`sandfleet.dockerfile_build.build(fleet, layers, ...)`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from sandfleet import errors
from sandfleet.oci_archive import ROOT_USERS
from schemas.layers import ImageConfig

SUPPORTED = ("FROM", "RUN", "COPY", "ADD", "ENV", "WORKDIR", "USER", "SHELL", "ENTRYPOINT", "CMD", "LABEL", "ARG")
# Read, and listed in the image's `not_applied`: nothing in them changes what is built.
NOT_APPLIED = ("EXPOSE", "VOLUME", "STOPSIGNAL", "HEALTHCHECK", "ONBUILD", "MAINTAINER")
DEFAULT_SHELL = ["/bin/sh", "-c"]
_OWNER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(:[A-Za-z0-9_][A-Za-z0-9_.\-]*)?$")
_MODE = re.compile(r"^[0-7]{3,4}$")
_VAR = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?::(?P<op>[-+])(?P<word>[^}]*))?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


class DockerfileError(errors.InvalidRequest):
    """A Dockerfile line the builder does not take; the message names the line."""


@dataclass(frozen=True)
class Instruction:
    line: int  # where it starts, from 1
    keyword: str  # upper case
    text: str  # the rest, continuation lines joined


def parse(text: str) -> list[Instruction]:
    """Instructions with their line numbers; comments, blank lines and `\\` continuations handled."""
    found: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        whole = (pending + stripped).strip()
        pending = ""
        keyword, _, rest = whole.partition(" ")
        found.append(Instruction(start, keyword.upper(), rest.strip()))
    if pending:
        found.append(Instruction(start, pending.split(" ", 1)[0].upper(), pending.partition(" ")[2].strip()))
    for ins in found:
        if ins.keyword not in SUPPORTED + NOT_APPLIED:
            raise DockerfileError(f"line {ins.line}: {ins.keyword} is not supported by sandfleet's builder "
                                  f"(it takes {', '.join(SUPPORTED)}; it lists {', '.join(NOT_APPLIED)} "
                                  "as not applied)")
    return found


def substitute(text: str, values: dict[str, str]) -> str:
    """`$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR:+alternative}` as the Dockerfile reference has them."""

    def one(m: re.Match) -> str:
        name = m.group("braced") or m.group("bare")
        value = values.get(name, "")
        if m.group("op") == "-":
            return value or m.group("word")
        if m.group("op") == "+":
            return m.group("word") if value else ""
        return value

    return _VAR.sub(one, text)


def _pairs(ins: Instruction, values: dict[str, str]) -> dict[str, str]:
    """`K=V K2="v 2"` (or the old `K V` form) of ENV, LABEL and ARG."""
    words = shlex.split(ins.text, posix=True)
    if not words:
        raise DockerfileError(f"line {ins.line}: {ins.keyword} needs a value")
    if "=" not in words[0]:
        if ins.keyword == "ARG" and len(words) == 1:
            return {words[0]: values.get(words[0], "")}
        return {words[0]: substitute(ins.text.split(None, 1)[1], values) if len(words) > 1 else ""}
    found = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise DockerfileError(f"line {ins.line}: {ins.keyword} takes KEY=value pairs, not {word!r}")
        found[key] = substitute(value, values)
    return found


def command(ins: Instruction, shell: list[str] | None = None) -> list[str]:
    """The exec form (a JSON list) as it is, the shell form under `shell` (SHELL's, else `/bin/sh -c`)."""
    argv = _json_list(ins.text)
    return argv if argv is not None else [*(shell or DEFAULT_SHELL), ins.text]


def _json_list(text: str) -> list[str] | None:
    if text.startswith("["):
        try:
            argv = json.loads(text)
        except ValueError:
            return None
        if isinstance(argv, list) and all(isinstance(a, str) for a in argv):
            return argv
    return None


# -- the plan: what each instruction does ------------------------------------------------


@dataclass(frozen=True)
class Copy:
    line: int
    sources: list[Path]  # inside the context, resolved
    dest: str  # absolute in the image
    into_dir: bool  # dest names a directory the sources go into
    chown: str = ""  # `--chown=user[:group]`, names as the image's files have them
    chmod: str = ""  # `--chmod=0755`


@dataclass(frozen=True)
class Run:
    line: int
    argv: list[str]
    env: dict[str, str]
    cwd: str
    user: str = ""  # who runs it (the USER before it); "": root


@dataclass
class Plan:
    base: str  # a layer name or an image archive path
    steps: list[Copy | Run | str] = field(default_factory=list)  # str: a directory to make (WORKDIR)
    config: ImageConfig = field(default_factory=ImageConfig)
    inherit: bool = True  # take the base's config under what the Dockerfile sets


def plan(instructions: list[Instruction], context: Path, base_config: ImageConfig | None = None,
         build_args: dict[str, str] | None = None) -> Plan:
    """What to do, instruction by instruction; `base_config` is the FROM image's config."""
    args = dict(build_args or {})
    froms = [i for i in instructions if i.keyword == "FROM"]
    if not froms:
        raise DockerfileError("the Dockerfile has no FROM")
    if len(froms) > 1:
        raise DockerfileError(f"line {froms[1].line}: a second FROM (multi-stage builds are not supported)")
    before = [i for i in instructions if i.line < froms[0].line]
    for ins in before:
        if ins.keyword != "ARG":
            raise DockerfileError(f"line {ins.line}: only ARG may come before FROM")
        args = {**_pairs(ins, args), **(build_args or {})}
    words = substitute(froms[0].text, args).split()
    if not words or len(words) > 1:
        raise DockerfileError(f"line {froms[0].line}: FROM takes one image (`AS` stages and flags are not supported)")
    if words[0] == "scratch":
        raise DockerfileError(f"line {froms[0].line}: FROM scratch is not supported; build a base layer first")
    config = base_config or ImageConfig()
    env = dict(e.partition("=")[::2] for e in config.env if "=" in e)
    labels, workdir, user = dict(config.labels), config.working_dir or "/", config.user
    entrypoint, cmd, set_entrypoint, set_cmd = list(config.entrypoint), list(config.cmd), False, False
    shell, ignored = list(DEFAULT_SHELL), []
    result = Plan(base=words[0])
    for ins in instructions:
        if ins.line <= froms[0].line:
            continue
        values = {**args, **env}
        if ins.keyword == "ARG":
            for key, value in _pairs(ins, values).items():
                args[key] = (build_args or {}).get(key, value)
        elif ins.keyword == "ENV":
            env.update(_pairs(ins, values))
        elif ins.keyword == "LABEL":
            labels.update(_pairs(ins, values))
        elif ins.keyword == "WORKDIR":
            workdir = os.path.normpath(os.path.join(workdir, substitute(ins.text, values)))
            result.steps.append(workdir)
        elif ins.keyword == "USER":
            user = substitute(ins.text, values).strip()
        elif ins.keyword == "SHELL":
            given = _json_list(ins.text)
            if not given:
                raise DockerfileError(f"line {ins.line}: SHELL takes a JSON list, e.g. [\"/bin/bash\", \"-c\"]")
            shell = given
        elif ins.keyword in NOT_APPLIED:
            ignored.append(f"{ins.keyword}: {ins.text} (Dockerfile line {ins.line})"[:4096])
        elif ins.keyword in ("ENTRYPOINT", "CMD"):
            argv = command(ins, shell) if ins.text else []
            if ins.keyword == "ENTRYPOINT":
                entrypoint, set_entrypoint = argv, True
            else:
                cmd, set_cmd = argv, True
        elif ins.keyword == "RUN":
            if ins.text.startswith("--"):
                raise DockerfileError(f"line {ins.line}: RUN flags ({ins.text.split()[0]}) are not supported")
            result.steps.append(Run(ins.line, command(ins, shell), {**args, **env}, workdir,
                                    "" if user in ROOT_USERS else user))
        else:  # COPY, ADD
            result.steps.append(_copy(ins, context, workdir, values))
    if set_entrypoint and not set_cmd:
        cmd = []  # as docker does: a new ENTRYPOINT drops the base's CMD
    # A base built before USER was applied may still say so: it is applied now.
    not_applied = [n for n in config.not_applied if not n.startswith("User:")] + ignored
    result.config = ImageConfig(env=[f"{k}={v}" for k, v in env.items()], working_dir=workdir if workdir != "/" else "",
                                user=user, entrypoint=entrypoint, cmd=cmd, labels=labels, not_applied=not_applied[:256])
    return result


def _copy(ins: Instruction, context: Path, workdir: str, values: dict[str, str]) -> Copy:
    text = substitute(ins.text, values)
    flags: dict[str, str] = {}
    while text.startswith("--"):
        flag, _, text = text.partition(" ")
        key, _, value = flag[2:].partition("=")
        if key == "chown" and _OWNER.match(value):
            flags["chown"] = value
        elif key == "chmod" and _MODE.match(value):
            flags["chmod"] = value
        elif key != "link":  # --link changes how docker caches the layer, not what it holds
            raise DockerfileError(f"line {ins.line}: {ins.keyword} {flag} is not supported "
                                  "(it takes --chown=USER[:GROUP], --chmod=OCTAL and --link)")
        text = text.lstrip()
    words = json.loads(text) if text.startswith("[") else shlex.split(text)
    if len(words) < 2:
        raise DockerfileError(f"line {ins.line}: {ins.keyword} needs a source and a destination")
    *sources, dest = words
    root = context.resolve()
    found: list[Path] = []
    for source in sources:
        if ins.keyword == "ADD" and re.match(r"^[a-z][a-z0-9+.\-]*://", source):
            raise DockerfileError(f"line {ins.line}: ADD of a URL is not supported (no network); fetch it into "
                                  "the context and COPY it")
        if ins.keyword == "ADD" and re.search(r"\.(tar|tar\.gz|tgz|tar\.bz2|tbz2|tar\.xz|txz)$", source):
            raise DockerfileError(f"line {ins.line}: ADD of an archive (unpacked by docker) is not supported; "
                                  "unpack it in the context and COPY the directory")
        matches = sorted(root.glob(source.lstrip("/"))) if any(c in source for c in "*?[") else [root / source.lstrip("/")]
        if not matches:
            raise DockerfileError(f"line {ins.line}: {source} matches nothing in the context")
        for path in matches:
            resolved = path.resolve()
            if resolved != root and root not in resolved.parents:
                raise DockerfileError(f"line {ins.line}: {source} is outside the build context")
            if not resolved.exists():
                raise DockerfileError(f"line {ins.line}: {source} is not in the build context")
            found.append(resolved)
    target = dest if dest.startswith("/") else os.path.join(workdir, dest)
    into_dir = dest.endswith("/") or len(found) > 1 or dest in (".", "./")
    return Copy(ins.line, found, os.path.normpath(target), into_dir, **flags)
