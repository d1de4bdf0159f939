"""crun's detached helpers are found among the pids handed out while crun ran, not by walking
every child of the launcher (each live container's init is one): the real kernel, in a child
interpreter that is a subreaper as the launcher is."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.kernel import require

SCRIPT = r"""
import ctypes, os, shutil, sys, tempfile, time
from linuxnode.container_exec import _children, detached_helpers, last_pid
import linuxnode.container_exec as container_exec
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER, as the launcher
crun = os.path.join(tempfile.mkdtemp(), "crun")
shutil.copy("/bin/sleep", crun)

def run_like_crun():
    # crun run --detach: a session leader that forks a helper and exits; the helper becomes ours.
    leader = os.fork()
    if leader == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(crun, [crun, "1"])
        os._exit(0)
    os.waitpid(leader, 0)
    return leader

run_like_crun()
time.sleep(0.2)
older = _children()  # an earlier run's helper, still alive and ours: never this run's
first = last_pid()
run_like_crun()
last = last_pid()
time.sleep(0.2)  # the helper has exec'd crun
probed = detached_helpers(first, last)
container_exec.SPAN_PROBED = -1  # as when the span is wide: our children listed
listed = detached_helpers(first, last)
while True:  # every helper is our child by now: wait for them (they sleep 1 s)
    try:
        os.wait()
    except ChildProcessError:
        break
print(len(probed), probed == listed, len(older) == 1 and older[0] not in probed)
"""


def test_the_helper_of_a_crun_run_is_found_by_the_pids_handed_out_meanwhile_and_no_older_one():
    require(os.path.exists("/proc/sys/kernel/ns_last_pid"), "needs /proc/sys/kernel/ns_last_pid")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.split()
    assert out == ["1", "True", "True"]


MISSED = r"""
import asyncio, ctypes, os, shutil, tempfile, time
from linuxnode.container_exec import DetachedHelpers, detached_helpers, last_pid
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER, as the launcher
crun = os.path.join(tempfile.mkdtemp(), "crun")
shutil.copy("/bin/sleep", crun)
go_r, go_w = os.pipe()
first = last_pid()
leader = os.fork()
if leader == 0:  # a session leader still there when crun has exited: its helper is not ours yet
    os.setsid()
    if os.fork() == 0:
        os.execv(crun, [crun, "0.3"])
    os.read(go_r, 1)
    os._exit(0)
time.sleep(0.2)
last = last_pid()
found = detached_helpers(first, last)
helpers = DetachedHelpers()
helpers.watch(asyncio.new_event_loop(), found, (first, last))
os.write(go_w, b"x")
os.waitpid(leader, 0)
time.sleep(0.6)  # the helper is ours now, and has exited: a zombie
reaped = helpers.sweep_missed()
print(len(found), len(reaped), len(helpers.sweep_missed()))
"""


def test_a_helper_that_was_not_ours_yet_is_reaped_by_the_sweep_of_its_runs_pids():
    require(os.path.exists("/proc/sys/kernel/ns_last_pid"), "needs /proc/sys/kernel/ns_last_pid")
    out = subprocess.run([sys.executable, "-c", MISSED], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.split()
    assert out == ["0", "1", "0"]  # missed at once, reaped by the sweep, once
