"""What the launcher asks of its spawner: one frozen dataclass per request, its wire form and
the checks that turn a datagram back into one.

A request crosses the spawner's SOCK_SEQPACKET socket as one datagram holding a JSON object,
`{"v": VERSION, "type": <tag>, <data fields>...}`, with the request's fds beside it as
SCM_RIGHTS, in the order the class declares its fd fields (its `FDS`). An fd's number means
nothing in the other process, so fds never appear in the JSON. Where a request has a report
pipe it is its first fd: a spawner that cannot read a request still knows where to say so.

Plain data only (JSON, never pickle or marshal) so the form can be read and checked, and the
standard library only: the spawner runs `python -S -I`. A request is encoded once; encoding
and decoding an exec take ~8 µs each on the 2-core dev VM (the marshal they replace, ~1 µs),
beside a fork and exec of milliseconds.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

VERSION = 1  # raise on any change a spawner of the old form would misread


class ProtocolError(ValueError):
    """A datagram that is not a request this side can serve."""


class UnsupportedVersion(ProtocolError):
    """The request speaks another protocol version (a launcher and spawner of different trees)."""


class UnknownRequestType(ProtocolError):
    """The request's type tag names no request of this version."""


class MalformedRequest(ProtocolError):
    """Not JSON, a field missing, unknown or of the wrong type, or the wrong number of fds."""


def _fd() -> Any:
    """An fd field: passed as SCM_RIGHTS, in declaration order; required (no default)."""
    return dataclasses.field(metadata={"fd": True})


class _Wire:
    """What `_request` notes on each request class."""

    TYPE: ClassVar[str]  # the wire tag
    FDS: ClassVar[tuple[str, ...]]  # the fd fields, in SCM_RIGHTS order
    DATA: ClassVar[tuple[str, ...]]  # the fields that go in the JSON
    CHECKS: ClassVar[tuple[tuple[str, Any, Any], ...]]  # (field, check, conversion) for decode


_W = TypeVar("_W", bound=type[_Wire])
_KINDS: dict[str, type[_Wire]] = {}

# The field types a request may declare: the check a decoded JSON value must pass, and its
# conversion to the dataclass's form (JSON has lists where requests hold tuples; a JSON
# object's keys are always strings).
_TYPES: dict[str, tuple[Callable[[Any], bool], Callable[[Any], Any] | None]] = {
    "int": (lambda v: type(v) is int, None),
    "bool": (lambda v: type(v) is bool, None),
    "str": (lambda v: type(v) is str, None),
    "str | None": (lambda v: v is None or type(v) is str, None),
    "tuple[str, ...]": (lambda v: type(v) is list and all(type(s) is str for s in v), tuple),
    "dict[str, str]": (lambda v: type(v) is dict and all(type(s) is str for s in v.values()), None),
}


def _request(tag: str) -> Callable[[_W], _W]:
    """Register a request class under its wire tag and note its data and fd fields."""

    def register(cls: _W) -> _W:
        fields = dataclasses.fields(cls)
        for f in fields:
            if f.type not in (("int",) if f.metadata.get("fd") else _TYPES):
                raise TypeError(f"{cls.__name__}.{f.name}: {f.type} is no wire type")
        cls.TYPE = tag
        cls.FDS = tuple(f.name for f in fields if f.metadata.get("fd"))
        cls.DATA = tuple(f.name for f in fields if not f.metadata.get("fd"))
        cls.CHECKS = tuple((name, *_TYPES[cls.__dataclass_fields__[name].type]) for name in cls.DATA)
        _KINDS[tag] = cls
        return cls

    return register


@_request("ping")
@dataclass(frozen=True, kw_only=True)
class Ping(_Wire):
    """Nothing to do: starts the spawner ahead of the first real request (warm_up)."""


@_request("signal")
@dataclass(frozen=True, kw_only=True)
class Signal(_Wire):
    """Send `signal` to `pid` if it is one of the spawner's children not yet reaped (so the pid
    cannot have been recycled): an init that never got ready, an exec helper being cancelled."""

    pid: int
    signal: int


@_request("start")
@dataclass(frozen=True, kw_only=True)
class StartInit(_Wire):
    """Fork a sandbox's init (B) into a new pid namespace: it joins `cgroup_procs`, enters the
    netns, builds its root (on `rootfs_dir` if given, else the host view), enters its user
    namespace (where `id_host` asks for one) and execs catatonit."""

    cgroup_procs: tuple[str, ...]  # the cgroup.procs files it joins, before anything else
    tmp_size_mb: int
    workspace_size_mb: int
    hostname: str
    rootfs_dir: str | None  # a composed root (linuxnode.layered_root); None: the host view
    apparmor: str = ""  # the AppArmor profile it execs into (loaded by the node agent); "": none
    # Host uid/gid of its root: it runs in a user namespace mapping 0..65535 there (linuxnode.userns),
    # made by the spawner; 0: no user namespace. Every other namespace stays the host's own.
    id_host: int = 0
    report: int = _fd()  # write end of the report pipe (reports.py)
    netns: int = _fd()  # the sandbox's network namespace


@_request("init-on-root")
@dataclass(frozen=True, kw_only=True)
class StartInitOnRoot(StartInit):
    """StartInit on a composed root (`rootfs_dir` names it, for messages): the root itself comes
    as a detached mount tree (an open_tree clone, made where the root is mounted: the node's
    roots namespace, linuxnode.roots_ns), which the init attaches in its own namespace."""

    root_tree: int = _fd()


@_request("exec")
@dataclass(frozen=True, kw_only=True)
class ExecCommand(_Wire):
    """Fork an exec helper (C) that enters the init's namespaces and root and spawns argv."""

    cgroup_procs: tuple[str, ...]
    cwd: str
    argv: tuple[str, ...]
    env: dict[str, str]
    apparmor: str = ""  # the sandbox's AppArmor profile, which the command execs into; "": none
    uid: int = -1  # the uid and gid it runs as in the sandbox (an image's `User`); -1: the sandbox's root
    gid: int = -1
    # A build sandbox's command (SandboxSpec.build): its whole root writable under Landlock and,
    # as the sandbox's root, BUILD_CAPABILITIES kept in the sandbox's user namespace (never
    # without one: the helper refuses).
    build: bool = False
    report: int = _fd()  # write end of the report pipe (reports.py)
    pidfd: int = _fd()  # the init's: whose namespaces the command enters
    root: int = _fd()  # the init's root directory (O_PATH)
    stdin: int = _fd()  # read end of the command's stdin pipe
    stdout: int = _fd()  # write ends of its output pipes
    stderr: int = _fd()


@_request("spawn")
@dataclass(frozen=True, kw_only=True)
class SpawnCommand(ExecCommand):
    """An exec whose helper also reports the command's pid once it runs and, for as long as the
    command does, reads signal numbers (one byte each) from `control` and sends each to the
    command's process group: the launcher signals a background command without ever holding
    a pid that could be recycled (the helper's child is not reaped until the helper says so)."""

    control: int = _fd()  # read end of the signal pipe


@_request("terminal")
@dataclass(frozen=True, kw_only=True)
class TerminalCommand(SpawnCommand):
    """A spawn whose stdin, stdout and stderr are three fds of one pty's slave (its master stays
    with the launcher): the command leads a new session with that terminal as its controlling
    tty (setsid, then TIOCSCTTY), so job control, Ctrl-C as a byte and window changes work."""


Request = Ping | Signal | StartInit | StartInitOnRoot | ExecCommand | SpawnCommand | TerminalCommand


_ENCODER = json.JSONEncoder(separators=(",", ":"), check_circular=False)  # json.dumps makes one a call
_DECODER = json.JSONDecoder()


def encode(request: Request) -> tuple[bytes, list[int]]:
    """The datagram and the fds to send beside it, in the request's FDS order."""
    body = {"v": VERSION, "type": request.TYPE}
    for name in request.DATA:
        body[name] = getattr(request, name)
    return _ENCODER.encode(body).encode(), [getattr(request, name) for name in request.FDS]


def decode(data: bytes, fds: list[int]) -> Request:
    """The request a datagram and its fds carry; a ProtocolError says why it is none. The fds
    stay the caller's to close, whatever happens."""
    try:
        body = _DECODER.decode(data.decode())
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise MalformedRequest(f"request is not JSON: {exc}") from None
    if type(body) is not dict:
        raise MalformedRequest(f"request is a JSON {type(body).__name__}, not an object")
    version = body.pop("v", None)
    if type(version) is not int or version != VERSION:  # true == 1 in Python, not on this wire
        raise UnsupportedVersion(f"request version {version!r}, this spawner speaks {VERSION}")
    tag = body.pop("type", None)
    cls = _KINDS.get(tag) if type(tag) is str else None
    if cls is None:
        raise UnknownRequestType(f"unknown request type {tag!r} (known: {', '.join(sorted(_KINDS))})")
    fields = {}
    for name, check, convert in cls.CHECKS:
        try:
            value = body.pop(name)
        except KeyError:
            raise MalformedRequest(f"{tag} request: field {name!r} missing") from None
        if not check(value):
            raise MalformedRequest(f"{tag} request: field {name!r} has the wrong type ({type(value).__name__})")
        fields[name] = convert(value) if convert else value
    if body:
        raise MalformedRequest(f"{tag} request: unknown field(s) {', '.join(map(repr, sorted(body)))}")
    if len(fds) != len(cls.FDS):
        raise MalformedRequest(f"{tag} request: {len(fds)} fds, expected {len(cls.FDS)} ({', '.join(cls.FDS)})")
    return cls(**fields, **dict(zip(cls.FDS, fds)))
