"""`sandfleet shell ID [-- argv]`: an interactive terminal in a sandbox (sandfleet/_pty.py).

The local terminal goes into raw mode for as long as the remote one runs, and is put back on
the way out whatever happens: every key, Ctrl-C included, is one byte sent to the sandbox
(where the remote terminal turns it into SIGINT for its foreground job, not for this CLI); a
window change here (SIGWINCH) resizes the remote terminal; the CLI exits with the remote
command's code. With no terminal here (stdin piped), it runs plainly: stdin is typed into the
remote terminal as it comes, its end as Ctrl-D, and the screen's bytes go to stdout as they are.
A CLI that goes first (its output closed, `| head`) hangs the remote terminal up (SIGHUP).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import termios
import threading
import tty

from sandfleet import client, errors
from sandfleet._pty import Terminal

READ_CHUNK = 65536
EOF_KEY = b"\x04"  # Ctrl-D: end of input, as a terminal's line discipline takes it


def register(sub: argparse._SubParsersAction) -> None:
    shell = sub.add_parser("shell", help="an interactive terminal in a sandbox (default command: sh)")
    shell.add_argument("--nats", default=None, help="NATS URL (default $SANDFLEET_NATS_URL or nats://127.0.0.1:4222)")
    shell.add_argument("--cwd", default="/workspace")
    shell.add_argument("id")
    shell.add_argument("argv", nargs=argparse.REMAINDER, help="-- command to run instead of sh")
    shell.set_defaults(func=_shell)


def _shell(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    interactive = os.isatty(sys.stdin.fileno()) and os.isatty(sys.stdout.fileno())
    try:
        return asyncio.run(_session(args, argv or ["sh"], interactive))
    except errors.SandboxEnded as exc:
        print(f"\r\nsandfleet shell: {exc.message}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # whoever read our output went away (`| head`): end quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


async def _session(args: argparse.Namespace, argv: list[str], interactive: bool) -> int:
    async with client.connect(args.nats, name="sandfleet-shell") as fleet:
        sb = await fleet.sandbox(args.id)
        cols, rows = _size() if interactive else (80, 24)
        term = await sb.pty(argv, cols=cols, rows=rows, cwd=args.cwd,
                            env={"TERM": os.environ.get("TERM") or "xterm-256color"})
        stdin = sys.stdin.fileno()
        saved = termios.tcgetattr(stdin) if interactive else None
        keys: asyncio.Queue[bytes | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        sender = asyncio.create_task(_send_keys(term, keys))
        try:
            if saved is not None:
                tty.setraw(stdin, termios.TCSANOW)
                loop.add_signal_handler(signal.SIGWINCH, lambda: loop.create_task(_resize(term)))
                loop.add_reader(stdin, _read_keys, stdin, keys, loop)
            else:  # a file or a pipe: read by a thread (epoll takes no regular file) that never holds up the exit
                threading.Thread(target=_pipe_keys, args=(stdin, keys, loop), daemon=True).start()
            out = sys.stdout.fileno()
            async for data in term.output():
                _write_all(out, data)
            exit = term.exit or await term.wait()
        finally:
            if saved is not None:
                loop.remove_reader(stdin)
                loop.remove_signal_handler(signal.SIGWINCH)
                termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
            keys.put_nowait(None)
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, errors.SandfleetError):
                await sender
            if term.exit is None:  # we are going away first (our reader did, or an error): hang up, as a modem would
                with contextlib.suppress(errors.SandfleetError):
                    await term.signal(signal.SIGHUP)
        return exit.exit_code if 0 <= exit.exit_code < 256 else 1


def _size() -> tuple[int, int]:
    size = os.get_terminal_size(sys.stdin.fileno())
    return max(1, min(size.columns, 1000)), max(1, min(size.lines, 1000))


async def _resize(term: Terminal) -> None:
    with contextlib.suppress(errors.SandfleetError):  # it ended meanwhile: the output loop sees it
        await term.resize(*_size())


def _read_keys(fd: int, keys: asyncio.Queue[bytes], loop: asyncio.AbstractEventLoop) -> None:
    try:
        data = os.read(fd, READ_CHUNK)
    except BlockingIOError:
        return
    except OSError:
        data = b""
    if not data:  # stdin ended (piped input): the remote terminal's end of input, once
        loop.remove_reader(fd)
        data = EOF_KEY
    keys.put_nowait(data)


def _pipe_keys(fd: int, keys: asyncio.Queue[bytes], loop: asyncio.AbstractEventLoop) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed: the session is over
        while data := os.read(fd, READ_CHUNK):
            loop.call_soon_threadsafe(keys.put_nowait, data)
        loop.call_soon_threadsafe(keys.put_nowait, EOF_KEY)


async def _send_keys(term: Terminal, keys: asyncio.Queue[bytes | None]) -> None:
    """Keystrokes in the order typed, whatever arrived meanwhile sent in one write, until None:
    the NATS client swallows a cancel that lands mid-publish, so a cancel alone may not end it."""
    while True:
        typed = [await keys.get()]
        while not keys.empty():
            typed.append(keys.get_nowait())
        if None in typed:
            return  # the session is over: keys not sent yet have nobody to go to
        try:
            await term.write(b"".join(typed))
        except errors.Conflict:  # it ended: nothing more to type into
            return


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue
