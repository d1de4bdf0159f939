"""The node-wide sysfs containers' /sys is cloned from (linuxnode.container_exec.blank_sysfs):
one superblock for every container, showing a network namespace of its own with nothing in it
but a loopback, never the host's interfaces, for as long as its holder keeps the fds."""

from __future__ import annotations

import os
import time

from linuxnode import mount_api
from linuxnode.container_exec import blank_sysfs
from tests.kernel import require


def test_clones_of_the_blank_sysfs_are_one_superblock_that_shows_only_its_own_loopback():
    require(os.geteuid() == 0, "mounts need root")
    sysfs, netns = blank_sysfs()
    clones = []
    try:
        clones = [mount_api.clone_tree(sysfs) for _ in range(2)]
        time.sleep(0.5)  # a namespace nobody held would have been torn down by now
        seen = [sorted(os.listdir(f"/proc/self/fd/{fd}/class/net")) for fd in (sysfs, *clones)]
        devs = {os.stat(f"/proc/self/fd/{fd}").st_dev for fd in (sysfs, *clones)}
        assert seen == [["lo"]] * 3
        assert len(devs) == 1  # one superblock: the kernel made no new sysfs for the clones
        net_ino = os.stat(f"/proc/self/fd/{netns}").st_ino
        assert net_ino != os.stat("/proc/self/ns/net").st_ino  # its own namespace, not the host's
    finally:
        for fd in (*clones, sysfs, netns):
            os.close(fd)
