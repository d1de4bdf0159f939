"""Shell sessions: one `sh` (or bash) background process with stdin, whose state (cwd,
environment, shell variables, background jobs) lasts between runs.

Each run is written to the shell's stdin as

    command eval '<the command, quoted>' < /dev/null
    printf '<token> %d\\n' $? ; printf '<token> %d\\n' $? >&2

with a fresh random token, and its output is read until the token line has come on both
streams (so stderr written before the end is never cut off). The command cannot forge the end:
it never sees the token before it is written, after it ended. `command eval` keeps a syntax
error from ending a non-interactive shell (POSIX: `command` strips a special built-in's
fatal errors); `< /dev/null` keeps a command that reads stdin from eating the next runs. The
shell traps SIGINT, so an interrupted run (its timeout: SIGINT to the shell's process group,
where the foreground job runs; background jobs ignore it) ends the job, not the session.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from typing import TYPE_CHECKING

from sandfleet import errors
from sandfleet._processes import Process
from schemas import node

if TYPE_CHECKING:
    from sandfleet._sandbox import Sandbox

INTERRUPT_GRACE_S = 2.0  # after each SIGINT, how long a run may take to finish
INTERRUPTS = 3  # SIGINTs sent before the session is given up (a job that ignores them)


def quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


class Shell:
    def __init__(self, process: Process) -> None:
        self.process = process
        self.offset = 0  # where the next run's output starts on the process's count
        self.lock = asyncio.Lock()  # one run at a time
        self.closed = False

    @classmethod
    async def open(cls, sb: Sandbox, shell: str = "sh", *, env: dict[str, str] | None = None,
                   cwd: str = "/workspace") -> Shell:
        process = await sb.spawn([shell], env=env, cwd=cwd, stdin=True, buffer_bytes=4 * node.MAX_OUTPUT_BYTES)
        await process.send_stdin(b"trap ':' INT\n")
        return cls(process)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def run(self, command: str, *, timeout_s: float | None = None) -> node.ExecReply:
        """Run `command` in the session: its exit code and output (each stream capped like an
        exec's). Past `timeout_s` its foreground job gets SIGINT and the result says timed_out;
        the session lives on. Conflict if the session has ended (an `exit`, or a job that would
        not stop); SandboxEnded if the sandbox did."""
        if self.closed:
            raise errors.Conflict(f"shell session {self.pid} is closed")
        async with self.lock:
            return await self._run(command, timeout_s)

    async def _run(self, command: str, timeout_s: float | None) -> node.ExecReply:
        started = time.perf_counter()
        token = "__sandfleet_end_" + secrets.token_hex(16)
        script = (f"command eval {quote(command)} < /dev/null\n"
                  f"printf '{token} %d\\n' $?; printf '{token} %d\\n' $? >&2\n")
        await self.process.send_stdin(script.encode())
        ends = re.compile(re.escape(token.encode()) + rb" (\d+)\n")
        out = {"stdout": bytearray(), "stderr": bytearray()}
        codes: dict[str, int] = {}
        reader = asyncio.ensure_future(self._read(out, codes, ends))
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(reader), timeout_s)
        except TimeoutError:
            timed_out = True
            for _ in range(INTERRUPTS):
                await self.process.signal(2)
                done, _ = await asyncio.wait({reader}, timeout=INTERRUPT_GRACE_S)
                if done:
                    break
            else:
                reader.cancel()
                await self.close()
                raise errors.Conflict(f"shell session {self.pid}: the run would not stop on SIGINT; "
                                      "the session is closed") from None
        await reader  # an error reading (the sandbox ended, the shell exited) is the run's
        stdout, stderr = (bytes(out[s][:node.MAX_OUTPUT_BYTES]) for s in ("stdout", "stderr"))
        return node.ExecReply(exit_code=codes["stdout"], stdout=stdout, stderr=stderr, timed_out=timed_out,
                              truncated=any(len(b) > node.MAX_OUTPUT_BYTES for b in out.values()),
                              duration_ms=(time.perf_counter() - started) * 1000)

    async def _read(self, out: dict[str, bytearray], codes: dict[str, int], ends: re.Pattern) -> None:
        """Output from where the last run ended, until the end line on both streams."""
        async for chunk in self.process.output(self.offset):
            self.offset = chunk.offset + len(chunk.data)
            if chunk.stream in codes:
                continue  # past its end line: output of background jobs, after the run
            buf = out[chunk.stream]
            buf += chunk.data
            found = ends.search(buf)
            if found:
                codes[chunk.stream] = int(found.group(1))
                del buf[found.start():]
                # What came after the end line on this stream belongs to no run
                if len(codes) == 2:
                    return
        self.closed = True
        raise errors.Conflict(f"shell session {self.pid} ended (exit {self.process.exit and self.process.exit.exit_code})")

    async def close(self) -> None:
        """End the session (its shell and, with it, the group's jobs)."""
        if self.closed:
            return
        self.closed = True
        try:
            await self.process.kill()
        except errors.Conflict:
            pass  # it had ended
