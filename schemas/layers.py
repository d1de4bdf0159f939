"""Layers: the catalogue, the cluster-wide layer commands and a node's rootfs commands.

A layer is an EROFS image addressed by the sha256 of the image (`sha256:<hex>`), stored once
in the Object Store bucket `layers`. The KV bucket `layers` maps references to images: key
`<name>` holds the newest build of a name, `<name>.<tag>` a tagged build, so rebuilding a
layer moves its name and never touches the layers under or over it. An image (an OCI import,
a Dockerfile build) is an entry whose `stack` lists its layers bottom first, each an image of
its own, so a reference to it stands for the whole stack and two images share what they share.

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
PUSH = "layer.v1.push"  # copy a layer (and the images under it) from this cluster's store to another's
PULL = "layer.v1.pull"  # and back
KNOWN_DIFFS = "layer.v1.diffs"  # which OCI layers (by diff id) the store has: an import sends only the others
ALL = "layer.v1.>"  # every layer command (what a node serves, in its queue group)

SERVICE = "layer-cache"
QUEUE_GROUP = "layer-cache"

# node-targeted verbs, used as `schemas.node.subject(node_id, verb)`
ROOTFS_COMPOSE = "rootfs.compose"
ROOTFS_RELEASE = "rootfs.release"
CACHE = "layers.cache"
CACHE_DROP = "layers.cache.drop"  # forget every cached image no root uses


def fetch_failed_subject(node_id: str) -> str:
    """`layer.fetch_failed` events: a lazy layer's read that could not get its bytes from the store."""
    return f"events.v1.layer.{node_id}.fetch_failed"


FETCH_MODES = ("lazy", "full")  # a node's `--fetch`: chunks when read (default), or whole images first


def node_queue_group(node_id: str) -> str:
    return f"layer-cache-{node_id}"


KV_BUCKET = "layers"
OBJECT_BUCKET = "layers"
UPLOAD_BUCKET = "layer-uploads"  # sources (a directory as a tar, an image archive) on their way to a builder
UPLOAD_TTL_S = 3600  # an upload nobody built from is dropped after this
# KV: an OCI layer's diff id (hex, the sha256 of its uncompressed tar) → the EROFS image built
# from it (`StackLayer`), so an OCI layer two images share is built and stored once.
DIFF_BUCKET = "layer-diffs"
CHUNK_BYTES = 128 * 1024  # Object Store chunk size; a lazy reader maps offsets to chunks with it

MAX_LAYERS = 16
MAX_STACK = 128  # layers of one imported image (a compose over image names may reach this many)

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
PipPackage = Annotated[str, Meta(min_length=1, max_length=512, pattern=r"^[A-Za-z0-9]")]


class ImageConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What an image's config asks of the processes run in it. A sandbox composed over an image
    name gets it: `env` under every exec/spawn's own env, `working_dir` for those that ask for
    no cwd of their own, `entrypoint` + `cmd` as the command run when one asks for the image's
    command (`image_command=True`). `not_applied` lists, for people, what the image says and
    sandfleet does not do (exposed ports, volumes, a healthcheck, ...), never dropped silently."""

    env: Annotated[list[Annotated[str, Meta(max_length=131_072)]], Meta(max_length=1024)] = []  # "KEY=value"
    working_dir: Annotated[str, Meta(max_length=4096)] = ""
    user: Annotated[str, Meta(max_length=256)] = ""  # as the image says it ("app", "1000:1000")
    entrypoint: Annotated[list[Annotated[str, Meta(max_length=131_072)]], Meta(max_length=4096)] = []
    cmd: Annotated[list[Annotated[str, Meta(max_length=131_072)]], Meta(max_length=4096)] = []
    labels: Annotated[dict[str, Annotated[str, Meta(max_length=4096)]], Meta(max_length=1024)] = {}
    not_applied: Annotated[list[Annotated[str, Meta(max_length=4096)]], Meta(max_length=256)] = []


class StackLayer(msgspec.Struct, frozen=True, kw_only=True):
    """One layer of a named stack: an EROFS image, and the OCI layer it was built from, if any."""

    digest: str
    size: int
    diff_id: str = ""  # sha256 of the OCI layer's uncompressed tar
    created_by: str = ""  # the image history's line for it, for people


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
    # An image (an import, a Dockerfile build): its layers bottom first, the last one `digest`;
    # `layers=["NAME"]` composes all of them. Empty: this layer alone.
    stack: list[StackLayer] = []
    config: ImageConfig | None = None  # the image's config, applied to sandboxes over it


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


class PipSource(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="pip"):
    """A Python environment: `pip install` run with the Python of the layer it goes on (the
    build's `on`, required), whose writes alone become the layer."""

    requirements: Annotated[str, Meta(max_length=1 << 20)] = ""  # the text of a requirements file
    # requirement specifiers (`six`, `idna==3.7`); never an option: they start with a letter or digit
    packages: Annotated[list[PipPackage], Meta(max_length=512)] = []


class ImageSource(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="image"
):
    """An OCI image kept as it is: each of its layers one EROFS image (built once per diff id),
    the whole a named stack with the image's config. The upload is an OCI archive, a `docker
    save` archive, or an OCI layout directory sent as a tar. Every blob is checked against its
    digest and every layer against its diff id; unpacking more than `max_unpacked_bytes` in
    all (0: the node's limit) refuses the image with nothing stored."""

    upload: UploadName
    filename: Annotated[str, Meta(max_length=4096)] = ""
    max_unpacked_bytes: Annotated[int, Meta(ge=0)] = 0


class StackSource(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="stack"
):
    """A name for layers already in the store, bottom first (each a reference; an image name
    stands for its whole stack), with an image config: what a Dockerfile build records."""

    layers: Annotated[list[LayerRef], Meta(min_length=1, max_length=MAX_STACK)]
    config: ImageConfig = ImageConfig()


BuildSource = DirSource | TarSource | DebianSource | PipSource | ImageSource | StackSource


class BuildRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: LayerName
    source: BuildSource
    on: LayerRef | None = None  # the layer this one goes over (recorded; a tar keeps its whiteouts for it; pip runs on it)
    tags: Annotated[list[Tag], Meta(max_length=16)] = []
    compression: Literal["lz4", "lz4hc"] = "lz4"


class BuildReply(msgspec.Struct, frozen=True, kw_only=True):
    layer: Layer
    stored: bool  # false: the store already held an identical image
    seconds: float
    node: str = ""  # the node that built it (and so already caches it)
    reused: list[str] = []  # an image's layers the store already held (built from the same diff id)
    upload_bytes: int = 0  # the size of what the client sent (an import leaves out the layers the store has)


class KnownDiffsRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    diff_ids: Annotated[list[Digest], Meta(max_length=MAX_STACK)]


class KnownDiffsReply(msgspec.Struct, frozen=True, kw_only=True):
    known: list[str]  # those of the asked diff ids the store has a layer for


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


class TransferRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`layer.v1.push` (here → `url`) or `layer.v1.pull` (`url` → here) of one reference; the
    images of the layers it was built on travel too, where the other store lacks them."""

    ref: LayerRef
    url: Annotated[str, Meta(min_length=1, max_length=1024, pattern=r"^(nats|tls|ws|wss)://")]


class TransferReply(msgspec.Struct, frozen=True, kw_only=True):
    layer: Layer  # as recorded in the receiving store
    copied: list[str]  # digests whose images were copied (bottom first); verified on arrival
    present: list[str]  # digests the receiving store already held
    bytes: int  # image bytes copied
    seconds: float


# -- a node's rootfs and cache --------------------------------------------------------


class ComposeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: SandboxId
    layers: Annotated[list[LayerRef], Meta(min_length=1, max_length=MAX_LAYERS)]  # bottom first
    disk_mb: Annotated[int, Meta(ge=0)] = 0  # size of the writable upper dir; 0: no limit of its own


class Rootfs(msgspec.Struct, frozen=True, kw_only=True):
    """A composed root: overlayfs at `path` over the layers, writes going to `upper`."""

    sandbox_id: str
    path: str
    upper: str
    layers: list[str]  # digests, bottom first
    created_at: float = 0.0
    broken: str = ""  # why reads of its lazy layers fail now ("lazy daemon died"); empty: readable
    config: ImageConfig | None = None  # of the last image among the composed references
    # The host uid/gid its layers are idmapped to as their root (the node's user-namespace range,
    # linuxnode.userns): a sandbox on it runs with that id as its root. 0: not idmapped.
    id_host: int = 0


class ReleaseRootfsRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: SandboxId


class ReleaseRootfsReply(msgspec.Struct, frozen=True, kw_only=True):
    released: bool  # false: this node had no rootfs for that sandbox


class CacheRequest(msgspec.Struct, frozen=True, kw_only=True):
    # False: the images only, `rootfs` left empty. The node's heartbeat asks every 2 s for the
    # layers it holds; a root per live sandbox made that reply grow with the node (~1 MB at 3,000).
    roots: bool = True


class CachedImage(msgspec.Struct, frozen=True, kw_only=True):
    digest: str
    size: int  # bytes of the image
    disk_bytes: int  # bytes it takes on the node's disk (less than size while lazily filled)
    last_used: float
    mounted: bool
    users: int  # composed roots using it
    complete: bool = True  # every byte is on the node
    names: list[str] = []  # references that point at it, where the catalogue knows
    lazy: bool = False  # mounted from a FUSE file whose chunks come from the store when read
    fetched_bytes: int = 0  # bytes of it this node got from the store
    written_bytes: int = 0  # bytes of it this node wrote to its disk


class CacheListing(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    budget_bytes: int
    used_bytes: int
    images: list[CachedImage]
    rootfs: list[Rootfs]
    fetch: str = "full"  # the node's fetch mode, "lazy" or "full"


class CacheDropRequest(msgspec.Struct, frozen=True, kw_only=True):
    pass


class CacheDropReply(msgspec.Struct, frozen=True, kw_only=True):
    dropped: list[str]  # digests of the images forgotten (unmounted where idle, files deleted)
    freed_bytes: int
    kept: list[str] = []  # digests still in use by a root


class FetchFailed(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="layer.fetch_failed"):
    """A read of a lazily fetched layer whose chunk the store could not deliver: the reader got EIO."""

    v: int = 1
    node: str
    digest: str
    chunk: int  # index of the chunk (CHUNK_BYTES each)
    # "timeout", "no responders", "not found", "short chunk", "chunk hash mismatch", "lazy daemon died", ...
    reason: str
    sandboxes: list[str] = []  # roots on this node over this layer; the readers that got EIO are among them
    at: float
