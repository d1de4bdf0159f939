"""Image archives tests build themselves: OCI archives, OCI layout directories, `docker save` tars.

Written from the OCI image-layout and image-spec documents (index → manifest → config + layer
blobs, each named by its sha256) and docker's `manifest.json`; a test may corrupt any part.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

Member = tuple[tarfile.TarInfo, bytes | None]


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def file_member(name: str, data: bytes = b"x", mode: int = 0o644, mtime: int = 1_700_000_000) -> Member:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, mtime
    return info, data


def entry(name: str, kind: bytes, mtime: int = 1_700_000_000, **fields: object) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.mtime = kind, mtime
    if kind == tarfile.DIRTYPE:
        info.mode = 0o755
    for k, v in fields.items():
        setattr(info, k, v)
    return info, None


def layer_of_members(members: list[Member]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def layer_of_dir(root: Path) -> bytes:
    """A layer tar of a directory's contents, names relative (`bin/sh`), fixed mtimes."""
    out = io.BytesIO()

    def fixed(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = 1_700_000_000, 0, 0, "", ""
        return info

    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(os.listdir(root)):
            tar.add(root / name, arcname=name, filter=fixed)
    return out.getvalue()


@dataclass
class Image:
    layers: list[bytes]  # uncompressed layer tars, bottom first
    config: dict = field(default_factory=dict)  # the image config's `config` object
    history: list[str] = field(default_factory=list)
    compress: bool = True

    def blobs(self) -> tuple[list[bytes], bytes, bytes]:
        """(layer blobs, config blob, manifest blob)."""
        blobs = [gzip.compress(layer, mtime=0) if self.compress else layer for layer in self.layers]
        config = json.dumps({
            "architecture": "amd64", "os": "linux", "config": self.config,
            "rootfs": {"type": "layers", "diff_ids": [sha(layer) for layer in self.layers]},
            "history": [{"created_by": h} for h in self.history],
        }).encode()
        media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if self.compress else "")
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(config),
                       "size": len(config)},
            "layers": [{"mediaType": media, "digest": sha(b), "size": len(b)} for b in blobs],
        }).encode()
        return blobs, config, manifest

    def layout_files(self, tamper: dict[int, bytes] | None = None) -> dict[str, bytes]:
        """The files of an OCI layout; `tamper` swaps a layer blob's bytes, keeping its name."""
        blobs, config, manifest = self.blobs()
        files = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}',
                 "index.json": json.dumps({"schemaVersion": 2, "manifests": [{
                     "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": sha(manifest),
                     "size": len(manifest)}]}).encode()}
        for i, blob in enumerate(blobs):
            files[f"blobs/sha256/{sha(blob)[7:]}"] = (tamper or {}).get(i, blob)
        files[f"blobs/sha256/{sha(config)[7:]}"] = config
        files[f"blobs/sha256/{sha(manifest)[7:]}"] = manifest
        return files

    def oci_archive(self, path: Path, tamper: dict[int, bytes] | None = None) -> Path:
        return _write_tar(path, self.layout_files(tamper))

    def oci_layout(self, path: Path) -> Path:
        for name, data in self.layout_files().items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_bytes(data)
        return path

    def docker_save(self, path: Path) -> Path:
        """The classic `docker save` form: `<id>/layer.tar` uncompressed, `<config hex>.json`."""
        _, config, _ = Image(self.layers, self.config, self.history, compress=False).blobs()
        files = {f"{sha(config)[7:]}.json": config}
        names = []
        for i, layer in enumerate(self.layers):
            names.append(f"l{i}/layer.tar")
            files[names[-1]] = layer
        files["manifest.json"] = json.dumps([{"Config": f"{sha(config)[7:]}.json", "RepoTags": ["t:1"],
                                              "Layers": names}]).encode()
        return _write_tar(path, files)


def _write_tar(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
