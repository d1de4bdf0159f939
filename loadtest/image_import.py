"""Importing OCI images: time and store bytes of a ~500 MB, 5-layer image and of a second image
sharing its first 4 layers; then container create from the imported image vs from the
`--debian` layer its base came from.

    .venv/bin/python -m loadtest.image_import [--layer-mb 90] [--packages python3] [--creates 20]

Both images are built here as OCI archives: layer 1 is the root of a `--debian` layer of
`--packages` (composed on the node and tarred, gzip), layers 2-5 hold `--layer-mb` MiB of
random bytes each (incompressible, uncompressed tars); the second image has the same layers
1-4 and its own fifth. Store bytes are the Object Store's object sizes before and after each
import. Creates alternate between the three roots (the 5-layer image, a 1-layer image of the
Debian root alone, and the `--debian` layer itself), each a container create → exec `true` →
destroy, one at a time; create latency is reported per root.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import hashlib
import io
import json
import os
import secrets
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import sandfleet
from loadtest.platform import running_platform
from loadtest.report import percentiles, print_table, write_json
from sandfleet.layers_client import Layers
from schemas.layers import OBJECT_BUCKET

DEBIAN = "bench-img-debian"


def sha(data_or_path: bytes | Path) -> str:
    if isinstance(data_or_path, Path):
        with open(data_or_path, "rb") as f:
            return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
    return "sha256:" + hashlib.sha256(data_or_path).hexdigest()


def random_layer(path: Path, mib: int, seed: str) -> Path:
    """A layer tar of `mib` MiB of random bytes in 8 MiB files under /data/<seed>/."""
    with tarfile.open(path, "w") as tar:
        for d in ("data", f"data/{seed}"):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
            tar.addfile(info)
        left, n = mib << 20, 0
        while left > 0:
            size = min(left, 8 << 20)
            info = tarfile.TarInfo(f"data/{seed}/blob-{n:03d}")
            info.size, info.mode, info.mtime = size, 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(os.urandom(size)))
            left, n = left - size, n + 1
    return path


def root_layer(root: Path, path: Path) -> Path:
    """A gzip layer tar of a composed root's tree (what `docker export` of it would hold)."""
    with gzip.GzipFile(path, "wb", compresslevel=1, mtime=0) as gz, tarfile.open(fileobj=gz, mode="w",
                                                                            format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(os.listdir(root)):  # mount points stay, what the node mounts there does not
            tar.add(root / name, arcname=name, recursive=name not in ("proc", "sys", "dev"))
    return path


def diff_id(path: Path) -> str:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def oci_archive(out: Path, layers: list[Path], config: dict) -> Path:
    """An OCI archive (image layout in a tar) of these layer blobs, bottom first."""
    image_config = json.dumps({"architecture": "amd64", "os": "linux", "config": config,
                               "rootfs": {"type": "layers", "diff_ids": [diff_id(p) for p in layers]}}).encode()
    descriptors = [{"mediaType": "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if p.suffix == ".gz" else ""),
                    "digest": sha(p), "size": p.stat().st_size} for p in layers]
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": sha(image_config), "size": len(image_config)},
                           "layers": descriptors}).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                                           "digest": sha(manifest), "size": len(manifest)}]}).encode()
    with tarfile.open(out, "w") as tar:
        for name, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index),
                           (f"blobs/sha256/{sha(image_config)[7:]}", image_config),
                           (f"blobs/sha256/{sha(manifest)[7:]}", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for p, d in zip(layers, descriptors):
            tar.add(p, arcname=f"blobs/sha256/{d['digest'][7:]}")
    return out


async def store_bytes(fleet: sandfleet.Fleet) -> int:
    bucket = await fleet.bus.js.object_store(OBJECT_BUCKET)
    try:
        return sum(o.size for o in await bucket.list())
    except Exception as exc:  # nats-py raises NotFoundError for an empty bucket
        if type(exc).__name__ == "NotFoundError":
            return 0
        raise


async def timed_import(fleet: sandfleet.Fleet, layers: Layers, name: str, archive: Path) -> dict:
    before = await store_bytes(fleet)
    started = time.perf_counter()
    reply = await layers.import_image(name, archive)
    seconds = time.perf_counter() - started
    added = await store_bytes(fleet) - before
    print(f"imported {name}: {seconds:.1f}s ({reply.seconds:.1f}s in the layer-cache), {len(reply.layer.stack)} "
          f"layers ({len(reply.reused)} shared), store +{added / 2**20:.1f} MiB", flush=True)
    return {"seconds": round(seconds, 2), "layer_cache_s": round(reply.seconds, 2), "store_bytes_added": added,
            "layers": len(reply.layer.stack),
            "shared": len(reply.reused), "archive_bytes": archive.stat().st_size,
            "content_bytes": reply.layer.content_bytes}


async def creates(fleet: sandfleet.Fleet, roots: dict[str, str], n: int) -> dict[str, dict]:
    samples: dict[str, list[float]] = {label: [] for label in roots}
    for i in range(n):
        for label, layer in (list(roots.items()) if i % 2 == 0 else list(reversed(roots.items()))):
            started = time.perf_counter()
            sb = await fleet.create(isolation="container", layers=[layer], memory_mb=256)
            samples[label].append((time.perf_counter() - started) * 1000)
            r = await sb.exec(["true"])
            await sb.destroy()
            if r.exit_code != 0:
                raise RuntimeError(f"exec true in {label} exited {r.exit_code}: {r.stderr[-200:]!r}")
    return {label: {**percentiles(s), "mean": round(statistics.fmean(s), 2)} for label, s in samples.items()}


async def run(url: str, args: argparse.Namespace, work: Path) -> dict:
    node = args.node_id
    async with sandfleet.connect(url, name="bench-image-import") as fleet:
        layers = Layers(fleet.bus)
        print(f"building {DEBIAN} from Debian: {' '.join(args.packages) or '(minbase)'}", flush=True)
        started = time.perf_counter()
        debian = await layers.build_debian(DEBIAN, args.packages)
        debian_s = time.perf_counter() - started
        root = await layers.compose(node, f"bench-export-{secrets.token_hex(3)}", [DEBIAN])
        try:
            base = await asyncio.to_thread(root_layer, Path(root.path), work / "l1.tar.gz")
        finally:
            await layers.release(node, root.sandbox_id)
        shared = [base] + [await asyncio.to_thread(random_layer, work / f"l{i}.tar", args.layer_mb, f"l{i}")
                           for i in range(2, 5)]
        own_a = await asyncio.to_thread(random_layer, work / "a5.tar", args.layer_mb, "a5")
        own_b = await asyncio.to_thread(random_layer, work / "b5.tar", args.layer_mb, "b5")
        config = {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], "Cmd": ["bash"]}
        a = oci_archive(work / "a.tar", [*shared, own_a], config)
        b = oci_archive(work / "b.tar", [*shared, own_b], config)
        alone = oci_archive(work / "debian-only.tar", [base], config)
        for p in (*shared, own_a, own_b):
            p.unlink()
        first = await timed_import(fleet, layers, "bench-img-a", a)
        second = await timed_import(fleet, layers, "bench-img-b", b)
        await timed_import(fleet, layers, "bench-img-debian-only", alone)
        roots = {"image (5 layers)": "bench-img-a", "image (debian root only)": "bench-img-debian-only",
                 "--debian layer": DEBIAN}
        await creates(fleet, roots, 2)  # warm: every layer fetched and mounted once
        created = await creates(fleet, roots, args.creates)
        return {"debian_layer": {"build_s": round(debian_s, 1), "image_bytes": debian.layer.size,
                                 "content_bytes": debian.layer.content_bytes},
                "first_import": first, "second_import": second, "create_ms": created}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer-mb", type=int, default=90, help="MiB of random bytes in each of layers 2-5")
    ap.add_argument("--packages", nargs="*", default=["python3"], help="Debian packages of the base layer")
    ap.add_argument("--creates", type=int, default=20, help="creates per root")
    ap.add_argument("--node-id", default="bench-img")
    ap.add_argument("--out", type=Path, default=Path("results/image_import.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sandfleet-image-bench-", dir="/var/tmp") as tmp, \
            running_platform(args.node_id) as (url, _):
        got = asyncio.run(run(url, args, Path(tmp)))
    first, second = got["first_import"], got["second_import"]
    print_table("image import", ["image", "layers (shared)", "archive MiB", "import s", "in layer-cache s",
                                 "store +MiB"], [
        [label, f"{i['layers']} ({i['shared']})", i["archive_bytes"] / 2**20, i["seconds"], i["layer_cache_s"],
         i["store_bytes_added"] / 2**20]
        for label, i in (("first", first), ("second, 4 layers shared", second))
    ])
    print_table("container create (ms)", ["root", "p50", "p95", "mean"],
                [[label, c["p50"], c["p95"], c["mean"]] for label, c in got["create_ms"].items()])
    print(f"\nwrote {write_json(args.out, 'image_import', vars(args) | {'out': str(args.out)}, got)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
