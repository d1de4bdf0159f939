"""`make schemas`: one JSON Schema per wire message, for clients in other languages."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec

from schemas import errors, events, files, health, layers, node, reclaim, sandbox, security, violations
from schemas import desktop, ports
from schemas import process as proc
from schemas import pools, pty

MESSAGES: dict[str, object] = {
    "sandbox.CreateRequest": sandbox.CreateRequest,
    "sandbox.CreateReply": sandbox.CreateReply,
    "sandbox.CreateManyRequest": sandbox.CreateManyRequest,
    "sandbox.CreateManyReply": sandbox.CreateManyReply,
    "sandbox.Quota": sandbox.Quota,
    "sandbox.QuotaGetRequest": sandbox.QuotaGetRequest,
    "sandbox.QuotaState": sandbox.QuotaState,
    "sandbox.GetRequest": sandbox.GetRequest,
    "sandbox.ListRequest": sandbox.ListRequest,
    "sandbox.SandboxRecord": sandbox.SandboxRecord,
    "sandbox.SandboxList": sandbox.SandboxList,
    "pools.Pool": pools.Pool,
    "pools.PoolList": pools.PoolList,
    "pools.PoolListRequest": pools.PoolListRequest,
    "pools.PoolClearRequest": pools.PoolClearRequest,
    "pools.PoolClearReply": pools.PoolClearReply,
    "pools.ClaimRequest": pools.ClaimRequest,
    "pools.ClaimReply": pools.ClaimReply,
    "sandbox.SandboxBatch": sandbox.SandboxBatch,
    "events.SandboxEvent": events.AnySandboxEvent,
    "node.NodeInfo": node.NodeInfo,
    "node.NodeBooking": node.NodeBooking,
    "node.LaunchRequest": node.LaunchRequest,
    "node.LaunchReply": node.LaunchReply,
    "node.ExecRequest": node.ExecRequest,
    "node.ExecReply": node.ExecReply,
    "node.WriteFileRequest": node.WriteFileRequest,
    "node.WriteFileReply": node.WriteFileReply,
    "node.ReadFileRequest": node.ReadFileRequest,
    "node.ReadFileReply": node.ReadFileReply,
    "node.DestroyRequest": node.DestroyRequest,
    "node.DestroyReply": node.DestroyReply,
    "node.ConfineRequest": node.ConfineRequest,
    "node.Confinement": node.Confinement,
    "node.ReleaseRequest": node.ReleaseRequest,
    "node.ReleaseReply": node.ReleaseReply,
    "node.NodeSecurity": node.NodeSecurity,
    "errors.ErrorBody": errors.ErrorBody,
    "violations.Violation": violations.Violation,
    "node.QuarantineRequest": node.QuarantineRequest,
    "node.QuarantineReply": node.QuarantineReply,
    "node.PauseRequest": node.PauseRequest,
    "node.PauseReply": node.PauseReply,
    "node.ResumeRequest": node.ResumeRequest,
    "node.ResumeReply": node.ResumeReply,
    "node.SelectedRequest": node.SelectedRequest,
    "node.SelectedReply": node.SelectedReply,
    "node.HintRequest": node.HintRequest,
    "node.HintReply": node.HintReply,
    "node.CheckpointRequest": node.CheckpointRequest,
    "node.Checkpoint": node.Checkpoint,
    "health.SetTimeoutRequest": health.SetTimeoutRequest,
    "health.SetTimeoutReply": health.SetTimeoutReply,
    "health.MetricsRequest": health.MetricsRequest,
    "health.NodeMetricsRequest": health.NodeMetricsRequest,
    "health.SandboxMetrics": health.SandboxMetrics,
    "health.NodeMetrics": health.NodeMetrics,
    "files.UploadRequest": files.UploadRequest,
    "files.Transfer": files.Transfer,
    "files.UploadChunk": files.UploadChunk,
    "files.ChunkAck": files.ChunkAck,
    "files.UploadEnd": files.UploadEnd,
    "files.TransferDone": files.TransferDone,
    "files.DownloadRequest": files.DownloadRequest,
    "files.DownloadChunkRequest": files.DownloadChunkRequest,
    "files.DownloadChunk": files.DownloadChunk,
    "files.CloseRequest": files.CloseRequest,
    "files.Closed": files.Closed,
    "files.ListRequest": files.ListRequest,
    "files.Entry": files.Entry,
    "files.Listing": files.Listing,
    "files.StatRequest": files.StatRequest,
    "files.MkdirRequest": files.MkdirRequest,
    "files.RemoveRequest": files.RemoveRequest,
    "files.RenameRequest": files.RenameRequest,
    "files.Done": files.Done,
    "files.WatchRequest": files.WatchRequest,
    "files.Watching": files.Watching,
    "files.WatchNextRequest": files.WatchNextRequest,
    "files.FileEvent": files.FileEvent,
    "files.WatchEvents": files.WatchEvents,
    "files.WatchCloseRequest": files.WatchCloseRequest,
    "ports.PortOpenRequest": ports.PortOpenRequest,
    "ports.TunnelOpened": ports.TunnelOpened,
    "ports.PortRefused": ports.PortRefused,
    "ports.PortListening": ports.PortListening,
    "process.SpawnRequest": proc.SpawnRequest,
    "process.Exit": proc.Exit,
    "process.ProcessInfo": proc.ProcessInfo,
    "process.ReadRequest": proc.ReadRequest,
    "process.ReadReply": proc.ReadReply,
    "process.RawReadReply": proc.RawReadReply,
    "process.WriteRequest": proc.WriteRequest,
    "process.WriteReply": proc.WriteReply,
    "process.SignalRequest": proc.SignalRequest,
    "process.WaitRequest": proc.WaitRequest,
    "process.ListRequest": proc.ListRequest,
    "process.ListReply": proc.ListReply,
    "security.Policy": security.Policy,
    "security.PolicyGetRequest": security.PolicyGetRequest,
    "security.PolicyListRequest": security.PolicyListRequest,
    "security.PolicyList": security.PolicyList,
    "security.SandboxGetRequest": security.SandboxGetRequest,
    "security.SandboxSecurity": security.SandboxSecurity,
    "security.SecurityAction": security.SecurityAction,
    "layers.Layer": layers.Layer,
    "layers.BuildRequest": layers.BuildRequest,
    "layers.BuildReply": layers.BuildReply,
    "layers.KnownDiffsRequest": layers.KnownDiffsRequest,
    "layers.KnownDiffsReply": layers.KnownDiffsReply,
    "layers.ListRequest": layers.ListRequest,
    "layers.LayerList": layers.LayerList,
    "layers.GetRequest": layers.GetRequest,
    "layers.RemoveRequest": layers.RemoveRequest,
    "layers.RemoveReply": layers.RemoveReply,
    "layers.ComposeRequest": layers.ComposeRequest,
    "layers.Rootfs": layers.Rootfs,
    "layers.ReleaseRootfsRequest": layers.ReleaseRootfsRequest,
    "layers.ReleaseRootfsReply": layers.ReleaseRootfsReply,
    "layers.CacheListing": layers.CacheListing,
    "layers.CacheDropReply": layers.CacheDropReply,
    "layers.FetchFailed": layers.FetchFailed,
    "layers.TransferRequest": layers.TransferRequest,
    "layers.TransferReply": layers.TransferReply,
    "reclaim.ReclaimAction": reclaim.ReclaimAction,
    "reclaim.SavingsRequest": reclaim.SavingsRequest,
    "reclaim.NodeSavings": reclaim.NodeSavings,
    "pty.PtySpawnRequest": pty.PtySpawnRequest,
    "pty.ResizeRequest": pty.ResizeRequest,
    "desktop.ScreenInfoRequest": desktop.ScreenInfoRequest,
    "desktop.ScreenInfo": desktop.ScreenInfo,
    "desktop.ScreenshotRequest": desktop.ScreenshotRequest,
    "desktop.Screenshot": desktop.Screenshot,
    "desktop.MouseRequest": desktop.MouseRequest,
    "desktop.KeysRequest": desktop.KeysRequest,
    "desktop.TypeRequest": desktop.TypeRequest,
    "desktop.InputDone": desktop.InputDone,
}


def render() -> dict[str, str]:
    return {
        f"{name}.json": json.dumps(msgspec.json.schema(kind), indent=2, sort_keys=True) + "\n"
        for name, kind in MESSAGES.items()
    }


def main(out: str) -> None:
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (target / name).write_text(text)
    print(f"wrote {len(MESSAGES)} schemas to {target}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "schemas/json")
