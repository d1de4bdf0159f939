"""Dockerfile builds that install packages, through the real platform: each RUN in a build
sandbox (SandboxSpec.build) whose system directories are writable and whose root keeps a
package manager's capabilities inside its user namespace; `dpkg -i` and `apt-get install` of a
local .deb this test makes (no network), writes to /usr/local and /etc, USER and COPY --chown
applied; the image built imported and read by an ordinary sandbox; the flag refused to a tenant.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import sandfleet
from linuxnode import landlock
from sandfleet import dockerfile, dockerfile_build, errors
from sandfleet.layers_client import Layers
from schemas.sandbox import SandboxSpec
from services.launcher import decisions
from tests.kernel import require
from tests.security.test_user_namespaces import _bind_into  # a host file bound into a sandbox on purpose

pytestmark = pytest.mark.timeout(900)  # the module's Debian root is built first (debootstrap)

# What a build sandbox's root holds in /proc/self/status: CAP_CHOWN, DAC_OVERRIDE, FOWNER, FSETID,
# KILL, SETGID, SETUID (linuxnode.process.children.BUILD_CAPABILITIES), and no other.
BUILD_CAP_MASK = (1 << 0) | (1 << 1) | (1 << 3) | (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7)
OWNER = 1234  # the id the test package gives its own files, which only CAP_CHOWN can set


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


@pytest.fixture(scope="module")
async def debian(fleet):
    require(os.geteuid() == 0, "sandboxes need root")
    require(shutil.which("debootstrap") is not None, "debootstrap")
    name = _name("dkr-debian")
    started = time.monotonic()
    built = await Layers(fleet.bus).build_debian(name, [])
    print(f"\ndockerfile: Debian minbase {name}: {built.layer.size / 2**20:.0f} MiB, "
          f"{time.monotonic() - started:.0f} s")
    yield name
    await Layers(fleet.bus).remove(name)


def make_deb(directory: Path, package: str) -> Path:
    """A .deb (dpkg-deb, no network) with a file owned by OWNER, a setgid directory and a
    postinst that writes /etc: what only a root with chown, fowner and fsetid installs as said."""
    tree = directory / package
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(
        f"Package: {package}\nVersion: 1.0\nArchitecture: all\nMaintainer: sandfleet tests <t@example.invalid>\n"
        "Description: a package the Dockerfile test installs\n")
    postinst = tree / "DEBIAN" / "postinst"
    postinst.write_text(f"#!/bin/sh\nset -e\necho configured > /etc/{package}.conf\n")
    postinst.chmod(0o755)
    share = tree / "usr" / "share" / package
    share.mkdir(parents=True)
    (share / "owned").write_text("owned by someone else\n")
    os.chown(share / "owned", OWNER, OWNER)
    (tree / "var" / "lib" / package).mkdir(parents=True)
    os.chown(tree / "var" / "lib" / package, OWNER, OWNER)
    os.chmod(tree / "var" / "lib" / package, 0o2775)
    out = directory / f"{package}.deb"
    subprocess.run(["dpkg-deb", "--build", "-Zgzip", str(tree), str(out)], check=True, capture_output=True)
    return out


# -- the build sandbox itself ------------------------------------------------------------


@pytest.mark.parametrize("isolation", ["process", "container"])
async def test_a_build_sandbox_writes_system_dirs_as_root_of_its_user_namespace_only(fleet, debian, isolation):
    build = await fleet.create(isolation=isolation, layers=[debian], build=True)
    plain = await fleet.create(isolation=isolation, layers=[debian])
    try:
        script = ("echo built > /usr/local/bin/made && echo x > /etc/made.conf && mkdir /topdir && "
                  f"chown {OWNER}:{OWNER} /etc/made.conf && stat -c %u /etc/made.conf && "
                  "grep CapEff /proc/self/status && cat /proc/self/uid_map")
        r = await build.exec(["sh", "-c", script])
        assert r.exit_code == 0, r
        owner, caps, uid_map = r.stdout.decode().splitlines()
        assert owner == str(OWNER)
        assert int(caps.split()[1], 16) == BUILD_CAP_MASK, "exactly the build capabilities, in the sandbox's namespace"
        inside, host, _ = uid_map.split()
        assert inside == "0" and int(host) >= 65536, "its root is an unprivileged host id"
        # An ordinary sandbox over the same layer: system content stays read-only, and its root has nothing.
        r = await plain.exec(["sh", "-c", "echo no > /usr/local/bin/made"])
        assert r.exit_code != 0 and b"ermission denied" in r.stderr, r
        r = await plain.exec(["sh", "-c", "grep CapEff /proc/self/status"])
        assert int(r.stdout.split()[1], 16) == 0
    finally:
        await build.destroy()
        await plain.destroy()


@pytest.mark.parametrize("isolation", ["process", "container"])
async def test_a_build_roots_capabilities_do_not_reach_a_host_file_bound_in(fleet, debian, isolation, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("host secret\n")
    secret.chmod(0o600)  # the host root's alone; dac_override inside holds only over ids the namespace maps
    build = await fleet.create(isolation=isolation, layers=[debian], build=True)
    try:
        _bind_into((await build.info()).init_pid, secret, "/tmp/secret")
        r = await build.exec(["sh", "-c", "stat -c %u /tmp/secret; cat /tmp/secret; chown 0:0 /tmp/secret; "
                                          "chmod 644 /tmp/secret; cat /tmp/secret"])
        assert r.stdout.decode().splitlines() == ["65534"], r  # unmapped: nobody, and nothing else printed
        assert r.stderr.count(b"ermitted") + r.stderr.count(b"ermission denied") == 4, r
        assert os.stat(secret).st_mode & 0o777 == 0o600 and os.stat(secret).st_uid == 0
    finally:
        await build.destroy()


async def test_the_build_flag_is_refused_to_a_tenant_and_kept_off_what_cannot_hold_it(platform, fleet, debian,
                                                                                    tmp_path):
    creds = tmp_path / "builder-tenant.creds"
    platform.cli("tenant", "add", "dkrtenant", "--data-dir", str(platform.data_dir), "--out", str(creds))
    async with sandfleet.connect(platform.url, creds=creds) as tenant:
        with pytest.raises(errors.Forbidden, match="build sandbox"):
            await tenant.create(isolation="container", layers=[debian], build=True)
        mine = await tenant.create(isolation="container", layers=[debian])  # an ordinary one, as before
        try:
            r = await mine.exec(["sh", "-c", "echo no > /etc/made.conf"])
            assert r.exit_code != 0
        finally:
            await mine.destroy()
    assert not [r for r in await fleet.list() if r.spec.build], "refused before anything was stored"
    with pytest.raises(errors.InvalidRequest, match="host_view"):
        await fleet.create(host_view=True, build=True)


def test_who_may_launch_a_build_sandbox():
    build = SandboxSpec(isolation="container", layers=["l"], build=True)
    assert decisions.build_refusal(build, "") is None  # the platform's own account
    assert decisions.build_refusal(SandboxSpec(layers=["l"]), "alice") is None  # no flag: nothing to check
    refused = decisions.build_refusal(build, "alice")
    assert refused is not None and refused.code.value == "invalid_request"
    refused = decisions.build_refusal(SandboxSpec(isolation="microvm", layers=["l"], build=True), "")
    assert refused is not None and refused.code.value == "unsupported"


def test_a_build_root_is_writable_under_landlock_in_full(tmp_path):
    for name in ("usr", "etc", "workspace", "dev"):
        (tmp_path / name).mkdir()
    plain = dict(landlock.sandbox_rules(str(tmp_path)))
    assert plain[str(tmp_path)] == landlock.READ and str(tmp_path / "usr") not in plain
    build = dict(landlock.sandbox_rules(str(tmp_path), writable_system=True))
    assert build[str(tmp_path)] == landlock.READ | landlock.WRITE
    assert build[str(tmp_path / "dev")] == landlock.DEVICES


# -- a Dockerfile that installs packages ----------------------------------------------------


async def test_a_dockerfile_installs_packages_writes_system_dirs_and_applies_user_and_chown(
        fleet, platform, debian, tmp_path):
    context = tmp_path / "ctx"
    context.mkdir()
    make_deb(context, "sfprobe-dpkg")
    make_deb(context, "sfprobe-apt")
    (context / "app.txt").write_text("the app's\n")
    (context / "Dockerfile").write_text(f"""\
FROM {debian}
ARG GREETING=hello
ENV GREETING=${{GREETING}}
COPY sfprobe-dpkg.deb sfprobe-apt.deb /opt/debs/
RUN mkdir -p /usr/local/share/dkr && echo "$GREETING" > /usr/local/share/dkr/file && echo etc > /etc/dkr.conf
RUN dpkg -i /opt/debs/sfprobe-dpkg.deb
RUN apt-get install -y --no-install-recommends /opt/debs/sfprobe-apt.deb && rm -r /opt/debs
RUN useradd --uid 1500 --create-home app
EXPOSE 8080
USER app
WORKDIR /home/app
COPY --chown=app:app --chmod=0640 app.txt ./app.txt
RUN id -u > uid && cat app.txt > copy
SHELL ["/bin/bash", "-c"]
CMD echo "$GREETING from $(id -un) in bash ${{BASH_VERSION%%.*}}"
""")
    built = _name("dkr-built")
    out = platform.cli("layer", "build", built, "--dockerfile", str(context / "Dockerfile"), "--context",
                       str(context), timeout=600, check=False)
    try:
        assert out.returncode == 0, out.stderr.decode()
        layer = await Layers(fleet.bus).get(built)
        config = layer.config
        assert config is not None and config.user == "app" and config.working_dir == "/home/app"
        assert config.cmd[:2] == ["/bin/bash", "-c"], "SHELL is the shell form's shell"
        assert any(n.startswith("EXPOSE: 8080") for n in config.not_applied), "listed, as an import lists"
        for isolation in ("process", "container"):
            sb = await fleet.create(isolation=isolation, layers=[built])  # an ordinary sandbox over the result
            try:
                script = ("cat /usr/local/share/dkr/file /etc/dkr.conf /etc/sfprobe-dpkg.conf /etc/sfprobe-apt.conf; "
                          "dpkg-query -W -f='${Package} ${Status}\\n' sfprobe-dpkg sfprobe-apt; "
                          "stat -c '%u:%g %a' /usr/share/sfprobe-apt/owned /var/lib/sfprobe-dpkg; "
                          "cat /home/app/uid /home/app/copy; stat -c '%U:%G %a' /home/app/app.txt; id -u")
                r = await sb.exec(["sh", "-c", script])
                assert r.exit_code == 0, r
                assert r.stdout.decode().splitlines() == [
                    "hello", "etc", "configured", "configured",
                    "sfprobe-apt install ok installed", "sfprobe-dpkg install ok installed",
                    f"{OWNER}:{OWNER} 644", f"{OWNER}:{OWNER} 2775",
                    "1500", "the app's", "app:app 640", "1500",  # the image's User runs it
                ], (isolation, r, out.stderr.decode())
                r = await sb.exec(image_command=True)
                assert r.stdout.startswith(b"hello from app in bash ") and r.stdout != b"hello from app in bash \n", r
            finally:
                await sb.destroy()
    finally:
        platform.cli("layer", "rm", built, check=False)


# -- the plan: what is applied, what is listed ---------------------------------------------


def test_the_plan_applies_user_shell_and_copy_flags_and_lists_the_rest(tmp_path):
    (tmp_path / "f").write_text("x")
    text = ("FROM base\nVOLUME /data\nSTOPSIGNAL SIGINT\nHEALTHCHECK CMD true\nRUN a\nUSER 1000:1000\n"
            "SHELL [\"/bin/bash\", \"-euc\"]\nRUN b\nCOPY --chown=app --chmod=755 --link f /x\nUSER root\nRUN c\n")
    planned = dockerfile.plan(dockerfile.parse(text), tmp_path)
    runs = [s for s in planned.steps if isinstance(s, dockerfile.Run)]
    assert [(r.argv, r.user) for r in runs] == [(["/bin/sh", "-c", "a"], ""), (["/bin/bash", "-euc", "b"], "1000:1000"),
                                                (["/bin/bash", "-euc", "c"], "")]
    [copy] = [s for s in planned.steps if isinstance(s, dockerfile.Copy)]
    assert (copy.chown, copy.chmod, copy.dest) == ("app", "755", "/x")
    assert [n.split(":")[0] for n in planned.config.not_applied] == ["VOLUME", "STOPSIGNAL", "HEALTHCHECK"]
    assert planned.config.user == "root"
    assert [len(g) for g in dockerfile_build.groups(planned.steps)] == [1, 1, 2]
    # A COPY --chown runs its chown as root: not in the sandbox of a RUN as another user.
    planned = dockerfile.plan(dockerfile.parse("FROM base\nUSER app\nCOPY --chown=app f /y\nRUN d\n"), tmp_path)
    assert [[type(s).__name__ for s in g] for g in dockerfile_build.groups(planned.steps)] == [["Copy"], ["Run"]]


@pytest.mark.parametrize("text, what", [
    ("FROM a\nCOPY --chown=a;b f /x\n", "--chown=a;b"),
    ("FROM a\nCOPY --chmod=u+x f /x\n", "--chmod=u\\+x"),
    ("FROM a\nSHELL /bin/bash\n", "SHELL takes a JSON list"),
    ("FROM a\nFROB x\n", "FROB is not supported"),
])
def test_flags_and_instructions_it_cannot_take_are_refused(tmp_path, text, what):
    (tmp_path / "f").write_text("x")
    with pytest.raises(dockerfile.DockerfileError, match=f"line 2: .*{what}"):
        dockerfile.plan(dockerfile.parse(text), tmp_path)
