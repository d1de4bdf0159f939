"""A Python 3.13 for a client that needs one on a Debian 12 node (Harbor needs >= 3.12; Debian 12
has 3.11 and no newer package): a Debian 13 (trixie) minbase tree with python3.13, bootstrapped
from the node's own Debian archive, holding a venv with the client's packages. Programs run in it
with chroot, in the host's network namespace (so they reach the platform's loopback bus) and in a
private mount namespace of their own (so every bind goes away with the program).

One tree per content (suite, Debian packages, pip requirements, this recipe's version), built
once under CACHE/<key> and reused by every later run: made in a temp dir beside it and renamed
into place, so no reader ever sees half a tree; builders of the same key wait on one lock. The
.debs debootstrap fetched (and pip's cache) stay under CACHE, so a tree for a new key downloads
less. A tree of another key (the requirements changed) is removed once a new one is built and no
run holds it (runs hold their key's lock shared). Runs write only Python's byte-code into it (compiled on first import, not at install: half
of pip's time), through a private /tmp and HOME otherwise. sandfleet itself is not copied in: the venv's path names /src, where each run binds the
checkout read-only, so a tree serves every checkout and commit (a change of the SDK's code needs
no rebuild; a change of its requirements is a new key).

    python -m tests.trixie_python                  # build (or find) the tree, print its root
    python -m tests.trixie_python harbor run ...   # run a client in it, here (at /job)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("SANDFLEET_TRIXIE_CACHE", "/var/cache/sandfleet/trixie-python"))
SUITE = "trixie"
PACKAGES = ("python3.13", "python3.13-venv", "ca-certificates")
RECIPE = 1  # bump when the steps below change what a tree holds
VENV = "/opt/client"  # inside the tree
SRC = "/src"  # inside: where runs bind the checkout (read-only)
JOB = "/job"  # inside: where runs bind their own working dir
CREDS = "/tmp/sandfleet.creds"  # inside, in a run's private /tmp: the bus credentials of a client run
HOST_CA = Path("/etc/ssl/certs")  # the host's CA bundle (pip here trusts a proxy CA: `pip config list`)
DEBOOTSTRAP_TIMEOUT_S = 1200
PIP_TIMEOUT_S = 1200
LOCK_WAIT_S = 2 * (DEBOOTSTRAP_TIMEOUT_S + PIP_TIMEOUT_S)


class TreeBuildError(RuntimeError):
    """A step of the build failed; the message ends with what it printed."""


def requirements(extra: str = "harbor") -> list[str]:
    """What `pip install 'sandfleet[<extra>]'` brings, from pyproject.toml (sandfleet's own
    requirements and the extra's), so the tree holds what a user's install would."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"][extra]]


def tree_key(reqs: list[str]) -> str:
    content = json.dumps({"suite": SUITE, "packages": PACKAGES, "requirements": reqs, "recipe": RECIPE},
                         sort_keys=True)
    return hashlib.sha256(content.encode()).hexdigest()[:16]


def debian_mirror() -> str:
    # The archive the layer-cache's Debian builds use: SANDFLEET_DEBIAN_MIRROR or the apt sources'
    from services.layer_cache.build import apt_archive, read_apt_sources

    mirror = os.environ.get("SANDFLEET_DEBIAN_MIRROR") or apt_archive(read_apt_sources())
    if not mirror:
        raise TreeBuildError("no Debian archive: set SANDFLEET_DEBIAN_MIRROR or add one to the apt sources")
    return mirror


@dataclass(frozen=True)
class Tree:
    root: Path

    @property
    def python(self) -> str:
        return f"{VENV}/bin/python"

    def run(self, argv: list[str], *, binds: Mapping[str, tuple[Path, bool]] = {}, env: Mapping[str, str] = {},
            cwd: str = "/", timeout: float | None = 600, with_src: bool = True,
            capture: bool = True) -> subprocess.CompletedProcess:
        """`argv` in the tree as root, chrooted, with a clean environment (`env` added to a PATH
        that starts with the venv) and these binds (path inside -> (host path, read-only); a
        mount point under /tmp is made there) on top of /dev, /proc, a private /tmp, the host's
        resolv.conf and CA bundle, and the checkout at /src (read-only). Output captured as
        text, unless `capture` is false. Holds the tree's key shared, so no build prunes it meanwhile."""
        building = self.root.name.startswith(".building-")  # its builder holds the key
        with contextlib.nullcontext() if building else _locked(self.root.parent / f".{self.root.name}.lock",
                                                                fcntl.LOCK_SH):
            if not building and not (self.root / ".complete").exists():
                raise TreeBuildError(f"{self.root} was pruned by a newer build: ask tree() again")
            return subprocess.run(_chroot_argv(self.root, argv, binds, env, cwd, with_src), capture_output=capture,
                                  text=True, timeout=timeout)

    def client(self, argv: list[str], *, workdir: Path, url: str, timeout: float | None = 600,
               capture: bool = True) -> subprocess.CompletedProcess:
        """`argv` run as a client of the platform at `url`: in `workdir` (bound at /job), with
        the credentials this host's SDK would use for `url` (SANDFLEET_CREDS, else the local
        platform's) bound read-only in the run's private /tmp, and no calls home (Harbor's
        telemetry off, litellm's price list read from its package)."""
        from sandfleet.credentials import CREDS_ENV, find_creds

        binds = {JOB: (workdir, False)}
        env = {"SANDFLEET_NATS_URL": url, "HOME": "/tmp/home", "HARBOR_TELEMETRY": "0",
               "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        if (creds := find_creds(url)) is not None:
            binds[CREDS] = (creds, True)
            env[CREDS_ENV] = CREDS
        return self.run(argv, binds=binds, env=env, cwd=JOB, timeout=timeout, capture=capture)


def _chroot_argv(root: Path, argv: list[str], binds: Mapping[str, tuple[Path, bool]], env: Mapping[str, str],
                 cwd: str, with_src: bool) -> list[str]:
    every = {"/etc/ssl/certs": (HOST_CA, True), **({SRC: (ROOT, True)} if with_src else {}), **binds}
    lines = ["set -e", f"R={shlex.quote(str(root))}", 'mount --rbind /dev "$R/dev"', 'mount -t proc proc "$R/proc"',
             'mount -t tmpfs -o mode=1777 tmpfs "$R/tmp"', 'mount --bind /etc/resolv.conf "$R/etc/resolv.conf"']
    for inside, (host, read_only) in every.items():
        target = f'"$R"{shlex.quote(inside)}'
        if inside.startswith("/tmp/"):  # the run's own tmpfs: the mount point goes with it
            lines.append(f"{'mkdir -p' if host.is_dir() else 'touch'} {target}")
        lines.append(f"mount --bind {shlex.quote(str(host))} {target}")
        if read_only:
            lines.append(f"mount -o remount,bind,ro {target}")
    environment = {"PATH": f"{VENV}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", **env}
    inner = ["env", "-i", *(f"{k}={v}" for k, v in environment.items()), "sh", "-c", 'cd "$1" && shift && exec "$@"',
             "sh", cwd, *argv]
    lines.append('exec chroot "$R" ' + shlex.join(inner))
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines)]


def _check(out: subprocess.CompletedProcess, what: str) -> None:
    if out.returncode != 0:
        raise TreeBuildError(f"{what} failed ({out.returncode}):\n{out.stderr[-6000:]}\n{out.stdout[-2000:]}")


@contextlib.contextmanager
def _locked(path: Path, mode: int = fcntl.LOCK_EX) -> Iterator[None]:
    with open(path, "a") as f:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(f, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TreeBuildError(f"another build held {path} for {LOCK_WAIT_S} s") from None
                time.sleep(1)
        yield


def tree(log=print) -> Tree:
    """The tree for the current requirements, built first if no run built it yet."""
    reqs = requirements()
    key = tree_key(reqs)
    final = CACHE / key
    if (final / ".complete").exists():
        return Tree(final)
    CACHE.mkdir(parents=True, exist_ok=True)
    with _locked(CACHE / f".{key}.lock"):
        if not (final / ".complete").exists():
            _build(final, key, reqs, log)
            _prune(keep=key, log=log)
    return Tree(final)


def _prune(keep: str, log) -> None:
    """Remove the trees of every other key that no run or build holds now."""
    for lock in CACHE.glob(".*.lock"):
        key = lock.name[1:-len(".lock")]
        if key == keep:
            continue
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # in use: the next build looks again
            shutil.rmtree(CACHE / key, ignore_errors=True)
            lock.unlink(missing_ok=True)
        log(f"trixie tree: removed {key}, an older key's")


def _build(final: Path, key: str, reqs: list[str], log) -> None:
    building = CACHE / f".building-{key}"
    shutil.rmtree(building, ignore_errors=True)  # a builder that died left it (we hold the key's lock)
    debs = CACHE / "debs"
    pip_cache = CACHE / "pip"
    debs.mkdir(exist_ok=True)
    pip_cache.mkdir(exist_ok=True)
    started = time.monotonic()
    argv = ["unshare", "--mount", "--propagation", "private", "debootstrap", "--variant=minbase",
            "--include=" + ",".join(PACKAGES), f"--cache-dir={debs}", SUITE, str(building), debian_mirror()]
    _check(subprocess.run(argv, capture_output=True, text=True, timeout=DEBOOTSTRAP_TIMEOUT_S),
           f"debootstrap {SUITE}")
    log(f"trixie tree: debootstrap {time.monotonic() - started:.0f} s")
    for point in (SRC, JOB, "/root/.cache/pip"):
        (building / point.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (building / "etc/resolv.conf").touch()
    t = Tree(building)
    pip_env = {"PIP_CERT": "/etc/ssl/certs/ca-certificates.crt", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
               "PIP_DEFAULT_TIMEOUT": "180"}
    binds = {"/root/.cache/pip": (pip_cache, False)}
    _check(t.run(["python3.13", "-m", "venv", VENV], with_src=False, timeout=PIP_TIMEOUT_S), "python3.13 -m venv")
    # --no-compile: byte-compiling every module of the requirements (litellm's thousands) took half
    # of pip's time; Python compiles what a run imports, once (the tree is root's to write)
    _check(t.run([t.python, "-m", "pip", "install", "-q", "--no-compile", *reqs], binds=binds, env=pip_env,
                 with_src=False, timeout=PIP_TIMEOUT_S), "pip install " + " ".join(reqs))
    log(f"trixie tree: venv with {' '.join(reqs)} {time.monotonic() - started:.0f} s")
    version = t.run([t.python, "-c", "import sys; print(sys.version.split()[0])"], with_src=False)
    _check(version, "python3.13")
    site = next((building / VENV.lstrip("/") / "lib").glob("python3.*/site-packages"))
    (site / "sandfleet-checkout.pth").write_text(SRC + "\n")  # the checkout a run binds at /src
    (building / ".complete").write_text(json.dumps({"suite": SUITE, "packages": PACKAGES, "requirements": reqs,
                                                    "python": version.stdout.strip(), "recipe": RECIPE}) + "\n")
    building.rename(final)


def main(argv: list[str]) -> int:
    """No arguments: build (or find) the tree and print its root. A command: run it in the tree
    as a client of $SANDFLEET_NATS_URL's platform, in the current directory (at /job)."""
    from sandfleet.config import nats_url

    try:
        found = tree(log=lambda line: print(line, file=sys.stderr))
    except TreeBuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    if not argv:
        print(found.root)
        return 0
    return found.client(argv, workdir=Path.cwd(), url=nats_url(), timeout=None, capture=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
