"""Port forwarding over the bus: opening a tunnel to a port inside a sandbox, and its frames.

One tunnel is one TCP connection. The client asks the node holding the sandbox
(`node.v1.<node>.port_open`, request/reply, JSON) to connect to a port of that sandbox's own
network namespace, naming the subject it receives the tunnel's frames on (an `_INBOX.` subject
of its own, subscribed before it asks, so no frame can arrive before it listens). The node
connects from inside the sandbox's namespace, and answers with the tunnel's id and the subject
the client sends to (`node.v1.<node>.tunnel.<id>`), or with `PortRefused` when nobody listens.
A probe (`probe: true`) only reads the namespace's listening sockets and connects nothing.

A tenant's inbox is its own account's, which the node's publishes (in the platform's account)
do not reach, so for a tenant's tunnel the node sends the frames to that inbox under
`tunnels.v1.<tenant>.` (`frames_subject`), which the platform exports to that tenant's account
alone; the tenant is the one the server vouched for on the request, never a field of it. The
tenant's frames to the node cross on `node.v1.<node>.tunnel.<id>`, imported like its other verbs.

Frames are binary, not JSON: a 17-byte header (kind, sequence number, value) and the bytes
of a data frame as they are; base64 in JSON would grow every byte by a third on the hot path.
Each direction numbers its frames from 1; a gap (the bus dropped one for a slow consumer)
resets the tunnel, since a TCP stream with a hole is worse than a closed one. Flow control is
by credit: a side sends at most `window` data bytes ahead of the CREDIT frames its peer
returns (a quarter window at a time) once the bytes are written to its socket, so neither end
buffers more than one window per tunnel, whatever the speed of the reader behind it. FIN
half-closes (the peer shuts its socket's writing side), RST aborts, PING keeps a quiet tunnel
alive: an end that hears nothing for `idle_s` resets it (a vanished client's tunnel is torn
down by the node).
"""

from __future__ import annotations

import enum
import struct
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.node import subject
from schemas.sandbox import SandboxId

PORT_OPEN = "port_open"
TUNNEL = "tunnel"  # node.v1.<node>.tunnel.<tunnel id>: frames a client sends to a tunnel's node end

# What a client may name as the subject it receives frames on: its own inbox, nothing else,
# so a tunnel can never be made to publish a sandbox's bytes onto a service's subject.
INBOX_PREFIX = "_INBOX."
ReplySubject = Annotated[str, Meta(pattern=r"^_INBOX\.[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$", max_length=200)]
Port = Annotated[int, Meta(ge=1, le=65535)]
TunnelId = Annotated[str, Meta(pattern=r"^[a-f0-9]{16,64}$")]


def tunnel_subject(node_id: str, tunnel_id: str) -> str:
    return f"{subject(node_id, TUNNEL)}.{tunnel_id}"


def frames_subject(tenant: str | None, reply_subject: str) -> str:
    """Where the node sends a tunnel's frames: the client's `reply_subject` as it named it, or for
    a tenant (None: a caller of the platform's account) that subject under the tenant's own prefix."""
    return reply_subject if tenant is None else f"tunnels.v1.{tenant}.{reply_subject}"


def tenant_frames_filter(tenant: str) -> str:
    """Every tunnel frame sent to one tenant: what its account imports."""
    return f"tunnels.v1.{tenant}.>"


def tunnel_wildcard(node_id: str) -> str:
    """What the node's launcher subscribes to once for every tunnel it holds."""
    return f"{subject(node_id, TUNNEL)}.*"


class PortOpenRequest(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="port_open"):
    sandbox_id: SandboxId
    port: Port
    # Where in the sandbox: its loopback (the default), or its own egress address. Nothing else
    # is reachable through a tunnel: not the host, not another sandbox.
    host: Literal["127.0.0.1", "::1", "localhost", "own"] = "127.0.0.1"
    reply_subject: ReplySubject  # the client's inbox for this tunnel's frames
    # Only tell whether something listens there (`PortListening` or `PortRefused`), opening and
    # connecting nothing: a listener that accepts one connection only is not spent by asking.
    probe: bool = False


class TunnelOpened(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="tunnel_opened"):
    tunnel_id: str
    send_subject: str  # where the client sends its frames (node.v1.<node>.tunnel.<id>)
    window: int  # bytes either side may send ahead of its peer's credit
    keepalive_s: float  # send a PING after this long without sending anything
    idle_s: float  # an end that hears nothing for this long resets the tunnel


class PortRefused(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="port_refused"):
    """Nobody listens on the port inside the sandbox (the connect was refused): nothing was opened."""

    port: int
    message: str


class PortListening(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="port_listening"):
    """The answer to a probe: something listens on the port inside the sandbox."""

    port: int


PortOpenReply = TunnelOpened | PortRefused | PortListening


class Frame(enum.IntEnum):
    DATA = 1  # value: 0; body: the bytes
    CREDIT = 2  # value: bytes the sender may send more
    FIN = 3  # no more data from the sender (half-close)
    RST = 4  # the tunnel is aborted; value: a `Reset` reason
    PING = 5  # nothing to send, still here


class Reset(enum.IntEnum):
    CLOSED = 0  # one end closed its socket without a half-close
    PROTOCOL = 1  # a frame out of sequence, undecodable, or past the credit
    IDLE = 2  # nothing heard for idle_s
    SANDBOX_ENDED = 3  # the sandbox was destroyed (or the node is stopping)


HEADER = struct.Struct("!BQQ")  # kind, sequence number, value
MAX_DATA = 64 * 1024  # bytes in one data frame (well under the bus's 1 MiB payload)


class BadFrame(ValueError):
    pass


def frame(kind: Frame, seq: int, value: int = 0, body: bytes = b"") -> bytes:
    return HEADER.pack(kind, seq, value) + body if body else HEADER.pack(kind, seq, value)


def parse(data: bytes) -> tuple[Frame, int, int, bytes]:
    """(kind, seq, value, body) of a frame; BadFrame for anything else."""
    if len(data) < HEADER.size or len(data) > HEADER.size + MAX_DATA:
        raise BadFrame(f"a frame of {len(data)} bytes")
    kind, seq, value = HEADER.unpack_from(data)
    try:
        kind = Frame(kind)
    except ValueError:
        raise BadFrame(f"unknown frame kind {kind}") from None
    body = data[HEADER.size:]
    if body and kind is not Frame.DATA:
        raise BadFrame(f"a {kind.name} frame with a body")
    return kind, seq, value, body
