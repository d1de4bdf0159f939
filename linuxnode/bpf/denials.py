"""The one typed record of a refused network attempt, decoded from the ring buffer."""

from __future__ import annotations

import ctypes as ct
import ipaddress
from enum import Enum

import msgspec

DENIAL_SIZE = 72  # SF_DENIAL_SIZE in allowlist.h


class DenialKind(str, Enum):
    CONNECT = "connect"  # connect(): TCP, or a UDP socket being connected
    SENDMSG = "sendmsg"  # sendto()/sendmsg() naming a destination on a UDP socket
    SOCKET = "socket"  # socket() refused: raw, packet, ICMP or any non-TCP/UDP inet socket


_KINDS = {1: DenialKind.CONNECT, 2: DenialKind.SENDMSG, 3: DenialKind.SOCKET}


class Denial(msgspec.Struct, frozen=True, kw_only=True):
    """What a sandbox process tried and was refused, as the kernel saw it."""

    kind: DenialKind
    cgroup_id: int
    pid: int
    tid: int
    comm: str
    family: int  # AF_INET=2, AF_INET6=10, AF_PACKET=17, ...
    address: str | None  # IPv4 for AF_INET and IPv4-mapped IPv6; None for SOCKET
    port: int  # 0 for SOCKET
    protocol: int  # IPPROTO_* (for a packet socket: the ethertype it asked for)
    socket_type: int  # SOCK_STREAM=1, SOCK_DGRAM=2, SOCK_RAW=3, ...
    monotonic_ns: int  # CLOCK_MONOTONIC at the refusal (comparable with time.monotonic_ns())


# The fields every ring-buffer record of ours starts with (allowlist.bpf.c and syscalls.bpf.c):
# when, which sandbox (its v2 cgroup id) and which task.
RECORD_HEADER = [
    ("ts_ns", ct.c_uint64),
    ("cgroup_id", ct.c_uint64),
    ("pid", ct.c_uint32),
    ("tid", ct.c_uint32),
    ("comm", ct.c_char * 16),
]


class _Record(ct.Structure):  # struct sf_denial
    _fields_ = RECORD_HEADER + [
        ("addr", ct.c_ubyte * 16),
        ("port", ct.c_uint16),
        ("family", ct.c_uint16),
        ("type", ct.c_uint16),
        ("protocol", ct.c_uint16),
        ("kind", ct.c_uint8),
        ("pad", ct.c_uint8 * 7),
    ]


assert ct.sizeof(_Record) == DENIAL_SIZE


def decode(data: int | None, size: int) -> Denial:
    """Copy one ring buffer record (valid only during the callback) into a Denial."""
    if not data or size < DENIAL_SIZE:
        raise ValueError(f"short denial record: {size} bytes")
    rec = _Record.from_address(data)
    kind = _KINDS.get(rec.kind)
    if kind is None:
        raise ValueError(f"unknown denial kind {rec.kind}")
    address: str | None = None
    if kind is not DenialKind.SOCKET:
        ip6 = ipaddress.IPv6Address(bytes(rec.addr))
        address = str(ip6.ipv4_mapped or ip6)
    return Denial(
        kind=kind,
        cgroup_id=rec.cgroup_id,
        pid=rec.pid,
        tid=rec.tid,
        comm=rec.comm.decode(errors="replace"),
        family=rec.family,
        address=address,
        port=rec.port,
        protocol=rec.protocol,
        socket_type=rec.type,
        monotonic_ns=rec.ts_ns,
    )
