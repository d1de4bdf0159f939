"""Importing an OCI image: each of its layers one EROFS layer, the whole a named stack.

An OCI layer is built once per diff id: the `layer-diffs` KV maps a diff id to the EROFS image
made from it, so a second image on the same base costs only its own layers, in the store and
(same digest, same mount) in every node's cache and page cache; the SDK asks which diff ids the
store has (`layer.v1.diffs`) and leaves their blobs out of what it sends, and a blob left out is
taken as the store's layer of that diff id, which the config names (and nothing else). An import is all or nothing:
every blob is hashed first, every new layer is unpacked and made an image in the work
directory, and only then is anything stored or recorded, so a bad layer or a bomb in the
fifth layer leaves the store as it was.

Unpacking a layer keeps its OCI whiteouts as overlay whiteouts (`unpack.py --mode layer`), so
the stack composes as the image reads. The image config is recorded with the stack and handed
to sandboxes over it with their root (`Rootfs.config`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.layers import BuildRequest, ImageConfig, ImageSource, Layer, StackLayer, StackSource
from sandfleet import oci_archive as oci
from services.layer_cache.build import make_image, sha256_file, unpack
from services.layer_cache.store import LayerStore

log = logging.getLogger("sandfleet.layer_cache")

DEFAULT_MAX_UNPACKED_BYTES = 16 << 30  # SANDFLEET_IMPORT_MAX_BYTES overrides it per node


def node_limit() -> int:
    return int(os.environ.get("SANDFLEET_IMPORT_MAX_BYTES") or DEFAULT_MAX_UNPACKED_BYTES)


@dataclass
class Prepared:
    """The layers of an import, each either already in the store or made in the work directory."""

    parts: list[StackLayer] = field(default_factory=list)
    made: dict[str, Path] = field(default_factory=dict)  # digest → image file to store
    reused: list[str] = field(default_factory=list)
    files: int = 0
    content_bytes: int = 0


async def import_image(store: LayerStore, req: BuildRequest, archive: Path, work: Path,
                       compression: str) -> tuple[oci.OciImage, Prepared]:
    """Check the archive and make every layer the store lacks; nothing is stored yet."""
    source = req.source
    assert isinstance(source, ImageSource)
    limit = budget = min(source.max_unpacked_bytes or node_limit(), node_limit())
    outer = await asyncio.to_thread(tarfile.open, archive, "r:*")
    try:
        names = await asyncio.to_thread(oci.member_names, outer)
        image = await asyncio.to_thread(oci.read_image, outer, names)
        known_diffs = {layer.diff_id: await store.by_diff_id(layer.diff_id) for layer in image.layers}
        for layer in image.layers:
            if oci.has_blob(names, layer):
                await asyncio.to_thread(oci.check_blob, outer, names, layer)
            elif known_diffs[layer.diff_id] is None:
                raise oci.ImageError(f"the archive lacks layer {layer.member} and the store has no layer of "
                                     f"its diff id {layer.diff_id}")
        prepared = Prepared()
        made_by_diff: dict[str, StackLayer] = {}  # an image listing one layer twice makes it once
        for index, layer in enumerate(image.layers):
            known = made_by_diff.get(layer.diff_id) or known_diffs[layer.diff_id]
            if known is not None:
                prepared.parts.append(StackLayer(digest=known.digest, size=known.size, diff_id=layer.diff_id,
                                                 created_by=layer.created_by))
                if known.digest not in prepared.made and known.digest not in prepared.reused:
                    prepared.reused.append(known.digest)
                continue
            part, image_file, stats = await _make_layer(outer, names, layer, work / f"layer-{index}", budget,
                                                        compression)
            budget -= stats.content_bytes
            made_by_diff[layer.diff_id] = part
            prepared.parts.append(part)
            prepared.made[part.digest] = image_file
            prepared.files += stats.files
            prepared.content_bytes += stats.content_bytes
    except oci.TooBig as exc:
        raise ServiceError(ErrorCode.INVALID_REQUEST,
                           f"decompression limit: {exc} (the import unpacks {limit} bytes at most)") from None
    except oci.Unsupported as exc:
        raise ServiceError(ErrorCode.UNSUPPORTED, str(exc)) from None
    except (oci.ImageError, tarfile.TarError, KeyError) as exc:
        raise ServiceError(ErrorCode.INVALID_REQUEST, f"not a valid image: {exc}") from None
    finally:
        outer.close()
    prepared.parts = upper_copies(prepared.parts)
    return image, prepared


def upper_copies(parts: list[StackLayer]) -> list[StackLayer]:
    """The stack with a layer that appears twice kept only where it is highest: its lower copy
    changes nothing (every path it has, whiteouts included, the upper copy sets again), and a
    root takes each image once."""
    highest = {part.digest: i for i, part in enumerate(parts)}
    return [part for i, part in enumerate(parts) if highest[part.digest] == i]


async def _make_layer(outer: tarfile.TarFile, names: dict[str, str], layer: oci.OciLayer, work: Path, budget: int,
                      compression: str):
    work.mkdir(parents=True)
    tar, root, image_file = work / "layer.tar", work / "root", work / "image.erofs"
    written = await asyncio.to_thread(oci.extract_layer, outer, names, layer, tar, budget)
    await unpack(tar, root, "layer", keep_whiteouts=True, max_bytes=max(budget, 1))
    tar.unlink()
    if written > budget:  # extract_layer refuses first; kept so the budget can never go negative unseen
        raise oci.TooBig(f"layer {layer.member} is past the import's limit")
    stats = await make_image(root, image_file, compression)
    digest = await asyncio.to_thread(sha256_file, image_file)
    part = StackLayer(digest=digest, size=image_file.stat().st_size, diff_id=layer.diff_id,
                      created_by=layer.created_by)
    return part, image_file, stats


async def store_image(store: LayerStore, req: BuildRequest, image: oci.OciImage, prepared: Prepared,
                      node_id: str, started: float) -> tuple[Layer, bool]:
    """Store the made layers, map their diff ids, and record the stack under the name."""
    stored, done = False, set()
    for part in prepared.parts:
        if part.digest in prepared.made and part.digest not in done:
            done.add(part.digest)
            stored = await store.put_image(part.digest, prepared.made[part.digest]) or stored
            await store.record_diff_id(part)
    source = req.source
    assert isinstance(source, ImageSource)
    top = prepared.parts[-1]
    new = len(prepared.parts) - len(prepared.reused)
    what = f"image {source.filename} " if source.filename else "image "
    layer = Layer(
        name=req.name, digest=top.digest, size=top.size, created_at=time.time(), tags=sorted(set(req.tags)),
        built_from=f"{what}({image.format}, {len(prepared.parts)} layer(s), {new} new)",
        files=prepared.files, content_bytes=prepared.content_bytes, stack=prepared.parts, config=image.config,
    )
    await store.record(layer)
    log.info("imported image %s: %d layers (%d new) in %.2fs on %s", req.name, len(prepared.parts), new,
             time.perf_counter() - started, node_id)
    return layer, stored


async def record_stack(store: LayerStore, req: BuildRequest) -> Layer:
    """A name for layers already stored (a Dockerfile build's result), with its config."""
    source = req.source
    assert isinstance(source, StackSource)
    parts: list[StackLayer] = []
    for ref in source.layers:
        found, _ = await store.stack(ref)
        parts += [StackLayer(digest=digest, size=size) for digest, size in found]
    parts = upper_copies(parts)
    top = parts[-1]
    layer = Layer(name=req.name, digest=top.digest, size=top.size, created_at=time.time(), tags=sorted(set(req.tags)),
                  built_from=f"stack of {' < '.join(source.layers)}", stack=parts,
                  config=source.config if source.config != ImageConfig() else None)
    await store.record(layer)
    return layer
