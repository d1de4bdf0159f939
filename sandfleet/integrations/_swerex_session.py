"""One SWE-ReX bash session on one SDK shell session (sandfleet/_shell.py): its runs, its
interactive programs and its interrupts, with SWE-ReX's observation and exception types.

A run (a BashAction) is checked first with the shell's `-n`, as SWE-ReX checks with `bash -n`,
so a command with a syntax error runs nothing; then it is evaluated in the session's shell (so
cd, exports and functions persist) with stderr joined to stdout, because SWE-ReX reads one
terminal. Its stdin is /dev/null, and the SDK's shell interrupts it at its timeout.

An interactive program (`is_interactive_command`) gets the session's own stdin instead: its
line is written as it is, followed on the same line by a printf of a fresh token, so the token
comes out when the program has ended and the shell reads again. That token plays the part of
SWE-ReX's prompt: until it is seen, every interactive line goes to the program, and a run is
refused. Output is matched against the action's `expect` patterns (regular expressions, as
pexpect takes them) and the token, earliest first; what follows a match is kept for the next.
The program reads a pipe, not a terminal: it must be one that talks over pipes (`python3 -i`,
a read loop, gdb), and nothing is echoed.
"""

from __future__ import annotations

import asyncio
import codecs
import re
import secrets
import time

from sandfleet import errors
from sandfleet._shell import Shell, quote
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SwerexException,
)
from swerex.runtime.abstract import BashAction, BashInterruptAction, BashObservation


class UnsupportedActionError(SwerexException, NotImplementedError):
    """An action this runtime cannot carry out as SWE-ReX would: `expect` on a run that is not
    interactive, a run while an interactive program holds the session, a quit with no program."""


def text(data: bytes) -> str:
    return data.decode(errors="backslashreplace")


def checked_run(command: str, shell: str) -> str:
    """The session script for one run. stderr is non-empty (and stdout empty) only when the
    syntax check failed: the command's own stderr goes to stdout."""
    q = quote(command)
    return (f"if __sandfleet_syntax=$(printf '%s\\n' {q} | {shell} -n 2>&1); then unset __sandfleet_syntax; "
            f"{{ eval {q}\n}} 2>&1; "
            f"else printf '%s\\n' \"$__sandfleet_syntax\" >&2; unset __sandfleet_syntax; false; fi")


class BashSession:
    def __init__(self, name: str, shell: Shell, program: str) -> None:
        self.name, self.shell, self.program = name, shell, program
        self.prompt: str | None = None  # the token an interactive program's end prints; None at the shell
        self.pending = ""  # output read past the last match
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")

    # -- runs ---------------------------------------------------------------------------------

    async def run(self, action: BashAction) -> BashObservation:
        if action.is_interactive_command or action.is_interactive_quit:
            return await self.interact(action)
        if action.expect:
            raise UnsupportedActionError(f"session {self.name!r}: `expect` stops only interactive actions here; "
                                         "a run goes to its command's end")
        if self.prompt is not None and not await self._program_ended():
            raise UnsupportedActionError(f"session {self.name!r} is in an interactive program: "
                                         "quit it (is_interactive_quit) before a run")
        started = time.monotonic()
        try:
            r = await self.shell.run(checked_run(action.command, self.program), timeout_s=action.timeout)
        except errors.Conflict as exc:
            if not self.shell.closed:
                raise
            if action.timeout is not None and time.monotonic() - started >= action.timeout:
                raise CommandTimeoutError(f"timeout after {action.timeout} seconds while running command "
                                          f"{action.command!r} (it would not stop: {exc})") from None
            raise SessionDoesNotExistError(f"session {self.name!r} ended running {action.command!r}: {exc}") from None
        if r.timed_out:
            raise CommandTimeoutError(f"timeout after {action.timeout} seconds while running command {action.command!r}")
        output, complaint = text(r.stdout), text(r.stderr)
        if complaint and not output:
            raise BashIncorrectSyntaxError(
                f"Error (exit code 2) while checking bash command \n{action.command!r}\n"
                f"---- Stderr ----\n{complaint}\n---- Stdout ----\n",
                extra_info={"bash_stdout": "", "bash_stderr": complaint})
        if action.check == "ignore":
            return BashObservation(output=output, exit_code=None)
        if action.check == "raise" and r.exit_code != 0:
            msg = f"Command {action.command!r} failed with exit code {r.exit_code}. Here is the output:\n{output!r}"
            raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return BashObservation(output=output, exit_code=r.exit_code)

    # -- interactive programs -----------------------------------------------------------------

    async def interact(self, action: BashAction) -> BashObservation:
        """SWE-ReX's interactive actions: no exit code (0), the output before the first match,
        and which expect pattern matched ("" when the program ended: SWE-ReX's prompt)."""
        if self.shell.closed:
            raise SessionDoesNotExistError(f"session {self.name!r} has ended")
        async with self.shell.lock:
            if self.prompt is None:
                if action.is_interactive_quit:
                    raise UnsupportedActionError(f"session {self.name!r}: no interactive program to quit")
                self.prompt, self.pending = "__sandfleet_prompt_" + secrets.token_hex(16), ""
                line = f"command eval {quote(action.command)}; printf '%s\\n' {self.prompt}\n"
            else:
                line = action.command + "\n"
            await self.shell.process.send_stdin(line.encode())
            try:
                matched, before = await asyncio.wait_for(self._expect(action.expect), action.timeout)
            except TimeoutError:
                raise CommandTimeoutError(f"timeout after {action.timeout} seconds while running command "
                                          f"{action.command!r}") from None
        return BashObservation(output=before.strip(), exit_code=0, expect_string=matched)

    async def interrupt(self, action: BashInterruptAction) -> BashObservation:
        if self.prompt is None or self.shell.lock.locked():
            # A run interrupts itself at its timeout; one still in flight (another task's run or
            # interactive action) gets SIGINT, as from SWE-ReX's Ctrl-C, and answers its caller
            if self.shell.lock.locked():
                await self.shell.process.signal(2)
            return BashObservation(output="", exit_code=0)
        async with self.shell.lock:
            for _ in range(action.n_retry):
                await self.shell.process.signal(2)
                try:
                    matched, before = await asyncio.wait_for(self._expect(action.expect), action.timeout)
                except TimeoutError:
                    continue
                return BashObservation(output=before.strip(), exit_code=0, expect_string=matched)
        raise CommandTimeoutError(f"session {self.name!r}: failed to interrupt the interactive program")

    async def _expect(self, expect: list[str]) -> tuple[str, str]:
        """Read until the earliest match of `expect` or the prompt: (what matched, the output before)."""
        patterns = [re.compile(p) for p in expect] + [re.compile(re.escape(f"{self.prompt}\n"))]
        stream = self.shell.process.output(self.shell.offset)
        try:
            while True:
                found = [(m.start(), i, m) for i, p in enumerate(patterns) if (m := p.search(self.pending))]
                if found:
                    _, i, m = min(found, key=lambda f: (f[0], f[1]))
                    before, self.pending = self.pending[:m.start()], self.pending[m.end():]
                    if i == len(patterns) - 1:  # the program ended: back at the shell
                        self.prompt, self.pending = None, ""
                        return "", before
                    return expect[i], before
                try:
                    self._take(await anext(stream))
                except StopAsyncIteration:
                    await self.shell.close()
                    raise SessionDoesNotExistError(f"session {self.name!r} ended") from None
        finally:
            await stream.aclose()

    def _take(self, chunk) -> None:
        self.shell.offset = chunk.offset + len(chunk.data)
        self.pending += self._decoder.decode(chunk.data)

    async def _program_ended(self) -> bool:
        """Whether the interactive program has ended since the last match (its prompt is out)."""
        async for chunk in self.shell.process.output(self.shell.offset, follow=False):
            self._take(chunk)
        if f"{self.prompt}\n" in self.pending:
            self.prompt, self.pending = None, ""
            return True
        return False
