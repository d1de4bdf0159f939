"""A tree upload's tar stream unpacked under a directory fd of a sandbox: schemas/ustar.py's
reader (the client's too), with tree.py's rules for where a member may go. Each member's
parent is opened beneath the top by openat2 with no symlinks at all (`RESOLVE_NO_SYMLINKS`),
so a symlink the stream planted is never written through, and a name that climbs is `Escapes`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import schemas.ustar as ustar  # the one module of schemas/ the node library reads: the wire format of a tree
from linuxnode.process.resolve import INSIDE_TREE, openat
from linuxnode.process.tree import Parents, member_parts


class _InsideTree:
    """schemas.ustar.Beneath by openat2 (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)."""

    def __init__(self, top: int) -> None:
        self._top, self._parents = top, Parents(top)

    def parts(self, name: str) -> list[str]:
        return member_parts(name)

    def parent(self, parts: list[str]) -> int:
        return self._parents.of(parts)

    def open_dir(self, parts: list[str]) -> int:
        return openat(self._top, "/".join(parts) or ".", os.O_RDONLY | os.O_DIRECTORY, INSIDE_TREE)

    def close(self) -> None:
        self._parents.close()


def unpack(next_chunk: Callable[[], bytes | bytearray], top: int) -> None:
    """Every member of the tar stream given by `next_chunk` under the directory `top` (empty,
    made by the caller), then the stream read to its end."""
    ustar.unpack(next_chunk, top, _InsideTree(top))
