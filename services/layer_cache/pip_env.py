"""Run `pip install` with the Python of a layer stack; its writes alone become a new layer.

`unshare --mount --pid --fork --propagation private python -m services.layer_cache.pip_env
--work DIR --lower IMAGE... --pip PIPDIR [--requirements FILE] [PKG...]`

In its own mount and pid namespaces (every mount goes when it exits, however it exits) it
mounts the layer images, stacks an overlay over them with `<work>/root` as the upper dir,
chroots into it and execs `python3 -m pip install`. Mount points (/dev, /proc, /tmp, the
borrowed pip) and the build's /etc/resolv.conf come from a scaffold directory stacked as the
topmost lower layer, so no mount point is ever created in the upper dir and nothing of the
build machinery lands in the layer; a symlink a layer plants (`dev -> /`) is hidden by the
scaffold's real directory. pip itself is the node's, bound read-only (a base layer with a
Python need not bring pip); the network is the host's, so PyPI (or the index the node's
PIP_INDEX_URL names) is reachable.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import sys
from pathlib import Path

from linuxnode import syscalls as linux
from services.layer_cache import mounts

PIP_MOUNT = ".sandfleet-pip"  # inside the root; holds the borrowed `pip` package and the requirements
DEVICES = ("null", "zero", "full", "random", "urandom")
PASSED_ENV = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES",
              "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
PIP_FLAGS = ("--no-cache-dir", "--disable-pip-version-check", "--root-user-action=ignore",
             "--break-system-packages", "--no-warn-script-location", "--progress-bar=off", "--no-input")
OVERLAY_XATTR = "trusted.overlay."
KEPT_XATTRS = ("trusted.overlay.opaque",)  # a directory that hides the layers' one: part of the layer


def pip_env(cert: str | None) -> dict[str, str]:
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/tmp",
           "LANG": "C.UTF-8", "PYTHONPATH": f"/{PIP_MOUNT}",
           # No __pycache__ for the layers' own modules in the new layer; pip still compiles
           # what it installs (it calls compileall itself).
           "PYTHONDONTWRITEBYTECODE": "1"}
    env |= {k: os.environ[k] for k in PASSED_ENV if os.environ.get(k)}
    if cert:
        env["PIP_CERT"] = f"/{PIP_MOUNT}/cert.pem"
    return env


def make_scaffold(scaffold: Path, requirements: Path | None, cert: str | None) -> None:
    for rel in ("dev", "proc", "tmp", "etc", f"{PIP_MOUNT}/pip"):
        (scaffold / rel).mkdir(parents=True, exist_ok=True)
    (scaffold / "tmp").chmod(0o1777)
    try:
        shutil.copyfile("/etc/resolv.conf", scaffold / "etc" / "resolv.conf")
    except OSError:
        (scaffold / "etc" / "resolv.conf").write_text("")
    if requirements is not None:
        shutil.copyfile(requirements, scaffold / PIP_MOUNT / "requirements.txt")
    if cert:
        shutil.copyfile(cert, scaffold / PIP_MOUNT / "cert.pem")


def mount_root(work: Path, images: list[str], pip_dir: str) -> Path:
    lowers = []
    for i, image in enumerate(images):
        target = work / "lower" / str(i)
        target.mkdir(parents=True)
        mounts.mount_erofs(Path(image), target)
        lowers.append(str(target))
    merged, ovl_work = work / "merged", work / "ovl-work"
    merged.mkdir()
    ovl_work.mkdir()
    lowers_top_first = [str(work / "scaffold"), *reversed(lowers)]
    mounts.mount_overlay(lowers_top_first, work / "root", ovl_work, merged)
    mounts.mount("dev", str(merged / "dev"), "tmpfs", linux.MS_NOSUID | linux.MS_NOEXEC, "size=64k,mode=0755")
    for name in DEVICES:
        os.mknod(merged / "dev" / name, 0o666 | stat.S_IFCHR, os.stat(f"/dev/{name}").st_rdev)
    mounts.mount("proc", str(merged / "proc"), "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC, "")
    mounts.mount("tmp", str(merged / "tmp"), "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "size=4g,mode=1777")
    pip_target = str(merged / PIP_MOUNT / "pip")
    linux.mount(pip_dir, pip_target, None, linux.MS_BIND)
    linux.mount(None, pip_target, None, linux.MS_REMOUNT | linux.MS_BIND | linux.MS_RDONLY)
    return merged


def strip_overlay_xattrs(root: Path) -> None:
    """Copy-up leaves overlayfs bookkeeping (origin file handles, `impure`) on the upper dir;
    it means nothing once the dir is a layer of its own, so only whiteout markers stay."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            try:
                names = os.listxattr(path, follow_symlinks=False)
            except OSError:
                continue
            for attr in names:
                if attr.startswith(OVERLAY_XATTR) and attr not in KEPT_XATTRS:
                    os.removexattr(path, attr, follow_symlinks=False)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pip_env")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--lower", action="append", required=True, help="an EROFS image, bottom first")
    p.add_argument("--pip", required=True, help="the node's `pip` package directory")
    p.add_argument("--requirements", type=Path, default=None)
    p.add_argument("packages", nargs="*")
    args = p.parse_args(argv)
    cert = os.environ.get("PIP_CERT") if os.path.isfile(os.environ.get("PIP_CERT", "")) else None
    make_scaffold(args.work / "scaffold", args.requirements, cert)
    merged = mount_root(args.work, args.lower, args.pip)
    os.chroot(merged)
    os.chdir("/")
    argv_pip = ["python3", "-m", "pip", "install", *PIP_FLAGS]
    if args.requirements is not None:
        argv_pip += ["-r", f"/{PIP_MOUNT}/requirements.txt"]
    argv_pip += args.packages
    sys.stdout.flush()
    try:
        os.execvpe("python3", argv_pip, pip_env(cert))
    except FileNotFoundError:
        print("the layer has no python3 on its PATH", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main()
