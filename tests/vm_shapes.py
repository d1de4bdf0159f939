"""Creating a VM whose shape (kernel, layers, devices) may not have a saved machine state yet.

The first create of a shape boots the guest and saves its state; under TCG on a loaded node that
can outlast placement's launch budget (the create fails `InternalError`, or the request times
out), and the node finishes saving anyway, so a later try restores the saved state.
"""

from __future__ import annotations

import asyncio

from sandfleet import errors

RETRY_AFTER_S = 20.0


async def create_vm(fleet, tries: int = 3, **spec):  # type: ignore[no-untyped-def]
    """`fleet.create(**spec)`, tried again while the shape's first boot-and-save may still run."""
    for attempt in range(tries):
        try:
            return await fleet.create(**spec)
        except (errors.InternalError, errors.Timeout):
            if attempt == tries - 1:
                raise
            await asyncio.sleep(RETRY_AFTER_S)
    raise AssertionError("tries must be at least 1")
