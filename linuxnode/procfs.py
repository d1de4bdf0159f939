"""What the node reads from /proc, parsed in one place: a process's stat line, pressure stall
information (PSI), and the /proc entries that expose the host, which every runtime masks and
the node's LSM profile and syscall watch refuse or report.
"""

from __future__ import annotations

from dataclasses import dataclass

# Host-wide /proc files a sandbox never reads: physical-memory and page-frame maps (an open of
# /proc/kpagecgroup crashed a host in the published incident log), kernel keys, timers and
# scheduler internals. Masked (bind-mounted over) in every root; a name the kernel lacks is skipped.
MASKED_FILES = ("kpagecgroup", "kpageflags", "kpagecount", "kcore", "keys", "key-users", "timer_list",
                "timer_stats", "sched_debug", "latency_stats")
MASKED_DIRS = ("acpi", "scsi", "asound")
# Read-only in every root: host knobs a write would change for the whole node.
READONLY = ("bus", "fs", "irq", "sys", "sysrq-trigger")


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/<pid>/stat the node uses (proc(5) numbers them from 1)."""

    comm: str
    state: str  # R, S, D, Z, X, ...
    ppid: int
    session: int
    utime: int  # clock ticks in user mode
    stime: int  # clock ticks in kernel mode
    children_time: int  # cutime + cstime: clock ticks of its reaped children
    start_time: int  # clock ticks after boot: with the pid, a process's identity


def read_stat(pid: int) -> ProcStat | None:
    """/proc/<pid>/stat of a process, or None if there is no such process (a zombie has one)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return parse_stat(data)


def parse_stat(data: bytes) -> ProcStat | None:
    # The command name may hold spaces and parentheses: it ends at the last ')'.
    head, _, tail = data.rpartition(b")")
    fields = tail.split()
    try:
        return ProcStat(comm=head.partition(b"(")[2].decode(errors="replace"), state=fields[0].decode(),
                        ppid=int(fields[1]), session=int(fields[3]), utime=int(fields[11]), stime=int(fields[12]),
                        children_time=int(fields[13]) + int(fields[14]),
                        start_time=int(fields[19]))
    except (IndexError, ValueError):
        return None


def psi_some_avg10(path: str) -> float:
    """The `some avg10` of a PSI file (/proc/pressure/<kind> or a cgroup's <kind>.pressure);
    0 where the kernel keeps no PSI there."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("some "):
                    return float(line.split()[1].partition("=")[2])
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def node_pressure(kind: str) -> float:
    """The node's `some avg10` for `cpu`, `memory` or `io`."""
    return psi_some_avg10(f"/proc/pressure/{kind}")


@dataclass(frozen=True)
class InterfaceCounters:
    """One line of /proc/<pid>/net/dev: an interface of that process's network namespace."""

    name: str
    rx_bytes: int
    tx_bytes: int


def read_net_dev(pid: int) -> list[InterfaceCounters]:
    """The interfaces of the network namespace `pid` is in, read from the host (the file shows the
    reader the namespace of the process it names, not its own). [] if the process is gone."""
    try:
        with open(f"/proc/{pid}/net/dev", "rb") as f:
            return parse_net_dev(f.read())
    except OSError:
        return []


def parse_net_dev(data: bytes) -> list[InterfaceCounters]:
    # Two header lines, then `name: rx_bytes rx_packets ... (8 receive fields) tx_bytes ...`.
    found = []
    for line in data.decode(errors="replace").splitlines()[2:]:
        name, sep, counters = line.partition(":")
        fields = counters.split()
        if not sep or len(fields) < 9:
            continue
        try:
            found.append(InterfaceCounters(name=name.strip(), rx_bytes=int(fields[0]), tx_bytes=int(fields[8])))
        except ValueError:
            continue
    return found
