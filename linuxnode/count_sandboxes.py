"""`python -m linuxnode.count_sandboxes NODE...` prints how many sandbox cgroups those nodes have.

The supervisor behind `sandfleet up` belongs to the SDK package, which imports no node code;
while its launchers destroy a node's sandboxes at shutdown it asks this, about once a second,
to tell a stop that still makes progress from one that hangs.
"""

from __future__ import annotations

import sys

from linuxnode.cgroups import CgroupError, CgroupLayout, list_sandboxes


def count(node_ids: list[str]) -> int:
    try:
        layout = CgroupLayout.detect()
        return sum(len(list_sandboxes(layout, node_id)) for node_id in node_ids)
    except (OSError, CgroupError, ValueError):  # no cgroups here: no sandboxes to wait for
        return 0


if __name__ == "__main__":
    print(count(sys.argv[1:]))
