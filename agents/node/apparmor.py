"""AppArmor profiles for sandboxes: one per sandbox, generated from the same policy as its
Landlock rules (linuxnode.landlock), validated with `apparmor_parser`, and loaded
where the kernel has AppArmor.

The profile says what Landlock says, and more where AppArmor can: the whole root readable
and executable, system content read-only, the root's other top-level directories and
/dev/shm writable; and, which Landlock cannot (its grants cover whole trees), denials
beneath a readable tree: the /proc files that leak or hurt the host (`kpagecgroup`,
`kcore`, `sysrq-trigger`, `/proc/sys` writes). No capability, no mount/pivot_root, no ptrace,
no raw or packet socket. TCP and UDP stay allowed: which addresses a sandbox may reach is
the eBPF allowlists' decision (agents/node/egress.py), which AppArmor cannot express.

`validate` runs `apparmor_parser -Q -K -T` (parse and compile, load nothing, no cache):
it works on any machine with the parser, AppArmor kernel or not. `load`/`unload` need a
kernel with AppArmor; a sandbox then runs under the profile named by `profile_name`
(crun's `process.apparmorProfile`; `exec <name>` written to /proc/<pid>/attr/apparmor/exec
for a `process` sandbox). This kernel has no AppArmor, so those two are not exercised here.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from linuxnode import landlock, lsm, procfs

PARSER = "apparmor_parser"
# What every runtime masks, and the writable host knob beside it.
_DENIED_PROC = (*procfs.MASKED_FILES, "kmem", "mem", "sysrq-trigger")


class ProfileError(RuntimeError):
    """apparmor_parser refused a profile; the message carries its words."""


def profile_name(sandbox_id: str) -> str:
    return f"sandfleet-{sandbox_id}"


def writable_dirs(rootfs_dir: str | None) -> list[str]:
    """The top-level directories the sandbox may write, as Landlock decides them."""
    if rootfs_dir is None:  # the host view (linuxnode.process.rootfs)
        return ["tmp", "workspace"]
    return sorted(path.rsplit("/", 1)[-1] for path, access in landlock.sandbox_rules(rootfs_dir)[1:]
                  if access & landlock.MAKE_REG and not path.endswith("/dev/shm"))


def profile(sandbox_id: str, writable: list[str]) -> str:
    """The profile text for one sandbox."""
    for name in writable:
        if not name or "/" in name or not all(c.isalnum() or c in "._-" for c in name):
            raise ProfileError(f"top-level directory {name!r} cannot be named in a profile")
    lines = [
        "abi <abi/3.0>,",
        f"profile {profile_name(sandbox_id)} flags=(attach_disconnected,mediate_deleted) {{",
        "  # its own root: read, map and execute (staying in this profile); system content read-only",
        "  /** mrix,",
    ]
    if writable:
        lines.append(f"  /{{{','.join(writable)}}}/** rwlkmix,")
        lines.append(f"  /{{{','.join(writable)}}}/ rw,")
    lines += [
        "  /dev/shm/** rwlk,",
        "  /dev/{null,zero,full,random,urandom,tty} rw,",
        "  # beneath the readable root, what leaks or hurts the host",
        f"  deny /proc/{{{','.join(_DENIED_PROC)}}} rwklx,",
        "  deny /proc/sys/** wkl,",
        "  deny /sys/** wkl,",
        "  deny /proc/*/attr/** w,",
        "  deny /proc/*/loginuid w,",
        "  # no capability, no mount table changes, no ptrace, no raw or packet sockets",
        "  deny capability,",
        "  deny mount,",
        "  deny remount,",
        "  deny umount,",
        "  deny pivot_root,",
        "  deny ptrace,",
        "  deny network raw,",
        "  deny network packet,",
        "  network inet stream,",
        "  network inet dgram,",
        "  network inet6 stream,",
        "  network inet6 dgram,",
        "  network unix,",
        "  unix,",
        "  signal,",
        "}",
    ]
    return "\n".join(lines) + "\n"


def parser_path() -> str | None:
    return shutil.which(PARSER) or next((p for p in ("/usr/sbin/apparmor_parser", "/sbin/apparmor_parser")
                                         if os.access(p, os.X_OK)), None)


def _parse(text: str, *args: str) -> None:
    parser = parser_path()
    if parser is None:
        raise ProfileError(f"{PARSER} is not installed (Debian package apparmor)")
    done = subprocess.run([parser, *args], input=text.encode(), capture_output=True, timeout=30)
    if done.returncode != 0:
        words = [ln for ln in done.stderr.decode(errors="replace").splitlines() if "Cache read/write" not in ln]
        raise ProfileError("; ".join(words) or f"{PARSER} exited {done.returncode}")


def validate(text: str) -> None:
    """Compile the profile without loading it anywhere; ProfileError if it is wrong."""
    _parse(text, "-Q", "-K", "-T")


def load(text: str) -> None:
    """Load (or replace) the profile in the kernel. Needs a kernel with AppArmor."""
    _parse(text, "-r", "-K", "-W")


def unload(sandbox_id: str) -> None:
    """Remove a loaded profile; nothing happens if it is not loaded."""
    _parse(f"profile {profile_name(sandbox_id)} {{}}\n", "-R", "-K")


def node_status() -> str:
    """What the agent reports for AppArmor on this node."""
    try:
        validate(profile("probe", ["tmp", "workspace"]))
    except ProfileError as exc:
        return f"off: {exc}"
    if lsm.apparmor_enabled():
        return "available: profiles generated and validated; loading them per sandbox is not wired yet"
    return "off: not in this kernel (profiles are generated and validated offline with apparmor_parser)"
