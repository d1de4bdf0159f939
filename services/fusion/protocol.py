"""SandboxFusion's `/run_code` and `/run_jupyter` requests and responses, as its server speaks
them on the wire, and its error shape for a request it cannot take (FastAPI's 422 `{"detail": [...]}`).

Written from the `sandbox-fusion` client's models (`RunCodeRequest`, `RunCodeResponse`,
`CommandRunResult`, `RunStatus`, `RunJupyterRequest`, `CellRunResult`, `RunJupyterResponse`)
and the server's one extra field, `memory_limit_MB`; the client package itself is what the
tests judge them by."""

from __future__ import annotations

import base64
import binascii
import enum
import re
from typing import Literal

import msgspec

# Every language SandboxFusion's request names: one outside this set is a malformed request (422),
# one inside it that this endpoint has no layer for is the sandbox's failure (SandboxError).
Language = Literal[
    "python", "python2", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
    "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit", "kotlin_script",
    "jest", "verilog", "python_gpu", "lean", "swift", "racket", "gtest", "react",
]


class CommandRunStatus(str, enum.Enum):
    FINISHED = "Finished"  # the command exited, with whatever code
    ERROR = "Error"  # it could not be run
    TIME_LIMIT_EXCEEDED = "TimeLimitExceeded"


class RunStatus(str, enum.Enum):
    SUCCESS = "Success"  # every command finished with code 0
    FAILED = "Failed"  # one did not (compile error, non-zero exit, timeout, crash)
    SANDBOX_ERROR = "SandboxError"  # the platform could not judge it; the client raises on this


class RunCodeRequest(msgspec.Struct, frozen=True, kw_only=True):
    # Unknown fields are ignored, as SandboxFusion's server ignores them.
    code: str
    language: Language
    compile_timeout: float = 10.0
    run_timeout: float = 10.0
    memory_limit_MB: int = -1  # noqa: N815 (the wire's name) — -1: the endpoint's default
    stdin: str | None = None
    files: dict[str, str | None] = {}  # path -> base64 content
    fetch_files: list[str] = []


class CommandRunResult(msgspec.Struct, frozen=True, kw_only=True):
    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None  # None when it did not exit by itself (timeout, not started)
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(msgspec.Struct, frozen=True, kw_only=True):
    status: RunStatus
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}  # path -> base64 content, for each fetched file that exists


class RunJupyterRequest(msgspec.Struct, frozen=True, kw_only=True):
    cells: list[str]
    cell_timeout: float = 0.0  # seconds per cell; 0: no limit of its own
    total_timeout: float = 45.0
    kernel: Literal["python3"] = "python3"
    files: dict[str, str | None] = {}
    fetch_files: list[str] = []


class CellRunResult(msgspec.Struct, frozen=True, kw_only=True):
    stdout: str = ""
    stderr: str = ""
    display: list[dict[str, str]] = []  # e.g. {"text/plain": "123"} for a cell ending in `a`
    error: list[dict[str, str | list[str]]] = []  # {"ename", "evalue", "traceback": [...]}


class RunJupyterResponse(msgspec.Struct, frozen=True, kw_only=True):
    status: RunStatus
    message: str = ""
    driver: CommandRunResult | None = None  # the kernel's own run
    cells: list[CellRunResult] = []
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


class BadRequest(Exception):
    """A request SandboxFusion's server would refuse with 422: `detail` is its list of errors."""

    def __init__(self, detail: list[dict]) -> None:
        super().__init__(detail[0]["msg"] if detail else "invalid request")
        self.detail = detail


_AT = re.compile(r" - at `\$(.*)`$")


def decode_request(body: bytes, kind: type = RunCodeRequest):
    """The request of type `kind` in `body`, or BadRequest in FastAPI's shape: `loc` starts with
    "body" and names the field (`["body", "files", "a.txt"]`), `msg` says what is wrong."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise BadRequest([_validation_detail(str(exc))]) from None
    except msgspec.DecodeError as exc:
        raise BadRequest([{"type": "json_invalid", "loc": ["body"], "msg": f"JSON decode error: {exc}"}]) from None
    for path, content in req.files.items():
        if content is not None and decoded_file(content) is None:
            raise BadRequest([{"type": "value_error", "loc": ["body", "files", path], "msg": "not base64"}])
    return req


def _validation_detail(message: str) -> dict:
    loc: list[str | int] = ["body"]
    found = _AT.search(message)
    if found:
        message = message[: found.start()]
        for part in re.findall(r"\.(\w+)|\[(\d+)\]|\[('[^']*'|\"[^\"]*\")\]", found.group(1)):
            name, index, key = part
            loc.append(name or (int(index) if index else key[1:-1]))
    kind = "missing" if message.startswith("Object missing required field") else "value_error"
    if kind == "missing":
        loc.append(message.rsplit("`", 2)[-2])
        message = "Field required"
    return {"type": kind, "loc": loc, "msg": message}


def decoded_file(content: str) -> bytes | None:
    try:
        return base64.b64decode(content, validate=True)
    except (binascii.Error, ValueError):
        return None


def encoded_file(data: bytes) -> str:
    return base64.b64encode(data).decode()


def text(data: bytes) -> str:
    """A command's output as SandboxFusion reports it: text, undecodable bytes replaced."""
    return data.decode("utf-8", errors="replace")
