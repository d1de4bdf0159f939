"""Veth pairs between the host and a sandbox's network namespace, and the node's own links.

A sandbox with egress gets one veth: the host end (its name chosen by the caller, its
owner written in the link's alias so a restarted node finds it) with the gateway address,
and `eth0` inside the namespace with the sandbox's address and a default route. Everything
goes through netlink (pyroute2); the in-namespace half runs on a short-lived thread that
enters the namespace, so no process is forked. Nothing here touches a link it did not make.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from linuxnode import netns
from linuxnode import syscalls as linux

T = TypeVar("T")
SANDBOX_IFNAME = "eth0"
_ENODEV = 19
_EEXIST = 17


@dataclass(frozen=True)
class Link:
    name: str
    alias: str
    addresses: tuple[str, ...]  # "a.b.c.d/len"


def in_netns(netns_path: str, fn: Callable[[], T]) -> T:
    """Run fn on a thread inside the namespace (the caller's thread never moves)."""
    def inside() -> T:
        fd = netns.open_ns(netns_path)
        try:
            linux.setns(fd, linux.CLONE_NEWNET)  # this thread only; it ends here
        finally:
            os.close(fd)
        return fn()

    return linux.on_own_thread(inside, "in-netns")


def _set_sysctl(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def plumb(netns_path: str, host_ifname: str, alias: str, gateway: ipaddress.IPv4Interface,
          address: ipaddress.IPv4Interface) -> None:
    """Make the pair; host end `host_ifname` (gateway), `eth0` in the namespace (address,
    default route via gateway). Removes what it made if a step fails."""
    ns_fd = netns.open_ns(netns_path)  # the name is in the node's holder, where pyroute2 would not look
    try:
        with IPRoute() as ipr:
            ipr.link("add", ifname=host_ifname, kind="veth", peer={"ifname": SANDBOX_IFNAME, "net_ns_fd": ns_fd})
    finally:
        os.close(ns_fd)
    with IPRoute() as ipr:
        try:
            index = ipr.link_lookup(ifname=host_ifname)[0]
            ipr.link("set", index=index, ifalias=alias)
            ipr.addr("add", index=index, address=str(gateway.ip), prefixlen=gateway.network.prefixlen)
            # Forward what arrives from this sandbox (only this link: the host's own
            # forwarding settings stay as they are).
            _set_sysctl(f"/proc/sys/net/ipv4/conf/{host_ifname}/forwarding", "1")
            # Strict reverse-path check: a source that is not this sandbox's is dropped on
            # arrival, so no sandbox can speak (e.g. to the DNS stub) as another.
            _set_sysctl(f"/proc/sys/net/ipv4/conf/{host_ifname}/rp_filter", "1")
            ipr.link("set", index=index, state="up")

            def inside() -> None:
                with IPRoute() as inner:
                    idx = inner.link_lookup(ifname=SANDBOX_IFNAME)[0]
                    inner.addr("add", index=idx, address=str(address.ip), prefixlen=address.network.prefixlen)
                    inner.link("set", index=idx, state="up")
                    inner.route("add", dst="default", gateway=str(gateway.ip))

            in_netns(netns_path, inside)
        except BaseException:
            remove(host_ifname)
            raise


def remove(ifname: str) -> bool:
    """Delete a link (a veth takes its peer with it); False if there was none."""
    with IPRoute() as ipr:
        try:
            ipr.link("del", ifname=ifname)
        except NetlinkError as exc:
            if exc.code == _ENODEV:
                return False
            raise
    return True


def links(alias_prefix: str) -> list[Link]:
    """The host's links whose alias starts with alias_prefix (ours), with their IPv4 addresses."""
    found = []
    with IPRoute() as ipr:
        for link in ipr.get_links():
            alias = link.get_attr("IFLA_IFALIAS") or ""
            if not alias.startswith(alias_prefix):
                continue
            addrs = tuple(
                f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}" for a in ipr.get_addr(index=link["index"], family=2)
            )
            found.append(Link(name=link.get_attr("IFLA_IFNAME"), alias=alias, addresses=addrs))
    return found


def ensure_dummy(ifname: str, alias: str, address: ipaddress.IPv4Interface) -> None:
    """A host-only link holding a node-owned address (e.g. the DNS stub's). Idempotent.

    A veth pair with both ends on the host, because kernels without the `dummy` module
    (this VM's) refuse that link kind; a veth is there wherever sandboxes get egress."""
    with IPRoute() as ipr:
        try:
            ipr.link("add", ifname=ifname, kind="veth", peer={"ifname": ifname + "p"})
        except NetlinkError as exc:
            if exc.code != _EEXIST:
                raise
        index = ipr.link_lookup(ifname=ifname)[0]
        ipr.link("set", index=index, ifalias=alias)
        ipr.link("set", index=ipr.link_lookup(ifname=ifname + "p")[0], state="up")
        try:
            ipr.addr("add", index=index, address=str(address.ip), prefixlen=address.network.prefixlen)
        except NetlinkError as exc:
            if exc.code != _EEXIST:
                raise
        ipr.link("set", index=index, state="up")


def host_addresses() -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Every address of every link in the calling thread's (the node's) namespace."""
    with IPRoute() as ipr:
        return [ipaddress.ip_address(a.get_attr("IFA_ADDRESS").split("%")[0]) for a in ipr.get_addr()]
