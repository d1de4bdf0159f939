"""Layer tools against the real platform: a pip layer built over a Python layer (real pip, real
PyPI or the node's configured index, a real overlay in a private mount namespace), and push /
pull between two stores (the platform's and a second real nats-server with JetStream).

The Python base is this host's own interpreter and standard library with the shared
libraries they load, taken with `--dir` (a Debian root with python3 takes minutes to build).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import nats
import pytest

import sandfleet
from sandfleet import errors
from sandfleet.bus_accounts import AuthDir, new_seed, write_accounts
from sandfleet.cli_layers import pip_arguments
from sandfleet.credentials import creds_text, remote_options
from sandfleet.layers_client import Layers
from sandfleet.config import free_port
from sandfleet.supervisor import nats_server_binary, write_nats_config
from sandfleet.tls import TlsDir
from schemas.layers import KV_BUCKET, OBJECT_BUCKET
from services.layer_cache.store import object_digest
from tests.conftest import NODE_ID, start_platform, stop_platform
from tests.kernel import require
from tests.layer_trees import BUSYBOX, make_busybox_base

STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "unittest",
               "config-3.11-x86_64-linux-gnu", "site-packages", "dist-packages"}


def _copy_with_real_dirs(tree: Path, path: str) -> None:
    """Copy the file `path` (following links) to where it really lives, under its own name."""
    dest = tree / os.path.realpath(os.path.dirname(path)).lstrip("/") / os.path.basename(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists():
        shutil.copy2(path, dest)


def _libraries(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        words = line.split()
        if "=>" in words and len(words) > words.index("=>") + 1 and words[words.index("=>") + 1].startswith("/"):
            found.append(words[words.index("=>") + 1])
        elif words and words[0].startswith("/"):
            found.append(words[0])  # the dynamic loader
    return found


def make_python_base(tree: Path) -> None:
    """This host's python3 with its standard library and every shared library they load."""
    python = os.path.realpath(sys._base_executable)
    stdlib = sysconfig.get_paths()["stdlib"]
    for name in ("lib", "lib64", "bin", "sbin"):  # merged /usr, as on the host
        if os.path.islink(f"/{name}"):
            os.symlink(os.readlink(f"/{name}"), tree / name)
    _copy_with_real_dirs(tree, python)
    os.symlink(os.path.basename(python), tree / "usr/bin/python3")
    shutil.copytree(stdlib, tree / stdlib.lstrip("/"), symlinks=True,
                    ignore=lambda d, names: [n for n in names if n in STDLIB_SKIP and d == stdlib])
    binaries = [python, *map(str, Path(stdlib, "lib-dynload").glob("*.so"))]
    for lib in {lib for binary in binaries for lib in _libraries(binary)}:
        _copy_with_real_dirs(tree, lib)
    for rel in ("tmp", "workspace", "etc"):
        (tree / rel).mkdir(exist_ok=True)


@pytest.fixture(scope="module")
async def layers(fleet, platform):
    require(os.geteuid() == 0, "mounting needs root")
    return Layers(fleet.bus)


@pytest.fixture(scope="module")
async def python_base(layers, tmp_path_factory):
    tree = tmp_path_factory.mktemp("python-base")
    make_python_base(tree)
    return (await layers.build_dir("lt-python", tree)).layer


async def _python(fleet, layer_names: list[str], code: str) -> str:
    sb = await fleet.create(memory_mb=256, layers=layer_names)
    try:
        r = await sb.exec(["python3", "-c", code], timeout_s=60)
        assert r.exit_code == 0, r.stderr.decode(errors="replace")
        return r.stdout.decode().strip()
    finally:
        await sb.destroy()


async def test_a_pip_layer_holds_only_what_pip_installed_and_imports_in_a_sandbox(fleet, layers, python_base):
    reply = await layers.build_pip("lt-pyenv", "lt-python", ["six==1.17.0"])
    env = reply.layer
    assert (env.parent, env.parent_digest) == ("lt-python", python_base.digest)
    # the upper dir alone: six's module, its record and pyc, never the standard library
    assert env.content_bytes < 200_000 and env.files < 40, (env.files, env.content_bytes)
    where = await _python(fleet, ["lt-python", "lt-pyenv"], "import six, sys; print(six.__version__, six.__file__)")
    version, path = where.split()
    assert version == "1.17.0" and path.startswith("/usr/local/lib/python3")
    # the base layer alone has no six
    missing = await _python(fleet, ["lt-python"], "import importlib.util as u; print(u.find_spec('six') is None)")
    assert missing == "True"


async def test_rebuilding_the_pip_layer_rebuilds_neither_the_layer_under_nor_the_one_over_it(
    fleet, layers, python_base, tmp_path
):
    await layers.build_pip("lt-pyenv2", "lt-python", ["six==1.17.0"])
    task = tmp_path / "task"
    (task / "workspace").mkdir(parents=True)
    (task / "workspace" / "main.py").write_text("import six\nprint('task on six', six.__version__)\n")
    await layers.build_dir("lt-pytask", task, on="lt-pyenv2")
    before = {n: (await layers.get(n)).digest for n in ("lt-python", "lt-pyenv2", "lt-pytask")}

    requirements = tmp_path / "requirements.txt"
    requirements.write_text("six==1.16.0\n")
    text, packages = pip_arguments([str(requirements)])
    assert (text.strip(), packages) == ("six==1.16.0", [])
    rebuilt = (await layers.build_pip("lt-pyenv2", "lt-python", packages, requirements=text)).layer
    after = {n: (await layers.get(n)).digest for n in ("lt-python", "lt-pyenv2", "lt-pytask")}
    assert after["lt-python"] == before["lt-python"] == python_base.digest
    assert after["lt-pytask"] == before["lt-pytask"]
    assert after["lt-pyenv2"] == rebuilt.digest != before["lt-pyenv2"]
    out = await _python(fleet, ["lt-python", "lt-pyenv2", "lt-pytask"], "exec(open('/workspace/main.py').read())")
    assert out == "task on six 1.16.0"


async def test_a_pip_layer_needs_a_python_under_it_and_something_to_install(layers, tmp_path, platform):
    bare = tmp_path / "bare"
    (bare / "etc").mkdir(parents=True)
    (bare / "etc" / "motd").write_text("no python here\n")
    await layers.build_dir("lt-nopython", bare)
    with pytest.raises(errors.InvalidRequest, match="python3"):
        await layers.build_pip("lt-broken", "lt-nopython", ["six"])
    with pytest.raises(errors.InvalidRequest, match="requirements or packages"):
        await layers.build_pip("lt-broken", "lt-nopython", [])
    with pytest.raises(errors.InvalidRequest):
        await layers.build_pip("lt-broken", "lt-nopython", ["--index-url=http://elsewhere"])
    assert await layers.list("lt-broken") == []
    builds = platform.data_dir / "layer-cache" / "build"
    assert not builds.exists() or not any(builds.iterdir())  # the build dir is emptied after a failure


# -- push / pull ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_store(tmp_path_factory):
    """A second, bare nats-server with JetStream: another cluster's store."""
    data = tmp_path_factory.mktemp("other-store")
    port = free_port()
    proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(data)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"nats://127.0.0.1:{port}"
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def _remote(url: str):
    nc = await nats.connect(url)
    js = nc.jetstream()
    return nc, await js.key_value(KV_BUCKET), await js.object_store(OBJECT_BUCKET)


@pytest.fixture(scope="module")
async def chain(layers, tmp_path_factory):
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")
    src = tmp_path_factory.mktemp("tx-src")
    make_busybox_base(src / "base", hostname="tx")
    (src / "top" / "workspace").mkdir(parents=True)
    (src / "top" / "workspace" / "hello.txt").write_text("carried over\n")
    base = (await layers.build_dir("tx-base", src / "base")).layer
    top = (await layers.build_dir("tx-top", src / "top", on="tx-base")).layer
    return base, top


async def test_push_copies_a_layer_and_the_images_under_it_to_another_store(layers, chain, other_store, platform):
    base, top = chain
    out = platform.cli("layer", "push", "tx-top", "--to", other_store, "--json", timeout=300)
    reply = json.loads(out.stdout)
    assert reply["copied"] == [base.digest, top.digest] and reply["present"] == []
    assert reply["bytes"] == base.size + top.size
    nc, kv, objects = await _remote(other_store)
    try:
        for layer in (base, top):
            info = await objects.get_info(layer.digest)
            assert (info.size, info.digest) == (layer.size, object_digest(layer.digest))
        assert b'"digest":"' + top.digest.encode() in (await kv.get("tx-top")).value
        assert b'"digest":"' + base.digest.encode() in (await kv.get("tx-base")).value
    finally:
        await nc.close()
    again = await layers.push("tx-top", other_store)
    assert again.copied == [] and again.present == [base.digest, top.digest] and again.bytes == 0


async def test_pull_brings_a_layer_back_and_a_sandbox_runs_on_it(fleet, layers, chain, other_store):
    base, top = chain
    await layers.push("tx-top", other_store)
    removed = await layers.remove("tx-top")
    await layers.remove("tx-base")
    assert top.digest in removed.deleted_images
    with pytest.raises(errors.NotFound):
        await layers.get("tx-top")
    reply = await layers.pull("tx-top", other_store)
    assert reply.copied == [base.digest, top.digest]
    assert (await layers.get("tx-top")).digest == top.digest and (await layers.get("tx-base")).digest == base.digest
    sb = await fleet.create(memory_mb=64, layers=["tx-base", "tx-top"])
    try:
        r = await sb.exec(["cat", "/workspace/hello.txt", "/etc/hostname"])
        assert r.stdout == b"carried over\ntx\n"
    finally:
        await sb.destroy()


async def test_pull_refuses_an_image_whose_bytes_do_not_match_its_digest(layers, chain, other_store):
    base, top = chain
    nc, kv, objects = await _remote(other_store)
    forged = "sha256:" + "ab" * 32
    try:
        await objects.put(forged, b"not the image that digest names")
        record = (await kv.get("tx-top")).value.replace(top.digest.encode(), forged.encode())
        await kv.put("tx-forged", record.replace(b'"name":"tx-top"', b'"name":"tx-forged"'))
    finally:
        await nc.close()
    with pytest.raises(errors.InternalError, match="another digest"):
        await layers.pull("tx-forged", other_store)
    with pytest.raises(errors.NotFound):
        await layers.get("tx-forged")


async def test_push_to_an_unreachable_store_fails_cleanly(layers, chain):
    with pytest.raises(errors.NotFound, match="cannot reach"):
        await layers.push("tx-top", f"nats://127.0.0.1:{free_port()}")
    with pytest.raises(errors.InvalidRequest):
        await layers.push("tx-top", "http://127.0.0.1:1")


@pytest.fixture(scope="module")
def signed_in_store(tmp_path_factory):
    """Another platform's bus as `up --tls` makes one: TLS only, accounts and nkey users (a node
    of its own among them), and nothing registered for this machine's clients, so a layer-cache
    has only what is filed for it."""
    data = tmp_path_factory.mktemp("signed-in-store")
    auth, tls = AuthDir.of(data), TlsDir.of(data).ensure(())
    auth.platform(["store-node"])
    write_accounts(data, auth)
    port = free_port()
    conf = write_nats_config(data, port, auth=auth, tls=tls)
    proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        yield f"tls://127.0.0.1:{port}", auth, tls
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def test_push_signs_in_to_another_platforms_bus_with_what_was_filed_for_it(layers, chain, signed_in_store,
                                                                                   platform, tmp_path):
    url, auth, tls = signed_in_store
    base, top = chain
    filed = ("--data-dir", str(platform.data_dir))
    try:
        with pytest.raises(errors.NotFound, match="certificate verify failed"):
            await layers.push("tx-top", url)  # nothing filed: its certificate is of a CA nobody here trusts
        stranger = tmp_path / "stranger.creds"
        stranger.write_text(creds_text(new_seed(), "a user that bus has never heard of"))
        platform.cli("remote", "add", url, "--creds", str(stranger), "--ca", str(tls.ca), *filed)
        with pytest.raises(errors.Forbidden, match="refused the credentials"):
            await layers.push("tx-top", url)
        platform.cli("remote", "add", url, "--creds", str(auth.node("store-node")), "--ca", str(tls.ca), *filed)
        assert platform.cli("remote", "list", *filed).stdout.decode().split() == [url.removeprefix("tls://"), "ca", "creds"]
        reply = await layers.push("tx-top", url)
        assert reply.copied == [base.digest, top.digest] and reply.bytes == base.size + top.size
        nc = await nats.connect(url, **remote_options(url, platform.data_dir))
        try:
            assert b'"digest":"' + top.digest.encode() in (await (await nc.jetstream().key_value(KV_BUCKET)).get("tx-top")).value
        finally:
            await nc.close()
        assert (await layers.pull("tx-top", url)).present == [base.digest, top.digest]
    finally:
        platform.cli("remote", "remove", url, *filed, check=False)
    assert not list((platform.data_dir / "remotes").glob("*"))


def test_remote_add_refuses_a_file_without_a_seed_and_a_ca_that_is_no_certificate(platform, tmp_path):
    junk = tmp_path / "junk"
    junk.write_text("not credentials")
    good = tmp_path / "good.creds"
    good.write_text(creds_text(new_seed(), "test"))
    for args in (["--creds", str(junk)], ["--creds", str(good), "--ca", str(junk)]):
        out = platform.cli("remote", "add", "nats://127.0.0.1:1", *args, "--data-dir", str(tmp_path), check=False)
        assert out.returncode == 2 and b"sandfleet remote add:" in out.stderr and b"Traceback" not in out.stderr
    assert not (tmp_path / "remotes").exists()


# -- default layers -------------------------------------------------------------------------


async def test_a_sandbox_without_layers_gets_the_default_layers_or_a_clear_refusal(fleet, tmp_path_factory):
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")
    with pytest.raises(errors.InvalidRequest, match="no layers given and no default layers"):
        await fleet.create(memory_mb=64)  # this platform has none configured
    node = f"{NODE_ID}-dl"
    other = start_platform(tmp_path_factory.mktemp("default-layers"), node, extra=("--default-layers", "dl-base,dl-top"))
    try:
        async with sandfleet.connect(other.url) as fleet2:
            layers = Layers(fleet2.bus)
            src = tmp_path_factory.mktemp("dl-src")
            make_busybox_base(src / "base", hostname="dl")
            (src / "top" / "workspace").mkdir(parents=True)
            (src / "top" / "workspace" / "task.txt").write_text("from the default top\n")
            base = (await layers.build_dir("dl-base", src / "base")).layer
            top = (await layers.build_dir("dl-top", src / "top", on="dl-base")).layer
            sb = await fleet2.create(memory_mb=64)
            host = await fleet2.create(memory_mb=64, host_view=True)
            try:
                r = await sb.exec(["cat", "/etc/hostname", "/workspace/task.txt"])
                assert r.stdout == b"dl\nfrom the default top\n"
                roots = {r.sandbox_id: r.layers for r in (await layers.cache(node)).rootfs}
                assert roots[sb.id] == [base.digest, top.digest] and host.id not in roots
                assert (await host.exec(["test", "-d", "/usr/lib"])).exit_code == 0  # the host's system
            finally:
                await asyncio.gather(sb.destroy(), host.destroy())
    finally:
        stop_platform(other)
