"""Log lines carry the canonical keys spans use (sandbox.id, node.id), so one grep finds a sandbox."""

from __future__ import annotations

import logging

from sandfleet import telemetry
from sandfleet.runner import CanonicalFormatter


def _line(formatter: logging.Formatter, **extra: str) -> str:
    record = logging.LogRecord("sandfleet.test", logging.INFO, __file__, 1, "launched %s", ("sb-1",), None)
    for key, value in extra.items():
        setattr(record, key, value)
    return formatter.format(record)


def test_a_line_about_a_sandbox_ends_with_its_canonical_key():
    line = _line(CanonicalFormatter("launcher"), **{telemetry.SANDBOX_ID: "sb-1"})
    assert line.endswith("logger=sandfleet.test launched sb-1 sandbox.id=sb-1")
    assert " service=launcher level=INFO " in line


def test_a_node_service_names_its_node_on_every_line_unless_the_line_names_another():
    node_service = CanonicalFormatter("reclaimer", node_id="n-1")
    assert _line(node_service).endswith("launched sb-1 node.id=n-1")
    assert _line(node_service, **{telemetry.SANDBOX_ID: "sb-1"}).endswith("sandbox.id=sb-1 node.id=n-1")
    assert _line(node_service, **{telemetry.NODE_ID: "n-2"}).endswith("node.id=n-2")


def test_a_cluster_service_line_about_nothing_in_particular_has_no_keys():
    assert _line(CanonicalFormatter("placement")).endswith("launched sb-1")
