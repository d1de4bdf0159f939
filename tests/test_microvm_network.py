"""A `microvm` with allow rules, against a platform of its own and a fake internet beside the node
(a namespace this module makes): the guest's user-mode NIC turns its packets into QEMU's own
sockets in the sandbox's namespace and cgroup, so the red-team attempts of the container tests
(tests/security/test_egress_platform.py) meet the same BPF allowlist, DNS stub and violation
events. Nothing leaves the machine: the only hosts are this module's namespace and the node.

The guest sees errors as a guest does (slirp answers a refused connect with a reset or an ICMP
error, never EPERM), so the tests check that the attempt failed and that the node reported it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil

import pytest

import sandfleet
from sandfleet.layers_client import Layers
from linuxnode import veth
from linuxnode.vm.guest_image import GuestImage, default_dir
from tests.conftest import NODE_ID, own_platform
from tests.kernel import require
from tests.layer_trees import APPLETS, make_busybox_base
from tests.leaks import microvm_left
from tests.security.netlab import NodeInternet
from tests.security.test_egress_platform import Watch
from tests.vm_shapes import create_vm

pytestmark = pytest.mark.kernel

NODE = f"{NODE_ID}-vmnet"
LAYER = "vmnet-base"
MEMORY_MB = 512
# This module's own addresses (the container egress tests use 10.77.0.0/24 and 10.77.100.0/24).
LINK_HOST, LINK_PEER, INTERNET_NET = "10.77.234.1", "10.77.234.2", "10.77.235.0/24"
UPSTREAM = ("10.77.235.53", 53)
ZONE = {"allowed.test": {"A": ["10.77.235.1"]}, "evil.test": {"A": ["10.77.235.2"]}}
INTERNET = {
    "http": [("10.77.235.1", 80), ("10.77.235.2", 80), ("10.77.235.4", 443)],
    "udp": [("10.77.235.1", 5353)],
    "dns": [UPSTREAM],
    "zone": ZONE,
}
ALLOW = ["allowed.test:80", "10.77.235.4:443"]


def _subnet() -> str:
    """The upper half of this test identity's egress subnet: the session platform holds the
    lower one (its /30s are numbered from the bottom), so the two never share an address."""
    mine = ipaddress.IPv4Network(os.environ.get("SANDFLEET_EGRESS_SUBNET") or "10.200.0.0/16")
    return str(list(mine.subnets())[1])


@pytest.fixture(scope="module")
def vm_platform(tmp_path_factory):
    require(os.geteuid() == 0, "microVMs need root")
    require(shutil.which("qemu-system-x86_64") is not None, "qemu-system-x86 is installed")
    require(shutil.which("nft") is not None, "nft is installed (Debian nftables)")
    require(isinstance(GuestImage.find(default_dir()), GuestImage), "a built guest (make install)")
    internet = NodeInternet(INTERNET, link=f"sfv{os.getpid() % 100000}", owner=f"vmnlab{os.getpid()}",
                            link_host=LINK_HOST, link_peer=LINK_PEER, internet_net=INTERNET_NET)
    internet.up()
    try:
        env = {"SANDFLEET_DNS_UPSTREAM": f"{UPSTREAM[0]}:{UPSTREAM[1]}", "SANDFLEET_EGRESS_SUBNET": _subnet()}
        with own_platform(tmp_path_factory.mktemp("vmnet-platform"), NODE, env=env) as p:
            yield p
    finally:
        internet.down()


@pytest.fixture(scope="module")
async def vfleet(vm_platform, tmp_path_factory):
    async with sandfleet.connect(vm_platform.url) as f:
        src = tmp_path_factory.mktemp("vmnet-src") / "base"
        make_busybox_base(src, hostname="vmnet",
                          applets=(*APPLETS, "wget", "nc", "nslookup", "tftp", "grep", "ip", "printf"))
        await Layers(f.bus).build_dir(LAYER, src)
        yield f


async def _create(fleet, **spec):
    """The first create boots and saves the module's machine state (a NIC is a device, so it is
    a state of its own); under TCG on a loaded node that can outlast placement's launch budget,
    and the node finishes saving it anyway: the second try restores it."""
    return await create_vm(fleet, tries=2, isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB,
                           labels={"task": "vm-redteam"}, **spec)


async def _sh(sb, script: str) -> tuple[int, str]:
    r = await sb.exec(["sh", "-c", script], timeout_s=60)
    return r.exit_code, (r.stdout + r.stderr).decode(errors="replace")


def _connect(sb, address: str, port: int):
    return lambda v: v.kind == "network.connect" and (v.sandbox_id, v.address, v.port) == (sb.id, address, port)


async def test_a_microvm_reaches_what_its_rules_allow_and_nothing_else_and_refusals_are_reported(
        vfleet, vm_platform):
    sb = await _create(vfleet, allow=ALLOW)
    watch = Watch(vfleet, sb.id)
    try:
        code, out = await _sh(sb, "ls /sys/class/net")
        assert out.split() == ["eth0", "lo"], out
        # An allowed name resolves (slirp's forwarder → BPF redirect → the node's stub) and its host
        # answers; the allowed address:port too.
        code, out = await _sh(sb, "nslookup allowed.test")
        assert code == 0 and "10.77.235.1" in out, out
        # (busybox-static wget resolves names through NSS modules a bare layer lacks: it gets addresses)
        code, out = await _sh(sb, "wget -q -O - http://10.77.235.1/index.html")
        assert (code, out) == (0, "hello 10.77.235.1:80 /index.html\n"), out
        code, out = await _sh(sb, "wget -q -O - http://10.77.235.4:443/x")
        assert (code, out) == (0, "hello 10.77.235.4:443 /x\n"), out
        # Another host, another port of the allowed name's host: refused before a packet leaves, reported
        # against the sandbox with its task labels.
        for host, port in (("10.77.235.2", 80), ("10.77.235.1", 443)):
            code, out = await _sh(sb, f"wget -q -O - http://{host}:{port}/")
            assert code != 0 and "hello" not in out, out
            v = await watch.arrival(_connect(sb, host, port))
            assert v.labels == {"task": "vm-redteam"}
        # UDP to a host not allowed: refused at sendto.
        await _sh(sb, "tftp -g -r x 10.77.235.1 5353")
        await watch.arrival(lambda v: v.kind == "network.sendmsg" and v.address == "10.77.235.1" and v.port == 5353)
        # A name not allowed does not resolve, and the stub reports it.
        code, out = await _sh(sb, "nslookup evil.test")
        assert "10.77.235.2" not in out, out
        await watch.arrival(lambda v: v.kind == "network.dns" and "evil.test" in v.attempted)
        # Asking the fake internet's resolver directly is still the stub's business (any port 53).
        code, out = await _sh(sb, f"nslookup evil.test {UPSTREAM[0]}")
        assert "10.77.235.2" not in out, out
    finally:
        watch.close()
        await sb.destroy()
    assert await _gone(vm_platform, sb.id)
    assert await asyncio.to_thread(veth.links, f"sandfleet:{NODE}:{sb.id}") == []


async def test_the_bus_the_node_and_metadata_stay_out_of_reach_whatever_the_rules(vfleet, vm_platform):
    sb = await _create(vfleet, allow=["0.0.0.0/0"])
    watch = Watch(vfleet, sb.id)
    try:
        nats_port = int(vm_platform.url.rsplit(":", 1)[1])
        node = sorted({str(a) for a in await asyncio.to_thread(veth.host_addresses)
                       if a.version == 4 and not a.is_loopback and a not in ipaddress.ip_network(_subnet())})
        targets = [(a, nats_port) for a in node[:3]] + [("169.254.169.254", 80)]
        for host, port in targets:
            code, out = await _sh(sb, f"nc -w 3 {host} {port} </dev/null && echo reached")
            assert "reached" not in out, (host, port, out)
            await watch.arrival(_connect(sb, host, port))
        # slirp's host alias is QEMU's loopback: the sandbox namespace's own, where nothing listens
        # (the bus is on the host's loopback, out of this namespace).
        code, out = await _sh(sb, f"nc -w 3 10.0.2.2 {nats_port} </dev/null && echo reached")
        assert "reached" not in out, out
        code, out = await _sh(sb, "wget -q -O - http://10.77.235.2/")
        assert (code, out) == (0, "hello 10.77.235.2:80 /\n"), out  # 0.0.0.0/0 reaches the internet
    finally:
        watch.close()
        await sb.destroy()
    assert await _gone(vm_platform, sb.id)


async def _gone(platform, sandbox_id: str) -> bool:
    for _ in range(100):
        if not microvm_left(str(platform.data_dir), sandbox_id):
            return True
        await asyncio.sleep(0.05)
    return False
