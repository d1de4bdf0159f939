"""The spawner's request protocol (linuxnode/process/protocol.py): each request survives its
wire form, the form is a tagged and versioned JSON object with the fds beside it in the order
the request names, and what is not a request of this version is refused with a typed error,
by the codec and by a real spawner, which says so on the request's report pipe and serves on.
"""

from __future__ import annotations

import json
import os
import select

import pytest

from linuxnode.process import protocol, spawner
from linuxnode.process.protocol import (
    VERSION,
    ExecCommand,
    MalformedRequest,
    Ping,
    ProtocolError,
    Signal,
    StartInit,
    UnknownRequestType,
    UnsupportedVersion,
)
from linuxnode.process.reports import Report

CGROUPS = ("/sys/fs/cgroup/cpu/sandfleet/n/s/cgroup.procs", "/sys/fs/cgroup/memory/sandfleet/n/s/cgroup.procs")
EXAMPLES = [
    Ping(),
    Signal(pid=4242, signal=15),
    StartInit(cgroup_procs=CGROUPS, tmp_size_mb=256, workspace_size_mb=1024, hostname="sandbox", rootfs_dir=None,
              report=7, netns=8),
    StartInit(cgroup_procs=CGROUPS[:1], tmp_size_mb=1, workspace_size_mb=1, hostname="h-1",
              rootfs_dir="/var/lib/sandfleet/rootfs/s", report=9, netns=3),
    ExecCommand(cgroup_procs=CGROUPS, cwd="/workspace", argv=("sh", "-c", "echo \"ü\" '\\n'", "\udcff"),
                env={"PATH": "/usr/bin", "EMPTY": "", "LANG": "C.UTF-8"},
                report=10, pidfd=11, root=12, stdin=13, stdout=14, stderr=15),
]


def _body(request) -> dict:
    return json.loads(protocol.encode(request)[0])


def _datagram(body: dict) -> bytes:
    return json.dumps(body).encode()


@pytest.mark.parametrize("request_", EXAMPLES, ids=lambda r: type(r).__name__)
def test_each_request_survives_its_wire_form(request_):
    data, fds = protocol.encode(request_)
    assert protocol.decode(data, fds) == request_


@pytest.mark.parametrize("request_", EXAMPLES, ids=lambda r: type(r).__name__)
def test_the_wire_form_is_a_tagged_versioned_object_of_the_data_fields(request_):
    body = _body(request_)
    assert body.pop("v") == VERSION
    assert body.pop("type") == request_.TYPE
    assert set(body) == set(request_.DATA)  # no fd numbers: they mean nothing to the other process
    assert not set(request_.DATA) & set(request_.FDS)


def test_fds_go_in_the_order_the_request_names_them():
    exec_ = EXAMPLES[-1]
    assert ExecCommand.FDS == ("report", "pidfd", "root", "stdin", "stdout", "stderr")
    assert protocol.encode(exec_)[1] == [10, 11, 12, 13, 14, 15]
    assert StartInit.FDS == ("report", "netns")
    assert protocol.encode(EXAMPLES[2])[1] == [7, 8]
    assert Ping.FDS == Signal.FDS == ()
    assert protocol.decode(*protocol.encode(exec_)).stderr == 15


def test_every_request_with_fds_has_its_report_pipe_first():
    """A spawner that cannot read a request reports on its first fd."""
    for cls in (Ping, Signal, StartInit, ExecCommand):
        assert not cls.FDS or cls.FDS[0] == "report", cls


@pytest.mark.parametrize("version", [VERSION + 1, 0, "1", None, True, 1.0])
def test_another_version_is_refused(version):
    body = _body(EXAMPLES[1]) | {"v": version}
    with pytest.raises(UnsupportedVersion, match="version"):
        protocol.decode(_datagram(body), [])


def test_a_request_without_a_version_is_refused():
    body = _body(EXAMPLES[1])
    del body["v"]
    with pytest.raises(UnsupportedVersion):
        protocol.decode(_datagram(body), [])


@pytest.mark.parametrize("tag", ["kill", "", None, 3, "Ping"])
def test_an_unknown_type_is_refused(tag):
    body = _body(EXAMPLES[1]) | {"type": tag}
    with pytest.raises(UnknownRequestType, match="unknown request type"):
        protocol.decode(_datagram(body), [])


@pytest.mark.parametrize("request_", EXAMPLES[1:], ids=lambda r: type(r).__name__)
def test_a_request_missing_a_field_is_refused(request_):
    data, fds = protocol.encode(request_)
    for name in request_.DATA:
        body = json.loads(data)
        del body[name]
        with pytest.raises(MalformedRequest, match=f"field '{name}' missing"):
            protocol.decode(_datagram(body), fds)


def test_an_unknown_field_is_refused():
    with pytest.raises(MalformedRequest, match="unknown field.*'sig'"):
        protocol.decode(_datagram(_body(EXAMPLES[1]) | {"sig": 9}), [])


@pytest.mark.parametrize("request_, field, value", [
    (EXAMPLES[1], "pid", "4242"),
    (EXAMPLES[1], "pid", True),  # a JSON boolean is no int here
    (EXAMPLES[1], "signal", 15.0),
    (EXAMPLES[2], "hostname", None),
    (EXAMPLES[2], "rootfs_dir", 0),
    (EXAMPLES[2], "cgroup_procs", "/sys/fs/cgroup/cpu/cgroup.procs"),
    (EXAMPLES[4], "argv", ["sh", 1]),
    (EXAMPLES[4], "env", {"A": 1}),
    (EXAMPLES[4], "env", [["A", "b"]]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_field_of_the_wrong_type_is_refused(request_, field, value):
    data, fds = protocol.encode(request_)
    with pytest.raises(MalformedRequest, match=f"field '{field}' has the wrong type"):
        protocol.decode(_datagram(json.loads(data) | {field: value}), fds)


@pytest.mark.parametrize("request_", EXAMPLES, ids=lambda r: type(r).__name__)
def test_fds_are_counted(request_):
    data, fds = protocol.encode(request_)
    with pytest.raises(MalformedRequest, match=f"{len(fds) + 1} fds, expected {len(fds)}"):
        protocol.decode(data, [*fds, 99])
    if fds:
        with pytest.raises(MalformedRequest, match=f"{len(fds) - 1} fds, expected {len(fds)}"):
            protocol.decode(data, fds[:-1])


@pytest.mark.parametrize("data", [b"", b"not json", b"\xff\xfe", b"[1, 2]", b'"ping"', b"null"])
def test_what_is_not_a_json_object_is_refused(data):
    with pytest.raises(MalformedRequest):
        protocol.decode(data, [])


def test_every_refusal_is_a_protocol_error_and_a_value_error():
    for cls in (UnsupportedVersion, UnknownRequestType, MalformedRequest):
        assert issubclass(cls, ProtocolError) and issubclass(cls, ValueError)


def test_a_request_class_may_declare_only_wire_types():
    from dataclasses import dataclass

    with pytest.raises(TypeError, match="no wire type"):
        @protocol._request("odd")
        @dataclass(frozen=True, kw_only=True)
        class Odd(protocol._Wire):
            when: float

    with pytest.raises(TypeError, match="no wire type"):
        @protocol._request("odd")
        @dataclass(frozen=True, kw_only=True)
        class OddFd(protocol._Wire):
            report: str = protocol._fd()

    assert "odd" not in protocol._KINDS


# -- a real spawner ---------------------------------------------------------------------------------

def _report_of(helper: spawner.Spawner, data: bytes) -> Report:
    """Send `data` with a fresh report pipe and read what comes back on it until the spawner
    closes its copy."""
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    try:
        try:
            helper.send_datagram(data, [report_w])
        finally:
            os.close(report_w)
        got = b""
        while select.select([report_r], [], [], 30)[0] and (chunk := os.read(report_r, 65536)):
            got += chunk
        return Report.parse(got)
    finally:
        os.close(report_r)


@pytest.fixture
def helper():
    helper = spawner.Spawner()
    yield helper
    helper.stop()


def test_the_spawner_reports_a_refused_request_on_its_report_pipe_and_serves_on(helper):
    start = _body(EXAMPLES[2])
    newer = _report_of(helper, _datagram(start | {"v": VERSION + 1}))
    assert newer.pid is None
    assert [m for _, m in newer.errors] == [f"spawner: UnsupportedVersion: request version {VERSION + 1}, "
                                           f"this spawner speaks {VERSION}"]
    unknown = _report_of(helper, _datagram(start | {"type": "fork"}))
    assert "UnknownRequestType: unknown request type 'fork'" in unknown.errors[0][1]
    short = _report_of(helper, protocol.encode(EXAMPLES[2])[0])  # one fd (the report) of two
    assert "MalformedRequest: start request: 1 fds, expected 2 (report, netns)" in short.errors[0][1]
    assert helper.proc.poll() is None  # one spawner served all three


def test_a_request_too_large_for_a_datagram_is_refused_on_its_own_report_pipe(helper):
    """Past 32 kB the request travels in a memfd ahead of its fds; the report is still the
    request's first fd, not the memfd."""
    body = _body(EXAMPLES[4]) | {"type": "exec", "padding": "x" * (64 << 10)}
    report = _report_of(helper, _datagram(body))
    assert "MalformedRequest: exec request: unknown field(s) 'padding'" in report.errors[0][1]
