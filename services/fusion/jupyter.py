"""One `/run_jupyter` call: a fresh sandbox over the python layer, the request's files written in,
its cells run in one notebook kernel (services/fusion/notebook_kernel.py, a program of the
sandbox's own python3) within `total_timeout`, each cell's outputs read back, the asked files
fetched, and the sandbox destroyed whatever happened.

The kernel's results file is the sandbox's output, so it is decoded as hostile input: a size
cap (the node's for one file read), typed structs, and a line that is not one cell's result
ends the reading. Status as
SandboxFusion's: Success when every cell ran without an error, Failed when one raised or the
run timed out, SandboxError when the platform could not run it."""

from __future__ import annotations

import importlib.resources
import logging

import msgspec

from sandfleet import errors
from services.fusion import judge, languages
from services.fusion.protocol import (
    CellRunResult,
    CommandRunResult,
    CommandRunStatus,
    RunJupyterRequest,
    RunJupyterResponse,
    RunStatus,
    text,
)

log = logging.getLogger("sandfleet.fusion")

KERNEL = ".fusion-kernel.py"  # in WORKDIR, beside the request's files
CELLS = ".fusion-cells.json"
RESULTS = ".fusion-results.jsonl"
_KERNEL_SOURCE = importlib.resources.files("services.fusion").joinpath("notebook_kernel.py").read_bytes()
_CELL = msgspec.json.Decoder(CellRunResult)


async def run_jupyter(req: RunJupyterRequest, deps: judge.Deps) -> RunJupyterResponse:
    lifetime = int(req.total_timeout) + judge.SETUP_SLACK_S
    async with judge.turn(deps):
        return await judge.in_fresh_sandbox(deps, "python", deps.memory_mb, lifetime, lambda sb: _steps(sb, req),
                                            _sandbox_error)


async def _steps(sb, req: RunJupyterRequest) -> RunJupyterResponse:
    try:
        await judge.write_files(sb, req.files, {KERNEL: _KERNEL_SOURCE, CELLS: msgspec.json.encode(req.cells)})
        r = await sb.exec(["python3", KERNEL, CELLS, RESULTS, repr(max(req.cell_timeout, 0.0))],
                          timeout_s=max(req.total_timeout, 0.001), cwd=languages.WORKDIR)
        driver = CommandRunResult(
            status=CommandRunStatus.TIME_LIMIT_EXCEEDED if r.timed_out else CommandRunStatus.FINISHED,
            execution_time=r.duration_ms / 1000.0, return_code=None if r.timed_out else r.exit_code,
            stdout=text(r.stdout), stderr=text(r.stderr))
        cells = cell_results(await _results(sb))
        ok = (not r.timed_out and r.exit_code == 0 and len(cells) == len(req.cells)
              and not any(cell.error for cell in cells))
        return RunJupyterResponse(status=RunStatus.SUCCESS if ok else RunStatus.FAILED, driver=driver, cells=cells,
                                  files=await judge.fetch(sb, req.fetch_files), executor_pod_name=sb.id)
    except errors.SandfleetError as exc:
        return _sandbox_error(f"{type(exc).__name__}: {exc.message}", sb.id)


async def _results(sb) -> bytes:
    """The results file (read_file refuses one past the node's cap: a SandboxError then)."""
    try:
        return await sb.read_file(languages.in_workdir(RESULTS))
    except errors.NotFound:  # the kernel ended before its first cell did (a timeout, a kill)
        return b""


def cell_results(data: bytes) -> list[CellRunResult]:
    """The kernel's lines, one per cell, up to the first that is not one (a cut-off last line,
    or whatever the sandbox wrote there)."""
    cells = []
    for line in data.split(b"\n"):
        if not line:
            continue
        try:
            cells.append(_CELL.decode(line))
        except msgspec.DecodeError:
            break
    return cells


def _sandbox_error(message: str, sandbox_id: str | None = None) -> RunJupyterResponse:
    return RunJupyterResponse(status=RunStatus.SANDBOX_ERROR, message=message, executor_pod_name=sandbox_id)
