"""Parsers and protocol strings that must exist once: a second copy drifts from the first. Read as
text from every non-test module of ours (nothing runs); each rule names the one file allowed."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT

PACKAGES = ("sandfleet", "linuxnode", "schemas", "services", "agents", "loadtest")

# (what, pattern in source text, the only file that may hold it)
ONCE = [
    ("JetStream API / KV / Object Store subjects", r"""["'f]\$(JS|KV|O)\.""", "sandfleet/jetstream.py"),
    ("/proc/<pid>/stat parsing", r"""/proc/\{[a-z_]+\}/stat["']""", "linuxnode/procfs.py"),
    ("PSI files", r"/proc/pressure", "linuxnode/procfs.py"),
    ("cgroup freezing", r"""["'/]cgroup\.freeze["']""", "linuxnode/cgroups.py"),
    ("v1 memory charge", r"memory\.usage_in_bytes", "linuxnode/cgroups.py"),
]


def _sources() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[str(path.relative_to(ROOT))] = path.read_text()
    return found


@pytest.mark.parametrize(("what", "pattern", "owner"), ONCE, ids=[w for w, _, _ in ONCE])
def test_spelled_only_by_its_owner(what: str, pattern: str, owner: str):
    rx = re.compile(pattern)
    holders = sorted(path for path, text in _sources().items() if rx.search(text))
    assert holders == [owner], f"{what} must be spelled only in {owner}; found in {holders}"


def test_the_rules_see_what_they_guard():
    """Each rule matches its owner, and would match a copy elsewhere (so none passes vacuously)."""
    sources = _sources()
    copies = {"JetStream API / KV / Object Store subjects": 'nc.request(f"$JS.API.DIRECT.GET.{s}")',
              "/proc/<pid>/stat parsing": 'open(f"/proc/{pid}/stat")', "PSI files": 'open("/proc/pressure/cpu")',
              "cgroup freezing": 'open(f"{d}/cgroup.freeze", "w")', "v1 memory charge": '"memory.usage_in_bytes"'}
    for what, pattern, owner in ONCE:
        assert re.search(pattern, sources[owner]), f"{owner} no longer holds {what}: move the rule with it"
        assert re.search(pattern, copies[what]), what
