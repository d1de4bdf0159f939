"""The `container` isolation level: a sandbox is an OCI container run by crun from a bundle
generated here, whose root is the sandbox's composed overlay, whose init is the host's static
catatonit (bound read-only at /dev/init, so a layer needs no init of its own), and whose
network namespace and cgroups are the node agent's.

crun never manages cgroups here (`--cgroup-manager=disabled`): `crun run --detach` runs
behind a /bin/sh prelude that first joins every cgroup of the sandbox (the v1
controllers and the v2 directory; see container_exec.py), so the init is born in them, its
cgroup namespace is rooted there, and no sandbox code ever runs outside them (which is what
`crun create`, move the pid, `crun start` would give, in one crun call instead of two).
`crun run` runs in a mount namespace of its own, made once per Crun: fully private (nothing
done in it reaches the host) and, on hybrid hosts, without the v2 hierarchy, since crun 1.8
refuses to create a container while it sees a cgroup v2 mount that is not the only one. The
pool threads that run crun live in it. It never gets the host's later mounts: each container's
root is cloned where it is composed (open_tree in the node's roots namespace, linuxnode.roots_ns)
and attached at `<bundle>/rootfs` just for the call,
and its network namespace is named through our fd of it. So the mount table crun copies for
every container stays the size it was at start instead of growing with every live sandbox
(copying 6,000 mounts costs ~28 ms of CPU here, and crun copies and tears down the table of
the namespace it runs in for each container). Every other crun command works from the host's
namespace. The container's stdio is /dev/null and crun's own errors go to a log file in the
bundle: a container holding a pipe we read would hang the call. Files are read and written by `linuxnode.process` from the init's root
(openat2 RESOLVE_IN_ROOT), as for a process sandbox. crun knows no Landlock: the init starts
behind a static exec shim (confine_shim.c, bound at /dev/sandfleet-confine) that applies the
process sandbox's policy (landlock.py) and execs catatonit.

Commands are not run with `crun exec`: the `process` runtime's spawner joins the container's
init (its cgroups, every namespace, its root) and gives the command the confinement crun would
give it from this bundle (no capabilities, no_new_privs, uid/gid 0, umask 022, no rlimits of
its own, the Landlock policy, and the `process` seccomp filter: this bundle's program behind a
prefix that decides the native calls faster and gives numbers unknown to libseccomp ENOSYS), for less CPU: an exec of `true` costs the launcher ~11 ms with its
spawner against ~17 ms with `crun exec` and its prelude.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from linuxnode import cgroups, landlock, layered_root, mount_api, netns, procfs, seccomp, userns
from linuxnode import syscalls as linux
from linuxnode.container_exec import (
    DetachedHelpers,
    blank_sysfs,
    detached_helpers,
    last_pid,
    start_time_of as _start_time,
    enter_namespace,
    mount_sysfs_in,
    joined,
    make_crun_namespace,
)
from linuxnode.process import DEFAULT_ENV, InitProcess, kill_async

log = logging.getLogger("sandfleet.container")

INIT_HOST = "/usr/bin/catatonit"
SYS_MASKED = ("firmware", "fs/selinux", "dev/block")  # under /sys: hidden, as crun's default masks them
# Where, in crun's own mount namespace only, containers' roots are attached and the shim is
# bound: a path every id may pass (see make_crun_namespace), which the node's data dir is not.
ROOTS_DIR = "/run/sandfleet/crun-roots"
SHIM_EXPOSED = f"{ROOTS_DIR}/sandfleet-confine"
INIT_PATH = "/dev/init"


class ContainerError(RuntimeError):
    """crun could not create, start or run something; the message carries crun's words."""


@dataclass(frozen=True)
class ContainerSpec:
    sandbox_id: str
    rootfs: str  # the composed overlay
    cgroup_procs: list[str]
    netns: str
    tmp_size_mb: int = 256
    # The host uid/gid of its root (linuxnode.userns): crun gives it a user namespace mapping
    # 0..65535 there, the range the layer-cache idmapped its layers to. 0: no user namespace.
    id_host: int = 0
    hostname: str = "sandbox"
    apparmor_profile: str = ""  # loaded by the node agent where the kernel runs AppArmor
    # The root as a detached mount tree (the caller's fd), cloned where roots are composed (the
    # node's roots namespace, linuxnode.roots_ns); -1: cloned from `rootfs` in our own namespace.
    root_tree: int = -1


def bundle_config(spec: ContainerSpec, shim: tuple[str, list[str]] | None = None) -> dict:
    """The OCI config: no capabilities and no_new_privs (as `process`), the host's catatonit as a
    pause-mode init, a writable root, tmpfs /tmp, and the node agent's netns. `shim` (the host's
    Landlock exec shim and its argv prefix, see landlock.shim_argv) runs the init under Landlock."""
    caps = {k: [] for k in ("bounding", "effective", "permitted", "inheritable", "ambient")}
    nosuid = ["nosuid", "nodev", "noexec"]
    config = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False, "user": {"uid": 0, "gid": 0}, "args": [*(shim[1] if shim else []), INIT_PATH, "-P"],
            "cwd": "/",
            "env": [f"{k}={v}" for k, v in DEFAULT_ENV.items()], "capabilities": caps, "noNewPrivileges": True,
        },
        "root": {"path": spec.rootfs, "readonly": False},
        "hostname": spec.hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": nosuid},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "noexec", "strictatime", "mode=755", "size=64k"]},  # /dev/init is its own mount
            {"destination": INIT_PATH, "type": "bind", "source": INIT_HOST, "options": ["bind", "ro", "nosuid", "nodev"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={max(1, spec.tmp_size_mb // 4)}m"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": nosuid},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": [*nosuid, "ro"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmp",
             "options": ["nosuid", "nodev", "mode=1777", f"size={spec.tmp_size_mb}m"]},
        ],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "cgroup")]
            + [{"type": "network", "path": spec.netns}],
            "rootfsPropagation": "rprivate",
            "maskedPaths": [f"/proc/{p}" for p in (*procfs.MASKED_DIRS, *procfs.MASKED_FILES)]
            + [f"/sys/{p}" for p in SYS_MASKED],
            "readonlyPaths": [f"/proc/{p}" for p in procfs.READONLY],
            "seccomp": seccomp.oci_seccomp(),
        },
    }
    if spec.apparmor_profile:
        config["process"]["apparmorProfile"] = spec.apparmor_profile
    if spec.id_host:
        # crun makes the user namespace first, so the container's other namespaces are owned by
        # it. The node agent's netns stays the host's, so crun may not mount a sysfs of it and
        # would bind the host's /sys instead (the host's interfaces): the node mounts one (mount_sysfs_in).
        config["mounts"] = [m for m in config["mounts"] if m["destination"] != "/sys"]
        config["linux"]["maskedPaths"] = [p for p in config["linux"]["maskedPaths"] if not p.startswith("/sys/")]
        ids = [{"containerID": 0, "hostID": spec.id_host, "size": userns.RANGE}]
        config["linux"]["namespaces"].insert(0, {"type": "user"})
        config["linux"]["uidMappings"] = ids
        config["linux"]["gidMappings"] = ids
    if shim is not None:
        config["mounts"].append({"destination": landlock.SHIM_PATH, "type": "bind", "source": shim[0],
                                 "options": ["bind", "ro", "nosuid", "nodev"]})
    return config




class Crun:
    """One node's crun: its state under `state_dir/crun`, its bundles under `state_dir/bundles`."""

    def __init__(self, state_dir: Path, binary: str, hybrid_v2: str | None) -> None:
        self.state_dir = state_dir
        self.root = state_dir / "crun"
        self.bundles = state_dir / "bundles"
        self.binary = binary
        # Sandbox mounts a restarted launcher finds on the host (roots, layers, netns) are of no use to crun.
        # The mount point on the host stays an empty directory; each Crun has its own tmpfs on it.
        os.makedirs(ROOTS_DIR, mode=0o755, exist_ok=True)
        self._crun_mnt = make_crun_namespace(hybrid_v2, prune=(str(state_dir.parent), netns.RUN_DIR), roots=ROOTS_DIR)
        self._helpers = DetachedHelpers()
        # The clone source of containers' /sys and the network namespace it shows (blank_sysfs),
        # made at the first container that needs it; a restarted launcher makes new ones.
        self._sysfs = self._sysfs_netns = -1
        self._sysfs_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="crun-run", initializer=enter_namespace, initargs=(self._crun_mnt,))
        self._landlock = landlock.abi()
        self.shim: str | None = None  # the Landlock exec shim; None: containers run without Landlock
        if self._landlock:
            try:
                built = landlock.build_shim(str(state_dir))
                self._pool.submit(_expose, built, SHIM_EXPOSED).result()
                self.shim = SHIM_EXPOSED
            except OSError as exc:
                log.warning("container sandboxes run without Landlock: %s", exc.strerror)

    def _shared_sysfs(self) -> int:
        with self._sysfs_lock:
            if self._sysfs < 0:
                self._sysfs, self._sysfs_netns = blank_sysfs()
            return self._sysfs

    def _confine(self, root_on_host: str, cgroup_procs: list[str]) -> list[str]:
        """The argv prefix that puts a command under the sandbox's Landlock policy (or nothing)."""
        return landlock.shim_argv(root_on_host, cgroup_procs, self._landlock) if self.shim else []

    @classmethod
    def find(cls, state_dir: Path) -> Crun | None:
        binary = shutil.which("crun")
        if binary is None:
            return None
        layout = cgroups.CgroupLayout.detect()
        for path in (state_dir / "crun", state_dir / "bundles"):
            path.mkdir(parents=True, exist_ok=True)
        return cls(state_dir, binary, layout.v2 if layout.mode == "hybrid" else None)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._helpers.close()
        os.close(self._crun_mnt)
        if self._sysfs >= 0:
            os.close(self._sysfs)
            os.close(self._sysfs_netns)

    def _crun(self, *args: str) -> list[str]:
        return [self.binary, "--root", str(self.root), "--cgroup-manager=disabled", *args]

    async def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = await asyncio.create_subprocess_exec(*self._crun(*args), stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, err = await proc.communicate()
        if check and proc.returncode:
            raise ContainerError(f"crun {args[0]}: {err.decode(errors='replace').strip() or proc.returncode}")
        return subprocess.CompletedProcess(args, proc.returncode, b"", err)

    # -- run: in crun's own mount namespace ---------------------------------------------------

    def _run_detached(self, sandbox_id: str, bundle: Path, cgroup_fds: list[int],
                      tree: int) -> tuple[int, list[int], tuple[int, int | None]]:
        """`crun run --detach` inside the sandbox's cgroups from its first instruction, from a
        pool thread (in crun's namespace), with the root's mount `tree` attached at
        `<bundle>/rootfs` meanwhile. The cgroup.procs files come as fds opened on the host: in
        crun's namespace the v2 hierarchy is not mounted. Returns crun's exit code, the
        helpers it left running and the pids given while it ran (crun's, the last one)."""
        target = f"{ROOTS_DIR}/{sandbox_id}"
        os.mkdir(target, 0o755)
        mount_api.attach(tree, target)
        try:
            run = self._crun(f"--log={bundle}/crun.log", "run", "--detach", "--pid-file",
                             str(bundle / "init.pid"), "--bundle", str(bundle), sandbox_id)
            proc = subprocess.Popen(joined(run, [f"/proc/self/fd/{fd}" for fd in cgroup_fds]), pass_fds=cgroup_fds,
                                    **_DETACHED)
            code = proc.wait()
            span = (proc.pid, last_pid())
            helpers = detached_helpers(*span)
        finally:
            linux.umount2(target, linux.MNT_DETACH)  # the container's namespace has its own copy now
            os.rmdir(target)
        return code, helpers, span

    async def _run_bundle(self, sandbox_id: str, bundle: Path, config: dict, tree: int, netns_path: str | None,
                          cgroup_procs: list[str]) -> None:
        """Write the bundle (its root the detached mount `tree`, attached for the run; its netns
        named through our fd) and run it."""
        fds: list[int] = []
        try:
            fds.append(netns_fd := netns.open_ns(netns_path) if netns_path else -1)
            cgroup_fds = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in cgroup_procs]
            fds += cgroup_fds
            config["root"]["path"] = f"{ROOTS_DIR}/{sandbox_id}"  # attached there by _run_detached
            if netns_fd >= 0:
                config["linux"]["namespaces"][-1] = {"type": "network", "path": f"/proc/{os.getpid()}/fd/{netns_fd}"}
            (bundle / "config.json").write_text(json.dumps(config))
            loop = asyncio.get_running_loop()
            code, helpers, span = await loop.run_in_executor(self._pool, self._run_detached, sandbox_id, bundle,
                                                             cgroup_fds, tree)
            self._helpers.watch(loop, helpers, span)
            if code != 0:
                raise ContainerError(f"crun run: {_tail(bundle / 'crun.log')}")
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)

    async def start(self, spec: ContainerSpec) -> InitProcess:
        """Run the container, its init born in the sandbox's cgroups; returns the init."""
        bundle = self.bundles / spec.sandbox_id
        bundle.mkdir(parents=True, exist_ok=False)
        own_tree = -1
        try:
            if spec.root_tree < 0:
                own_tree = mount_api.clone_tree(spec.rootfs, recursive=True)
            tree = own_tree if own_tree >= 0 else spec.root_tree
            root = f"/proc/self/fd/{tree}"  # the root as the tree has it, wherever it is composed
            layered_root.ensure_owned_dir(root, "workspace", spec.id_host)
            if spec.id_host:
                layered_root.ensure_dir(root, "sys")
            shim = (self.shim, self._confine(root, spec.cgroup_procs)) if self.shim else None
            await self._run_bundle(spec.sandbox_id, bundle, bundle_config(spec, shim), tree, spec.netns,
                                   spec.cgroup_procs)
            pid = int((bundle / "init.pid").read_text())
            start_time = _start_time(pid)
            if start_time is None:
                raise ContainerError("the container's init vanished before it started")
            init = InitProcess(pid=pid, start_time=start_time)
            if spec.id_host:  # before start returns: nothing of the sandbox's has run yet
                await asyncio.to_thread(mount_sysfs_in, pid, SYS_MASKED, self._shared_sysfs())
        except BaseException:
            await self.remove(spec.sandbox_id, None)
            raise
        finally:
            if own_tree >= 0:
                os.close(own_tree)
        return init

    # -- remove and recovery ---------------------------------------------------------------

    async def remove(self, sandbox_id: str, init: InitProcess | None) -> None:
        """Kill the container, drop crun's state and the bundle. Idempotent."""
        bundle = self.bundles / sandbox_id
        if init is None:
            with contextlib.suppress(OSError, ValueError):
                pid = int((bundle / "init.pid").read_text())
                start_time = _start_time(pid)
                init = InitProcess(pid, start_time) if start_time is not None else None
        if init is not None:
            await kill_async(init)
            _reap(init.pid)
            if _start_time(init.pid) == init.start_time:  # not gone yet, or not ours yet: later, then
                self._helpers.reap_later(asyncio.get_running_loop(), init.pid, init.start_time)
        state = self.root / sandbox_id
        if state.exists() and init is not None and _start_time(init.pid) != init.start_time:
            # The init is gone and crun manages no cgroups and runs no hooks here, so all
            # `crun delete` would do is remove this directory of plain files: spare the
            # process (~5 ms of CPU, a third of what crun costs per container).
            shutil.rmtree(state, ignore_errors=True)
        if state.exists():
            result = await self._run("delete", "--force", sandbox_id, check=False)
            if result.returncode and state.exists():
                log.warning("crun delete %s: %s", sandbox_id, result.stderr.decode(errors="replace").strip())
        shutil.rmtree(bundle, ignore_errors=True)
        self._helpers.sweep_when_due()

    def containers(self) -> set[str]:
        """Ids that have crun state or a bundle on this node (for crash recovery)."""
        found = set()
        for path in (self.root, self.bundles):
            with contextlib.suppress(FileNotFoundError):
                found.update(p.name for p in path.iterdir() if p.is_dir())
        return found

    # -- does it work here? --------------------------------------------------------------

    async def probe(self) -> str | None:
        """Run a real container (an empty root with the init alone); None if that worked, else why not."""
        sandbox_id = f"probe-{secrets.token_hex(4)}"
        with tempfile.TemporaryDirectory(prefix="probe-", dir=self.state_dir) as tmp:
            spec = ContainerSpec(sandbox_id=sandbox_id, rootfs=tmp, cgroup_procs=[], netns="", tmp_size_mb=1)
            config = bundle_config(spec)
            config["linux"]["namespaces"][-1] = {"type": "network"}
            bundle = self.bundles / sandbox_id
            try:
                bundle.mkdir(parents=True)
                tree = mount_api.clone_tree(tmp, recursive=True)
                try:
                    await self._run_bundle(sandbox_id, bundle, config, tree, None, [])
                finally:
                    os.close(tree)
                return None
            except (OSError, ContainerError, concurrent.futures.BrokenExecutor) as exc:
                return str(exc)
            finally:
                await self.remove(sandbox_id, None)


_DETACHED = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


def _expose(host_file: str, at: str) -> None:
    """Bind a host file read-only at `at` on crun's roots tmpfs (from a pool thread, in crun's namespace)."""
    os.close(os.open(at, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o755))
    linux.mount(host_file, at, None, linux.MS_BIND)
    linux.mount(None, at, None, linux.MS_REMOUNT | linux.MS_BIND | linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV)


def _tail(log_file: Path) -> str:
    try:
        lines = log_file.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "failed without a log"
    if not lines:
        return "failed without a message"
    last = lines[-1]
    with contextlib.suppress(ValueError, AttributeError):
        last = json.loads(last).get("msg", last)
    return last


def _reap(pid: int) -> None:
    """The init was crun's child; with crun gone it is ours if we are a subreaper."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
