"""The names the node turns into paths and kernel object names (cgroup directories, netns
files, crun ids, upper dirs), checked before they are used: a name that passes holds no `/`,
no `..` and nothing a shell or a path would read twice.

The same patterns are the wire types' (`schemas.sandbox.SandboxId`, `NodeId`); neither floor
may import the other, so a unit test holds the two equal.
"""

from __future__ import annotations

import re

SANDBOX_ID_PATTERN = r"^[a-z0-9][a-z0-9\-]*$"
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_\-]*$"
MAX_ID = 64

_SANDBOX_ID = re.compile(SANDBOX_ID_PATTERN)
_NODE_ID = re.compile(NODE_ID_PATTERN)


def is_sandbox_id(name: str) -> bool:
    return len(name) <= MAX_ID and _SANDBOX_ID.match(name) is not None


def is_node_id(name: str) -> bool:
    return len(name) <= MAX_ID and _NODE_ID.match(name) is not None
