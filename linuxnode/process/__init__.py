"""The `process` isolation level: a sandbox is a pause-mode init (catatonit -P) that is pid 1
of fresh pid, mount, ipc, uts and cgroup namespaces, inside a given network namespace and
cgroups, on a root it cannot write that shows nothing of the host but read-only /usr.

Every sandbox process is forked by the *spawner*, a small helper interpreter started on
first use, which the launcher asks for each with a typed request (protocol.py). Fork copies
the parent's page tables and exec tears the copy down again: on this VM that costs ~1.5 ms
each for a 50 MB launcher and a fraction of it for the 12 MB spawner.
- start: the spawner forks B as pid 1 of a new pid namespace (a pid namespace applies to
  the children of the thread that unshares it, so the spawner unshares, forks once and
  goes back, signals blocked). B joins the cgroups before anything else, enters the netns,
  unshares mount/ipc/uts/cgroup namespaces, builds the root from a plan (see rootfs.py),
  pivots into it, drops every capability, sets no_new_privs, installs the seccomp filter
  (built once by the launcher, linuxnode/seccomp.py) and execs catatonit.
- exec: the spawner forks C, which joins the cgroups, enters all of the init's namespaces
  (the pid namespace for its children only), chroots into its root, drops every
  capability and vfork-spawns the command D in a new session, then waits for it and
  writes its status. C stays outside the sandbox's pid namespace, so the sandbox never
  sees it, and D's orphans fall to the sandbox's init.
The spawner reaps B and C (and is a subreaper for the rest), so the launcher has no
children to reap and a launcher blocked in kill() never holds up a dying pid namespace.
Children report "step: errno message" on a close-on-exec pipe; they run only os/ctypes
code and leave by exec or os._exit. Files are opened with openat2(RESOLVE_IN_ROOT) from the
init's root, so no path or planted symlink leaves the sandbox. The spawner imports this
package, so nothing heavy is imported at the top (exec imports asyncio).

model.py      what callers pass and get back, and the two errors
rootfs.py     the plan B replays to build and seal the sandbox root
protocol.py   the requests the launcher sends the spawner: typed, versioned, fds named
spawner.py    the helper process, its loop, and the launcher's handle on it
children.py   B and C, the code that runs after fork
reports.py    the records children and spawner write on the report pipes
lifecycle.py  start, start_async, is_alive, kill, kill_async
execio.py     exec: the launcher's side of a command's pipes, on the event loop
background.py spawn: a background command's pipes, stdin and signals, on the event loop
files.py      read_file, write_file
"""

from __future__ import annotations

from linuxnode.process.execio import OUTPUT_GRACE_S, exec
from linuxnode.process.files import read_file, write_file
from linuxnode.process.lifecycle import START_TIMEOUT_S, is_alive, kill, kill_async, start, start_async
from linuxnode.process.model import (
    CATATONIT,
    DEFAULT_ENV,
    ExecError,
    ExecResult,
    InitProcess,
    ProcessSpec,
    RuntimeStartError,
)
from linuxnode.process.rootfs import STAGE
from linuxnode.process.spawner import handle as _spawner  # the tests read its helper's pid
from linuxnode.process.spawner import shutdown, warm_up

__all__ = [
    "CATATONIT",
    "DEFAULT_ENV",
    "ExecError",
    "ExecResult",
    "InitProcess",
    "OUTPUT_GRACE_S",
    "ProcessSpec",
    "RuntimeStartError",
    "kill_async",
    "start_async",
    "STAGE",
    "START_TIMEOUT_S",
    "exec",
    "is_alive",
    "kill",
    "read_file",
    "shutdown",
    "start",
    "warm_up",
    "write_file",
]
