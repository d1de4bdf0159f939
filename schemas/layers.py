"""Layers: the catalogue, the cluster-wide layer commands and a node's rootfs commands.

A layer is an EROFS image addressed by the sha256 of the image (`sha256:<hex>`), stored once
in the Object Store bucket `layers`. The KV bucket `layers` maps references to images: key
`<name>` holds the newest build of a name, `<name>.<tag>` a tagged build, so rebuilding a
layer moves its name and never touches the layers under or over it.

`layer.v1.<verb>` is answered by any node's layer-cache (one queue group); composing and
releasing a sandbox's root filesystem goes to the node that runs it:
`node.v1.<node_id>.rootfs.compose|release`, and `node.v1.<node_id>.layers.cache` lists what
that node caches and has mounted. Layer lists are bottom first (base system first, task
last), the order of `SandboxSpec.layers`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.sandbox import SandboxId

BUILD = "layer.v1.build"
LIST = "layer.v1.list"
GET = "layer.v1.get"
REMOVE = "layer.v1.remove"

SERVICE = "layer-cache"
QUEUE_GROUP = "layer-cache"

# node-targeted verbs, used as `schemas.node.subject(node_id, verb)`
ROOTFS_COMPOSE = "rootfs.compose"
ROOTFS_RELEASE = "rootfs.release"
CACHE = "layers.cache"


def node_queue_group(node_id: str) -> str:
    return f"layer-cache-{node_id}"


KV_BUCKET = "layers"
OBJECT_BUCKET = "layers"
UPLOAD_BUCKET = "layer-uploads"  # sources (a directory as a tar, an image archive) on their way to a builder
UPLOAD_TTL_S = 3600  # an upload nobody built from is dropped after this
CHUNK_BYTES = 128 * 1024  # Object Store chunk size; a lazy reader maps offsets to chunks with it

MAX_LAYERS = 16

LayerName = Annotated[str, Meta(min_length=1, max_length=63, pattern=r"^(?!sha256$)[a-z0-9][a-z0-9_\-]*$")]
Tag = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")]
Digest = Annotated[str, Meta(pattern=r"^sha256:[0-9a-f]{64}$")]
# `name`, `name:tag`, or an image digest `sha256:<hex>`
LayerRef = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=128,
        pattern=r"^(sha256:[0-9a-f]{64}|(?!sha256:)[a-z0-9][a-z0-9_\-]{0,62}(:[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63})?)$",
    ),
]
UploadName = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]
DebianPackage = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[a-z0-9][a-z0-9+.\-]*$")]
Suite = Annotated[str, Meta(max_length=64, pattern=r"^[a-z0-9\-]*$")]


class Layer(msgspec.Struct, frozen=True, kw_only=True):
    """The KV value under `<name>` and `<name>.<tag>`: one build of a layer."""

    name: str
    digest: str
    size: int  # bytes of the EROFS image
    built_from: str  # what it was built from, for people: "dir ./tools", "tar app.tar (docker, 3 layers)"
    created_at: float
    tags: list[str] = []
    parent: str = ""  # the reference it was built on (`--on`), as given
    parent_digest: str = ""
    files: int = 0  # entries in the image
    content_bytes: int = 0  # bytes of file content before compression
    current: bool = True  # in listings: `<name>` points at this build (false: only tags do)


# -- build sources --------------------------------------------------------------------


class DirSource(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="dir"):
    """A directory, sent as a tar in the upload bucket; taken literally (no whiteout rules)."""

    upload: UploadName
    path: Annotated[str, Meta(max_length=4096)] = ""  # where it came from, for `built_from` only


class TarSource(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="tar"):
    """A `docker save` / OCI image archive (its layers flattened, whiteouts honoured) or a plain root tar."""

    upload: UploadName
    filename: Annotated[str, Meta(max_length=4096)] = ""


class DebianSource(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="debian"
):
    """A minimal Debian root (debootstrap) with these packages, from the node's configured mirror."""

    packages: Annotated[list[DebianPackage], Meta(max_length=512)] = []
    suite: Suite = ""  # empty: the release the building node runs
    variant: Literal["minbase", "buildd"] = "minbase"


BuildSource = DirSource | TarSource | DebianSource


class BuildRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: LayerName
    source: BuildSource
    on: LayerRef | None = None  # the layer this one goes over (recorded; a tar keeps its whiteouts for it)
    tags: Annotated[list[Tag], Meta(max_length=16)] = []
    compression: Literal["lz4", "lz4hc"] = "lz4"


class BuildReply(msgspec.Struct, frozen=True, kw_only=True):
    layer: Layer
    stored: bool  # false: the store already held an identical image
    seconds: float
    node: str = ""  # the node that built it (and so already caches it)


class ListRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: LayerName | None = None


class LayerList(msgspec.Struct, frozen=True, kw_only=True):
    layers: list[Layer]


class GetRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    ref: LayerRef


class RemoveRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`name` drops the name and all its tags; `name:tag` drops one tag."""

    ref: LayerRef


class RemoveReply(msgspec.Struct, frozen=True, kw_only=True):
    removed: list[str]  # the references dropped
    deleted_images: list[str]  # digests no reference points at any more, deleted from the store


# -- a node's rootfs and cache --------------------------------------------------------


class ComposeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: SandboxId
    layers: Annotated[list[LayerRef], Meta(min_length=1, max_length=MAX_LAYERS)]  # bottom first


class Rootfs(msgspec.Struct, frozen=True, kw_only=True):
    """A composed root: overlayfs at `path` over the layers, writes going to `upper`."""

    sandbox_id: str
    path: str
    upper: str
    layers: list[str]  # digests, bottom first
    created_at: float = 0.0


class ReleaseRootfsRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: SandboxId


class ReleaseRootfsReply(msgspec.Struct, frozen=True, kw_only=True):
    released: bool  # false: this node had no rootfs for that sandbox


class CacheRequest(msgspec.Struct, frozen=True, kw_only=True):
    pass


class CachedImage(msgspec.Struct, frozen=True, kw_only=True):
    digest: str
    size: int  # bytes of the image
    disk_bytes: int  # bytes it takes on the node's disk (less than size while lazily filled)
    last_used: float
    mounted: bool
    users: int  # composed roots using it
    complete: bool = True  # every byte is on the node
    names: list[str] = []  # references that point at it, where the catalogue knows


class CacheListing(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    budget_bytes: int
    used_bytes: int
    images: list[CachedImage]
    rootfs: list[Rootfs]
