"""Dockerfile builds on sandfleet itself: each RUN in a sandbox over the stack so far, its
writable layer captured (a checkpoint) as the next layer, the result a named stack with the
image config the Dockerfile sets.

Why our own builder and not buildah: a RUN step is exactly a sandbox command, so it gets the
platform's confinement (cgroups, no network, seccomp, the node's runtime) instead of a second
privileged tool with its own runtime setup on the node; the layers it makes are ordinary
sandfleet layers, shared by digest like any other; and the build context never leaves the
caller's machine except as files written into a build sandbox (COPY), through the same file
API a user has, which resolves every path inside the sandbox's root.

Taken: FROM (a layer or image name, or an image archive path, imported first), RUN, COPY and
ADD of local files, ENV, WORKDIR, USER (recorded; commands still run as root, said in the
image's `not_applied`), ENTRYPOINT, CMD, LABEL, ARG. Anything else (a second FROM, HEALTHCHECK,
ADD of a URL, `--chown`...) is a `DockerfileError` naming the line. The parsing is pure; the
build is `build(fleet, layers, ...)`.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from sandfleet import errors
from schemas.layers import ImageConfig

SUPPORTED = ("FROM", "RUN", "COPY", "ADD", "ENV", "WORKDIR", "USER", "ENTRYPOINT", "CMD", "LABEL", "ARG")
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
        if ins.keyword not in SUPPORTED:
            raise DockerfileError(f"line {ins.line}: {ins.keyword} is not supported by sandfleet's builder "
                                  f"(it takes {', '.join(SUPPORTED)})")
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


def command(ins: Instruction) -> list[str]:
    """The exec form (a JSON list) as it is, the shell form under `/bin/sh -c`."""
    if ins.text.startswith("["):
        try:
            argv = json.loads(ins.text)
        except ValueError:
            argv = None
        if isinstance(argv, list) and all(isinstance(a, str) for a in argv):
            return argv
    return ["/bin/sh", "-c", ins.text]


# -- the plan: what each instruction does ------------------------------------------------


@dataclass(frozen=True)
class Copy:
    line: int
    sources: list[Path]  # inside the context, resolved
    dest: str  # absolute in the image
    into_dir: bool  # dest names a directory the sources go into


@dataclass(frozen=True)
class Run:
    line: int
    argv: list[str]
    env: dict[str, str]
    cwd: str


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
        elif ins.keyword in ("ENTRYPOINT", "CMD"):
            argv = command(ins) if ins.text else []
            if ins.keyword == "ENTRYPOINT":
                entrypoint, set_entrypoint = argv, True
            else:
                cmd, set_cmd = argv, True
        elif ins.keyword == "RUN":
            if ins.text.startswith("--"):
                raise DockerfileError(f"line {ins.line}: RUN flags ({ins.text.split()[0]}) are not supported")
            result.steps.append(Run(ins.line, command(ins), {**args, **env}, workdir))
        else:  # COPY, ADD
            result.steps.append(_copy(ins, context, workdir, values))
    if set_entrypoint and not set_cmd:
        cmd = []  # as docker does: a new ENTRYPOINT drops the base's CMD
    not_applied = [n for n in config.not_applied if not n.startswith("User:")]
    if user not in ("", "root", "0", "0:0"):
        not_applied.append(f"User: {user} (commands, RUN steps included, run as the sandbox's root)")
    result.config = ImageConfig(env=[f"{k}={v}" for k, v in env.items()], working_dir=workdir if workdir != "/" else "",
                                user=user, entrypoint=entrypoint, cmd=cmd, labels=labels, not_applied=not_applied)
    return result


def _copy(ins: Instruction, context: Path, workdir: str, values: dict[str, str]) -> Copy:
    text = substitute(ins.text, values)
    if text.startswith("--"):
        raise DockerfileError(f"line {ins.line}: {ins.keyword} flags ({text.split()[0]}) are not supported")
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
    return Copy(ins.line, found, os.path.normpath(target), into_dir)


# -- the build ---------------------------------------------------------------------------


async def build(fleet, layers, name: str, dockerfile: Path, context: Path, *, build_args: dict[str, str] | None = None,
                isolation: str = "container", tags: list[str] | None = None, log=print):
    """Build `dockerfile` over its FROM and record the result as stack `name`; returns its BuildReply.
    `fleet` is a `sandfleet.Fleet`, `layers` a `sandfleet.layers_client.Layers`."""
    instructions = parse(dockerfile.read_text())
    first = plan(instructions, context, None, build_args)
    token = secrets.token_hex(3)
    scratch: list[str] = []  # names made on the way, removed at the end (their images stay under `name`)
    try:
        base = first.base
        candidate = Path(base) if Path(base).is_absolute() else (dockerfile.parent / base)
        if candidate.is_file():
            base = f"{name[:50]}-from-{token}"
            log(f"FROM {first.base}: importing the archive as {base}")
            await layers.import_image(base, candidate)
            scratch.append(base)
        try:
            base_layer = await layers.get(base)
        except errors.NotFound:
            raise DockerfileError(f"FROM {first.base}: no such layer or image, and no such archive file") from None
        result = plan(instructions, context, base_layer.config, build_args)
        current, pending, step = base, [], 0
        for item in result.steps + [None]:  # None: capture what the last steps wrote
            if item is not None:
                pending.append(item)
            if pending and (item is None or isinstance(item, Run)):
                step += 1
                current = await _one_step(fleet, layers, current, pending, f"{name[:40]}-{token}-{step}",
                                          isolation, scratch, log)
                pending = []
        return await layers.stack(name, [current], result.config, tags=tags or [])
    finally:
        for leftover in reversed(scratch):
            try:
                await layers.remove(leftover)
            except errors.SandfleetError:
                pass


async def _one_step(fleet, layers, current: str, steps: list, prefix: str, isolation: str, scratch: list[str],
                    log) -> str:
    """Run `steps` in one sandbox over `current`, capture its writable layer, and name the stack
    so far (one reference, so a long Dockerfile never passes the layers a spec takes)."""
    sb = await fleet.create(isolation=isolation, layers=[current], memory_mb=1024, timeout_s=3600)
    try:
        for item in steps:
            if isinstance(item, str):
                await sb.files.mkdir(item, parents=True)
            elif isinstance(item, Copy):
                log(f"line {item.line}: COPY {' '.join(p.name for p in item.sources)} {item.dest}")
                for source in item.sources:
                    target = os.path.join(item.dest, source.name) if item.into_dir and source.is_file() else item.dest
                    await sb.files.mkdir(os.path.dirname(target) if source.is_file() else target, parents=True)
                    await sb.upload(source, target)
            else:
                log(f"line {item.line}: RUN {' '.join(item.argv)[:100]}")
                await sb.files.mkdir(item.cwd, parents=True)
                r = await sb.exec(item.argv, env=item.env, cwd=item.cwd, timeout_s=3600)
                if r.exit_code != 0:
                    tail = (r.stderr or r.stdout).decode(errors="replace").strip().splitlines()[-3:]
                    raise errors.InvalidRequest(f"line {item.line}: RUN exited {r.exit_code}: {' | '.join(tail)}")
        checkpoint = await sb.checkpoint(prefix)
    finally:
        await sb.destroy()
    scratch.append(checkpoint.name)
    so_far = prefix + "-s"
    await layers.stack(so_far, [current, checkpoint.name])
    scratch.append(so_far)
    return so_far
