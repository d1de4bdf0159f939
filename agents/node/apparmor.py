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
it works on any machine with the parser, AppArmor kernel or not. Where the kernel runs
AppArmor, `SandboxProfiles` loads one profile per sandbox when the agent confines it and
removes it at release (and, after a restart, every `sandfleet-` profile no live sandbox
owns); the sandbox then runs under the profile named in its `Confinement` (crun's
`process.apparmorProfile`; `exec <name>` written to the process's attr/exec before a
`process` sandbox's programs run). This kernel has no AppArmor, so loading is not exercised here.
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


HOST_VIEW_WRITABLE = ["tmp", "workspace"]  # a host_view sandbox (linuxnode.process.rootfs)
# What a build sandbox's root keeps inside its user namespace (linuxnode.process.children
# BUILD_CAPABILITIES, by AppArmor's names): a package manager installing files as their
# packages own them and switching to their users.
BUILD_CAPABILITIES = ("chown", "dac_override", "fowner", "fsetid", "kill", "setgid", "setuid")
PROFILES_FILE = "/sys/kernel/security/apparmor/profiles"
# A top-level name that is not exactly `dev` (AppArmor globs have no negation of a word).
_ALL_BUT_DEV = "/{[^d]*,d,d[^e]*,de,de[^v]*,dev?*}"


def writable_dirs(rootfs_dir: str | None) -> list[str]:
    """The top-level directories the sandbox may write, as Landlock decides them."""
    if rootfs_dir is None:
        return list(HOST_VIEW_WRITABLE)
    return sorted(path.rsplit("/", 1)[-1] for path, access in landlock.sandbox_rules(rootfs_dir)[1:]
                  if access & landlock.MAKE_REG and not path.endswith("/dev/shm"))


def profile(sandbox_id: str, writable: list[str] | None, build: bool = False) -> str:
    """The profile text for one sandbox. `writable` names the top-level directories it may
    write; None means every one but system content (landlock.READ_ONLY_DIRS), which is what
    Landlock decides for a root of layers whatever its top level holds, so the agent can load
    the profile before the root is composed (the two are made at once). A `build` sandbox
    (SandboxSpec.build: a Dockerfile's RUN) may write its whole root, system content and top
    level included, and keeps BUILD_CAPABILITIES, as its Landlock rules and exec helper let it;
    /proc and /sys stay denied as for every sandbox."""
    for name in writable or ():
        if not name or "/" in name or not all(c.isalnum() or c in "._-" for c in name):
            raise ProfileError(f"top-level directory {name!r} cannot be named in a profile")
    lines = [
        "abi <abi/3.0>,",
        f"profile {profile_name(sandbox_id)} flags=(attach_disconnected,mediate_deleted) {{",
        "  # its own root: read, map and execute (staying in this profile); system content read-only",
        "  /** mrix,",
    ]
    if build:
        lines.append("  /** rwlkmix,")
    elif writable is None:
        # Every top-level directory but /dev (whose devices are granted one by one below);
        # nothing made at the top level itself (as Landlock, which grants the root read only).
        lines.append(f"  {_ALL_BUT_DEV}/** rwlkmix,")
        lines.append("  deny /* wl,")
        lines.append(f"  deny /{{{','.join(sorted(landlock.READ_ONLY_DIRS - {'dev'}))}}}/** wl,")
    elif writable:
        lines.append(f"  /{{{','.join(writable)}}}/** rwlkmix,")
        lines.append(f"  /{{{','.join(writable)}}}/ rw,")
    lines += [
        "  /dev/shm/** rwlk,",
        "  /dev/{null,zero,full,random,urandom,tty,ptmx} rw,",
        "  /dev/pts/* rw,",
        "  # beneath the readable root, what leaks or hurts the host",
        f"  deny /proc/{{{','.join(_DENIED_PROC)}}} rwklx,",
        "  deny /proc/sys/** wkl,",
        "  deny /sys/** wkl,",
        "  deny /proc/*/attr/** w,",
        "  deny /proc/*/loginuid w,",
        "  # no capability (a build's own few), no mount table changes, no ptrace, no raw or packet sockets",
        *([f"  capability {name}," for name in BUILD_CAPABILITIES] if build else ["  deny capability,"]),
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


def loaded_profiles() -> set[str]:
    """Names of the sandbox profiles the kernel holds (lines `name (mode)` in securityfs)."""
    try:
        with open(PROFILES_FILE) as f:
            names = [line.rsplit(" (", 1)[0] for line in f.read().splitlines()]
    except OSError:
        return set()
    return {name for name in names if name.startswith(profile_name(""))}


class SandboxProfiles:
    """One loaded profile per sandbox where the kernel runs AppArmor, none where it does not
    (`on` False): the agent calls the same three methods either way."""

    def __init__(self, on: bool, status: str) -> None:
        self.on = on
        self.status = status

    @classmethod
    def detect(cls) -> SandboxProfiles:
        try:
            validate(profile("probe", None))
            validate(profile("probe", HOST_VIEW_WRITABLE))
            validate(profile("probe", None, build=True))
        except ProfileError as exc:
            return cls(False, f"off: {exc}")
        if lsm.apparmor_enabled():
            return cls(True, "on: one profile per sandbox, loaded when it is confined and removed when it is released")
        return cls(False, "off: not in this kernel (profiles are generated and validated offline with apparmor_parser)")

    def load(self, sandbox_id: str, host_view: bool, build: bool = False) -> str:
        """Load the sandbox's profile; its name, or "" where AppArmor is off."""
        if not self.on:
            return ""
        load(profile(sandbox_id, HOST_VIEW_WRITABLE if host_view else None, build))
        return profile_name(sandbox_id)

    def unload(self, sandbox_id: str) -> None:
        if self.on and profile_name(sandbox_id) in loaded_profiles():
            unload(sandbox_id)

    def held(self) -> set[str]:
        """Sandbox ids whose profile the kernel holds."""
        if not self.on:
            return set()
        return {name.removeprefix(profile_name("")) for name in loaded_profiles()}


def node_status() -> str:
    """What the agent reports for AppArmor on this node."""
    return SandboxProfiles.detect().status
