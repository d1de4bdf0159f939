"""The kernel audit subsystem over netlink (NETLINK_AUDIT), without auditd or auditctl: its
status, turning it on or off, its filter rules, and the read-only multicast copy of its
records (AUDIT_NLGRP_READLOG, which takes nothing from an audit daemon that runs).

Rules are what auditctl sends (`struct audit_rule_data`); a rule carries a key
(`-k`, AUDIT_FILTERKEY), which is how an owner finds its own rules again and leaves
everyone else's alone. Every call needs CAP_AUDIT_CONTROL (root).
"""

from __future__ import annotations

import os
import socket
import struct
import dataclasses
from dataclasses import dataclass

NETLINK_AUDIT = 9
AUDIT_GET, AUDIT_SET = 1000, 1001
AUDIT_ADD_RULE, AUDIT_DEL_RULE, AUDIT_LIST_RULES = 1011, 1012, 1013
AUDIT_STATUS_ENABLED = 1
AUDIT_NLGRP_READLOG = 1

# struct audit_rule_data
AUDIT_FILTER_TASK = 0x01  # decided once per task, when it is created: AUDIT_NEVER = no syscall context
AUDIT_NEVER, AUDIT_ALWAYS = 0, 2
AUDIT_LOGINUID, AUDIT_FILTERKEY = 9, 210
LESS_THAN, GREATER_THAN, EQUAL = 0x10000000, 0x20000000, 0x40000000
# The login uids sandfleet gives sandbox processes (linuxnode.landlock.audit_tag):
# never a real uid, never unset (-1).
TAG_MIN, TAG_MAX = 0x40000000, 0x7FFFFFFF
_MAX_FIELDS = 64
_BITMASK_WORDS = 64
_RULE = struct.Struct(f"=3I{_BITMASK_WORDS}I{_MAX_FIELDS}I{_MAX_FIELDS}I{_MAX_FIELDS}II")
# fields whose value is a string in buf (value = its length): subj_*/obj_* labels, watch, dir, exe, key
_STRING_FIELDS = {13, 14, 15, 16, 17, 19, 20, 21, 22, 23, 105, 107, 112, AUDIT_FILTERKEY}

_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_DUMP = 1, 4, 0x300
_HEADER = struct.Struct("=IHHII")
_STATUS = struct.Struct("=10I")  # struct audit_status up to backlog_wait_time


@dataclass(frozen=True)
class Status:
    enabled: int  # 0 off, 1 on, 2 on and locked
    daemon_pid: int  # the registered audit daemon (auditd), 0 when none


@dataclass(frozen=True)
class Rule:
    """One filter rule: conditions are (field, op, value), all of which must hold."""

    filter: int
    action: int
    conditions: tuple[tuple[int, int, int], ...] = ()
    key: str = ""
    raw: bytes = dataclasses.field(default=b"", repr=False, compare=False)  # as the kernel listed it

    def pack(self) -> bytes:
        if self.raw:
            return self.raw
        fields, values, flags = [], [], []
        for field, op, value in self.conditions:
            fields.append(field)
            values.append(value)
            flags.append(op)
        buf = self.key.encode()
        if buf:
            fields.append(AUDIT_FILTERKEY)
            values.append(len(buf))
            flags.append(EQUAL)
        pad = [0] * (_MAX_FIELDS - len(fields))
        return _RULE.pack(self.filter, self.action, len(fields), *([0] * _BITMASK_WORDS), *fields, *pad,
                          *values, *pad, *flags, *pad, len(buf)) + buf

    @classmethod
    def unpack(cls, data: bytes) -> Rule:
        words = _RULE.unpack_from(data)
        flt, action, count = words[:3]
        base = 3 + _BITMASK_WORDS
        fields = words[base:base + count]
        values = words[base + _MAX_FIELDS:base + _MAX_FIELDS + count]
        flags = words[base + 2 * _MAX_FIELDS:base + 2 * _MAX_FIELDS + count]
        buf = data[_RULE.size:]
        key, offset, conditions = "", 0, []
        for field, value, op in zip(fields, values, flags):
            if field in _STRING_FIELDS:
                if field == AUDIT_FILTERKEY:
                    key = buf[offset:offset + value].decode(errors="replace")
                offset += value
            else:
                conditions.append((field, op, value))
        return cls(flt, action, tuple(conditions), key, bytes(data[:_RULE.size + offset]))


def _request(kind: int, body: bytes = b"", dump: bool = False) -> list[bytes]:
    """Send one request; the bodies of its replies (several for a dump), after the ack."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT) as s:
        s.settimeout(2.0)
        s.bind((0, 0))
        flags = _NLM_F_REQUEST | _NLM_F_ACK | (_NLM_F_DUMP if dump else 0)
        s.send(_HEADER.pack(_HEADER.size + len(body), kind, flags, 1, 0) + body)
        replies: list[bytes] = []
        while True:
            data = s.recv(1 << 16)
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, rtype = _HEADER.unpack_from(data, offset)[:2]
                payload = data[offset + _HEADER.size:offset + length]
                offset += (length + 3) & ~3
                if rtype == _NLMSG_ERROR:
                    err = struct.unpack_from("=i", payload)[0]
                    if err:
                        raise OSError(-err, os.strerror(-err), f"audit netlink {kind}")
                    if not dump and kind != AUDIT_GET:
                        return replies  # a plain ack
                elif rtype == _NLMSG_DONE:
                    return replies
                elif rtype == kind:
                    replies.append(payload)
                    if kind == AUDIT_GET:
                        return replies


def status() -> Status:
    words = _STATUS.unpack_from(_request(AUDIT_GET)[0].ljust(_STATUS.size, b"\0"))
    return Status(enabled=words[1], daemon_pid=words[3])


def set_enabled(enabled: int) -> None:
    _request(AUDIT_SET, _STATUS.pack(AUDIT_STATUS_ENABLED, enabled, 0, 0, 0, 0, 0, 0, 0, 0))


def rules() -> list[Rule]:
    return [Rule.unpack(body) for body in _request(AUDIT_LIST_RULES, dump=True)]


def add_rule(rule: Rule) -> None:
    """Append a rule to its filter list (EEXIST: the same rule, key included, is there)."""
    _request(AUDIT_ADD_RULE, rule.pack())


def delete_rule(rule: Rule) -> None:
    """Remove the rule that matches this one exactly (ENOENT: there is none)."""
    _request(AUDIT_DEL_RULE, rule.pack())


def readlog_socket() -> socket.socket:
    """A non-blocking socket joined to the read-only multicast group of audit records."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                         NETLINK_AUDIT)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.bind((0, 1 << (AUDIT_NLGRP_READLOG - 1)))
    except OSError:
        sock.close()
        raise
    return sock


HEADER = _HEADER  # a netlink message header, for readers of the multicast socket
