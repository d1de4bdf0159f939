"""Building a layer: a source becomes a directory, the directory an EROFS image, the image a store entry.

Sources: an uploaded directory tar or image archive (unpacked by `unpack.py` in a chroot),
a minimal Debian root from `debootstrap` (run in a private mount namespace, so a failed
run cannot leave mounts behind), or `pip install` over the layers a pip layer goes on (run by
`pip_env.py` in its own mount namespace; only the overlay's upper dir becomes the layer). Images are lz4 EROFS with a fixed UUID and build time, so
the same tree always gives the same image and so the same digest; file mtimes are kept.
Builds run one at a time per node: they are disk- and CPU-bound.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import logging
import math
import os
import secrets
import signal
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from linuxnode import userns
from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.layers import (
    MAX_STACK,
    BuildReply,
    BuildRequest,
    DebianSource,
    DirSource,
    ImageSource,
    Layer,
    PipSource,
    StackSource,
    TarSource,
)
from services.layer_cache.cache import ImageCache
from services.layer_cache.mounts import remove_tree
from services.layer_cache.pip_env import strip_overlay_xattrs
from services.layer_cache.recovery import Layout
from services.layer_cache.store import LayerStore

log = logging.getLogger("sandfleet.layer_cache")

FIXED_UUID = "5a4df1ee-0000-4000-8000-000000000000"
CLUSTER_BYTES = 65536
DEBOOTSTRAP_TIMEOUT_S = 1800.0
DEB_CACHE_BYTES = 2 << 30  # the fetched packages a node keeps for its next Debian build (a desktop's are ~600 MB)
PIP_TIMEOUT_S = 1800.0
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TreeStats:
    files: int
    content_bytes: int
    newest_mtime: int  # whole seconds, rounded up


def tree_stats(root: Path) -> TreeStats:
    files, content, newest = 0, 0, 0.0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            files += 1
            content += 0 if stat.S_ISDIR(st.st_mode) else st.st_size
            newest = max(newest, st.st_mtime)
    newest = max(newest, os.lstat(root).st_mtime)
    return TreeStats(files, content, math.ceil(newest))


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


async def run(argv: list[str], what: str, *, env: dict[str, str] | None = None, timeout: float = 600.0,
              failure: ErrorCode = ErrorCode.INTERNAL) -> str:
    """Run a build step in its own process group, so a timeout or a stop kills all it started."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})}, start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()
        raise
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise ServiceError(failure, f"{what} failed ({proc.returncode}): {' | '.join(tail) or 'no output'}")
    return out.decode(errors="replace")


async def make_image(root: Path, out: Path, compression: str = "lz4") -> TreeStats:
    """mkfs.erofs over `root`. The newest mtime as SOURCE_DATE_EPOCH fixes the build time
    without clamping any file's mtime (a Python .pyc must still match its .py)."""
    stats = await asyncio.to_thread(tree_stats, root)
    argv = ["mkfs.erofs", f"-z{compression}", f"-C{CLUSTER_BYTES}", "-U", FIXED_UUID, "--quiet", str(out), str(root)]
    await run(argv, "mkfs.erofs", env={"SOURCE_DATE_EPOCH": str(stats.newest_mtime)})
    return stats


async def unpack(tar: Path, dest: Path, mode: str, keep_whiteouts: bool, max_bytes: int = 0) -> dict:
    argv = [sys.executable, "-m", "services.layer_cache.unpack", "--dest", str(dest), "--mode", mode, str(tar)]
    if keep_whiteouts:
        argv.insert(-1, "--keep-whiteouts")
    if max_bytes:
        argv[-1:-1] = ["--max-bytes", str(max_bytes)]
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    out = await run(argv, "unpacking the archive", env={"PYTHONPATH": pythonpath}, failure=ErrorCode.INVALID_REQUEST)
    return json.loads(out.strip().splitlines()[-1])


# -- Debian -------------------------------------------------------------------------


def apt_archive(sources: dict[str, str]) -> str | None:
    """The main Debian archive URI of this machine's apt sources (deb822 `.sources` or one-line
    `.list` files), skipping security and update suites; None if there is none."""
    for name, text in sorted(sources.items()):
        if name.endswith(".sources"):
            for stanza in text.split("\n\n"):
                fields = {}
                for line in stanza.splitlines():
                    key, sep, value = line.partition(":")
                    if sep and not line.startswith((" ", "#")):
                        fields[key.strip().lower()] = value.strip()
                suites = fields.get("suites", "").split()
                if "deb" in fields.get("types", "").split() and any(_main_suite(s) for s in suites):
                    return fields.get("uris", "").split()[0] if fields.get("uris") else None
        else:
            for line in text.splitlines():
                words = [w for w in line.split() if not w.startswith("[")] if not line.lstrip().startswith("#") else []
                if len(words) >= 3 and words[0] == "deb" and _main_suite(words[2]):
                    return words[1]
    return None


def _main_suite(suite: str) -> bool:
    return not any(part in suite for part in ("-security", "-updates", "-backports", "/updates"))


def read_apt_sources() -> dict[str, str]:
    found = {}
    candidates = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in candidates:
        if path.suffix in (".list", ".sources") and path.is_file():
            found[str(path)] = path.read_text(errors="replace")
    return found


def node_suite() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return "stable"


def prune_debs(cache: Path, keep_bytes: int = DEB_CACHE_BYTES) -> int:
    """Remove the oldest fetched packages until the cache holds at most `keep_bytes`; returns how
    many went. A package removed is fetched again by the build that needs it, nothing more."""
    debs = sorted((p.stat().st_mtime, p.stat().st_size, p) for p in cache.glob("*.deb"))
    total, removed = sum(size for _, size, _ in debs), 0
    for _, size, deb in debs:
        if total <= keep_bytes:
            break
        deb.unlink(missing_ok=True)
        total, removed = total - size, removed + 1
    return removed


UNSAFE_IO_CONF = "etc/dpkg/dpkg.cfg.d/sandfleet-build-unsafe-io"  # present only while the root is built


async def debootstrap(root: Path, source: DebianSource, cache: Path) -> str:
    mirror = os.environ.get("SANDFLEET_DEBIAN_MIRROR") or apt_archive(read_apt_sources())
    if not mirror:
        raise ServiceError(ErrorCode.UNSUPPORTED, "this node has no Debian archive in its apt sources")
    suite = source.suite or node_suite()
    # The packages stay in `cache` for the next build (most builds share the whole base system):
    # debootstrap checks each one found there against the archive's signed indexes before use.
    cache.mkdir(parents=True, exist_ok=True)
    # dpkg in the new root fsyncs every file it unpacks; the root is a scratch tree that becomes
    # an image or is thrown away, so that durability buys nothing (a minbase with python3: 70 ->
    # 58 s). dpkg reads the option from the target's own config dir, which debootstrap keeps.
    unsafe_io = root / UNSAFE_IO_CONF
    unsafe_io.parent.mkdir(parents=True, exist_ok=True)
    unsafe_io.write_text("force-unsafe-io\n")
    argv = ["unshare", "--mount", "--propagation", "private", "debootstrap", f"--variant={source.variant}",
            f"--cache-dir={cache}"]
    if source.packages:
        argv.append("--include=" + ",".join(source.packages))
    argv += [suite, str(root), mirror]
    # A failure is nearly always a package the archive does not have: the caller's to fix.
    try:
        await run(argv, "debootstrap", timeout=DEBOOTSTRAP_TIMEOUT_S, failure=ErrorCode.INVALID_REQUEST)
    finally:
        await asyncio.to_thread(prune_debs, cache)
    for leftover in [unsafe_io, *root.glob("var/cache/apt/archives/*.deb"), *root.glob("var/lib/apt/lists/*_*")]:
        leftover.unlink(missing_ok=True)
    return f"debian {suite} {source.variant}" + (f": {' '.join(source.packages)}" if source.packages else "")


def unmap_ids(root: Path, ids: userns.IdRange) -> int:
    """Give entries owned by host ids of the sandbox range the ids they have inside: a checkpoint
    packs a mapped sandbox's upper dir, whose files are 1048576+ on the host, and a layer holds
    ids as a sandbox sees them (its mount is idmapped back to the range). Returns how many changed."""

    def inside(i: int) -> int:
        return i - ids.host if ids.host <= i < ids.host + ids.count else i

    changed = 0
    for top, dirs, files in os.walk(root):
        for path in ([top] if top == str(root) else []) + [os.path.join(top, n) for n in (*dirs, *files)]:
            st = os.lstat(path)
            if (inside(st.st_uid), inside(st.st_gid)) != (st.st_uid, st.st_gid):
                os.lchown(path, inside(st.st_uid), inside(st.st_gid))
                if not stat.S_ISLNK(st.st_mode):
                    os.chmod(path, stat.S_IMODE(st.st_mode))  # chown clears setgid bits; put back what was there
                changed += 1
    return changed


# -- the build ----------------------------------------------------------------------


class LayerBuilder:
    def __init__(self, layout: Layout, store: LayerStore, images: ImageCache, node_id: str,
                 ids: userns.IdRange | None = None) -> None:
        self.ids = ids  # the node's sandbox range (linuxnode.userns): ids of it in a directory are a sandbox's
        self.layout = layout
        self.store = store
        self.images = images
        self.node_id = node_id
        self._slot = asyncio.Semaphore(1)

    async def build(self, req: BuildRequest) -> BuildReply:
        if isinstance(req.source, DebianSource) and req.on:
            raise ServiceError(ErrorCode.UNSUPPORTED, "a Debian root is a base layer; it cannot go on another layer")
        if isinstance(req.source, PipSource) and not req.on:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "a pip layer goes on a layer with a Python: pass on=LAYER")
        if isinstance(req.source, (ImageSource, StackSource)):
            if req.on:
                raise ServiceError(ErrorCode.INVALID_REQUEST, "an image is a stack of its own; it takes no on=LAYER")
            return await (self._import(req) if isinstance(req.source, ImageSource) else self._stack(req))
        parent_digest = (await self.store.resolve(req.on))[0] if req.on else ""
        async with self._slot:
            started = time.perf_counter()
            work = self.layout.builds / secrets.token_hex(8)
            root, image = work / "root", work / "image.erofs"
            root.mkdir(parents=True)
            try:
                built_from = await self._unpack_source(req, work, root)
                stats = await make_image(root, image, req.compression)
                digest = await asyncio.to_thread(sha256_file, image)
                size = image.stat().st_size
                stored = await self.store.put_image(digest, image)
                self.images.add(digest, image)
            finally:
                await asyncio.to_thread(remove_tree, work)
            layer = Layer(
                name=req.name, digest=digest, size=size, built_from=built_from, created_at=time.time(),
                tags=sorted(set(req.tags)), parent=req.on or "", parent_digest=parent_digest,
                files=stats.files, content_bytes=stats.content_bytes,
            )
            await self.store.record(layer)
            if isinstance(req.source, (DirSource, TarSource)):
                await self.store.delete_upload(req.source.upload)
            seconds = time.perf_counter() - started
            log.info("built layer %s %s (%d bytes, %d files) in %.2fs", req.name, digest, size, stats.files, seconds)
            return BuildReply(layer=layer, stored=stored, seconds=seconds, node=self.node_id)

    async def _unpack_source(self, req: BuildRequest, work: Path, root: Path) -> str:
        source = req.source
        if isinstance(source, DebianSource):
            return await debootstrap(root, source, self.layout.debs)
        if isinstance(source, PipSource):
            return await self._pip(source, req.on or "", work, root)
        archive = work / "source.tar"
        await self.store.fetch_upload(source.upload, archive)
        if isinstance(source, DirSource):
            await unpack(archive, root, "dir", keep_whiteouts=False)
            if self.ids is not None:
                await asyncio.to_thread(unmap_ids, root, self.ids)
            return f"dir {source.path}".strip()
        summary = await unpack(archive, root, "image", keep_whiteouts=bool(req.on))
        described = f"({summary['format']}, {summary['layers']} layer(s))"
        return f"tar {source.filename} {described}" if source.filename else f"tar {described}"

    # -- images ---------------------------------------------------------------------------

    async def _import(self, req: BuildRequest) -> BuildReply:
        from services.layer_cache import importing  # it builds on this module's steps

        source = req.source
        assert isinstance(source, ImageSource)
        async with self._slot:
            started = time.perf_counter()
            work = self.layout.builds / secrets.token_hex(8)
            work.mkdir(parents=True)
            try:
                archive = work / "source.tar"
                await self.store.fetch_upload(source.upload, archive)
                sent = archive.stat().st_size
                image, prepared = await importing.import_image(self.store, req, archive, work, req.compression)
                layer, stored = await importing.store_image(self.store, req, image, prepared, self.node_id, started)
                for digest, made in prepared.made.items():  # the importing node caches what it made
                    if digest not in self.images.images:
                        self.images.add(digest, made)
            finally:
                await asyncio.to_thread(remove_tree, work)
            await self.store.delete_upload(source.upload)
            return BuildReply(layer=layer, stored=stored, seconds=time.perf_counter() - started, node=self.node_id,
                              reused=prepared.reused, upload_bytes=sent)

    async def _stack(self, req: BuildRequest) -> BuildReply:
        from services.layer_cache import importing

        started = time.perf_counter()
        layer = await importing.record_stack(self.store, req)
        return BuildReply(layer=layer, stored=False, seconds=time.perf_counter() - started, node=self.node_id,
                          reused=[p.digest for p in layer.stack])

    # -- pip ----------------------------------------------------------------------------

    async def _pip(self, source: PipSource, on: str, work: Path, root: Path) -> str:
        if not source.requirements and not source.packages:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "a pip layer needs requirements or packages")
        pip = importlib.util.find_spec("pip")
        if pip is None or not pip.submodule_search_locations:
            raise ServiceError(ErrorCode.UNSUPPORTED, "this node's layer-cache has no pip to lend to builds")
        chain = await self._chain(on)
        argv = ["unshare", "--mount", "--pid", "--fork", "--propagation", "private", "--kill-child",
                sys.executable, "-m", "services.layer_cache.pip_env", "--work", str(work),
                "--pip", list(pip.submodule_search_locations)[0]]
        if source.requirements:
            (work / "requirements.txt").write_text(source.requirements)
            argv += ["--requirements", str(work / "requirements.txt")]
        pinned: list[str] = []
        try:
            for digest, size in chain:
                image = await self.images.acquire(digest, size)
                pinned.append(digest)
                argv += ["--lower", str(image.path)]
            pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
            # A failure is nearly always a requirement pip cannot meet, or a layer with no Python.
            await run([*argv, "--", *source.packages], "pip install", env={"PYTHONPATH": pythonpath},
                      timeout=PIP_TIMEOUT_S, failure=ErrorCode.INVALID_REQUEST)
        finally:
            for digest in pinned:
                self.images.unpin(digest)
        await asyncio.to_thread(strip_overlay_xattrs, root)
        what = " ".join(source.packages) + (" -r requirements" if source.requirements else "")
        return f"pip on {on}: {what.strip()}"

    async def _chain(self, on: str) -> list[tuple[str, int]]:
        """(digest, size) of `on` and the layers it was built on, bottom first, as recorded (an
        image's whole stack where one is among them)."""
        chain, _ = await self.store.stack(on)
        known = {layer.digest: layer for layer in (await self.store.all()).values()}
        while len(chain) < MAX_STACK and (layer := known.get(chain[0][0])) is not None and layer.parent_digest:
            parent = known.get(layer.parent_digest)
            if parent is None:
                chain.insert(0, await self.store.resolve(layer.parent_digest))
            else:
                chain[:0] = [(p.digest, p.size) for p in parent.stack] or [(parent.digest, parent.size)]
        return chain
