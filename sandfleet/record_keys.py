"""Which of the keys the `sandboxes` bucket holds for a sandbox id is that sandbox's record.

A node's bus user may put only keys under its own name (`<node>.<id>`, sandfleet/bus_accounts.py),
so a compromised node cannot change another node's records, but it can put a key of its own
under another node's sandbox id, to have readers send that sandbox's requests to it. A reader
so trusts one node per id: the node the id's batch record names (placement writes those, no node
may), or else the only node that holds a key for the id: an id is unguessable until its owner
has written it, so a copy can only come later, and shows as a second key, which leaves the id
to no one (its readers get "not found" and a warning, not a forger's record). A record whose
value names another node or id than its key is a forgery too. No I/O here: `SandboxStore` reads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas import sandbox
from schemas.sandbox import SandboxBatch, SandboxRecord

log = logging.getLogger("sandfleet.store")

Entry = tuple[SandboxRecord, int]  # a record and its revision (0: as its batch says)


@dataclass
class Resolved:
    """What a set of keys' last entries say: each trusted record (`records`), the ids whose
    trusted key holds a delete or purge marker (`gone`: forgotten, no batch speaks for them),
    and the node trusted for each id (`nodes`), where its record is written."""

    records: dict[str, Entry] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)
    nodes: dict[str, str] = field(default_factory=dict)


def trusted_node(sandbox_id: str, holders: Iterable[str], batch: SandboxBatch | None) -> str | None:
    """The node whose key is `sandbox_id`'s record: its batch's, else the only holder's."""
    if batch is not None:
        return batch.node
    holders = sorted(holders)
    if len(holders) == 1:
        return holders[0]
    if holders:
        log.warning("sandbox %s has records under %d nodes (%s): none is trusted", sandbox_id, len(holders),
                    ", ".join(holders))
    return None


def resolve(own: dict[str, Entry], gone_keys: Iterable[str], batches: dict[str, SandboxBatch]) -> Resolved:
    """`own`: own-record keys (`<node>.<id>`) with their last value; `gone_keys`: those whose
    last entry is a marker; `batches`: token -> batch record, for the ids batch-placed."""
    held: dict[str, dict[str, Entry | None]] = {}
    for key, entry in own.items():
        parts = sandbox.record_key_parts(key)
        if parts is not None:
            held.setdefault(parts[1], {})[parts[0]] = entry
    for key in gone_keys:
        parts = sandbox.record_key_parts(key)
        if parts is not None:
            held.setdefault(parts[1], {}).setdefault(parts[0], None)
    out = Resolved()
    for sandbox_id, by_node in held.items():
        node_id = trusted_node(sandbox_id, by_node, batch_of(sandbox_id, batches))
        if node_id is None:
            continue
        out.nodes[sandbox_id] = node_id
        if node_id not in by_node:
            continue  # a batch member its node has not written yet (the other keys are forgeries)
        entry = by_node[node_id]
        if entry is None:
            out.gone.add(sandbox_id)
        elif entry[0].node != node_id or entry[0].id != sandbox_id:
            log.warning("the record under %s names node %s, sandbox %s: not trusted",
                        sandbox.record_key(node_id, sandbox_id), entry[0].node, entry[0].id)
        else:
            out.records[sandbox_id] = entry
    return out


def batch_of(sandbox_id: str, batches: dict[str, SandboxBatch]) -> SandboxBatch | None:
    """The batch record that placed `sandbox_id`, if it is among `batches` and counts it."""
    placed = sandbox.batch_of(sandbox_id)
    batch = batches.get(placed[0]) if placed is not None else None
    return batch if batch is not None and placed is not None and placed[1] < batch.count else None


def unwritten(sandbox_ids: Iterable[str], resolved: Resolved, batches: dict[str, SandboxBatch]) -> dict[str, Entry]:
    """The ids among `sandbox_ids` with no record of their own yet, as their batches say (revision 0)."""
    out = {}
    for sandbox_id in sandbox_ids:
        if sandbox_id in resolved.records or sandbox_id in resolved.gone:
            continue
        batch = batch_of(sandbox_id, batches)
        if batch is not None:
            placed = sandbox.batch_of(sandbox_id)
            assert placed is not None
            out[sandbox_id] = (batch.record(placed[1]), 0)
            resolved.nodes[sandbox_id] = batch.node
    return out
