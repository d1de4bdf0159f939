"""Terminals (PTYs) and `sandfleet shell`, on the real platform for both `process` (host view) and
`container` (busybox base layer) sandboxes.

The pty's master is opened by the node on the sandbox's own devpts and its slave is the shell's
controlling terminal inside: `tty` names /dev/pts/N there, `stty size` follows resizes, Ctrl-C
typed as a byte interrupts the foreground job and the shell goes on. `sandfleet shell` is driven
for real through Debian's tmux: keys sent to its pane, the screen read back. Every bad input
gets a typed error that changes nothing, and destroying the sandbox ends its terminals.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from linuxnode.process import protocol
from linuxnode.process.protocol import SpawnCommand, TerminalCommand
from linuxnode.process.terminal import check_size
from sandfleet import errors
from tests.kernel import require
from tests.layer_trees import APPLETS, busybox_layer, level_sandbox

BASE = "pty-base"
CLI = [sys.executable, "-m", "sandfleet.cli"]
ROOT = Path(__file__).resolve().parent.parent
LEVELS = ["process", "container"]
SCREEN_WAIT_S = 60.0  # a hang guard only (what a screen shows is never timed)

async def _busybox_base(fleet, tmp_path_factory) -> str:
    return await busybox_layer(fleet, tmp_path_factory, BASE, hostname="ct",
                               applets=(*APPLETS, "tty", "stty", "cut", "sed"))


@pytest.fixture(params=LEVELS)
async def sb(request, fleet, tmp_path_factory):
    async with level_sandbox(fleet, request.param, lambda: _busybox_base(fleet, tmp_path_factory)) as box:
        yield box


def test_a_terminal_request_to_the_spawner_survives_its_wire_form_with_its_fds_in_order():
    request = TerminalCommand(cgroup_procs=("/sys/fs/cgroup/x/cgroup.procs",), cwd="/workspace", argv=("sh",),
                              env={"TERM": "xterm"}, report=10, pidfd=11, root=12, stdin=13, stdout=14, stderr=15,
                              control=16)
    data, fds = protocol.encode(request)
    assert protocol.decode(data, fds) == request and fds == [10, 11, 12, 13, 14, 15, 16]
    assert TerminalCommand.TYPE == "terminal" and TerminalCommand.FDS == SpawnCommand.FDS


def test_terminal_sizes_outside_1_to_1000_are_refused_by_the_node_library():
    check_size(1, 1), check_size(1000, 1000)
    for cols, rows in ((0, 24), (80, 0), (1001, 24), (80, 10**6), (True, 24), (80.0, 24)):
        with pytest.raises(ValueError):
            check_size(cols, rows)


class Screen:
    """What a terminal has printed so far, read on until something shows up."""

    def __init__(self, term) -> None:
        self.term = term
        self.text = ""
        self._chunks = term.output().__aiter__()

    async def until(self, pattern: str) -> re.Match:
        """Read until `pattern` (a regex) matches what was printed after the last match."""
        try:
            async with asyncio.timeout(SCREEN_WAIT_S):
                while not (found := re.search(pattern, self.text)):
                    self.text += (await self._chunks.__anext__()).decode(errors="replace")
        except TimeoutError:
            raise AssertionError(f"{pattern!r} never showed; the screen printed {self.text!r}") from None
        self.text = self.text[found.end():]
        return found


async def test_a_terminal_is_the_controlling_tty_of_its_shell(sb):
    term = await sb.pty(["sh"], cols=120, rows=40)
    screen = Screen(term)
    # `$((...))` and quotes keep each answer apart from the echo of what was typed.
    await term.write(b"tty; stty size; [ -t 0 ] && [ -t 1 ] && [ -t 2 ] && echo 'is''atty'; echo $TERM\r")
    assert (await screen.until(r"/dev/pts/\d+"))
    assert (await screen.until(r"\b40 120\r\n"))
    assert (await screen.until(r"isatty\r\n"))
    assert (await screen.until(r"xterm-256color\r\n"))
    # A session leader with the terminal as its controlling tty (`ps -o` differs by level: /proc).
    await term.write(b"echo sid=$(cut -d' ' -f6 /proc/$$/stat) pid=$$ tpgid=$(cut -d' ' -f8 /proc/$$/stat)\r")
    found = await screen.until(r"sid=(\d+) pid=(\d+) tpgid=(\d+)")
    assert found[1] == found[2] == found[3]
    # Confined as any exec: no capabilities, no_new_privs, the seccomp filter.
    await term.write(b"cat /proc/$$/status; echo end$((1+1))\r")
    status = (await screen.until(r"end2\r\n")).string
    assert re.search(r"CapEff:\s+0+\r\n", status) and re.search(r"CapBnd:\s+0+\r\n", status), status
    assert re.search(r"NoNewPrivs:\s+1\r\n", status) and re.search(r"Seccomp:\s+2\r\n", status), status
    await term.write(b"exit 7\r")
    exit = await term.wait()
    assert exit.exit_code == 7 and not exit.sandbox_ended


async def test_a_process_sandbox_on_layers_has_terminals_too(fleet, tmp_path_factory):
    box = await fleet.create(memory_mb=128, layers=[await _busybox_base(fleet, tmp_path_factory)])
    try:
        term = await box.pty(["sh", "-c", "tty; stty size"], cols=90, rows=20)
        assert (await term.wait()).exit_code == 0
        assert re.fullmatch(rb"/dev/pts/\d+\r\n20 90\r\n", b"".join([c async for c in term.output(0)]))
    finally:
        await box.destroy()


async def test_a_background_job_left_on_the_terminal_does_not_keep_it_open(sb):
    term = await sb.pty(["sh", "-c", "sleep 1000 & echo bye$((1+1))"])
    assert (await term.wait()).exit_code == 0
    assert b"bye2" in b"".join([c async for c in term.output(0)])  # the output ends, too


async def test_a_resize_reaches_the_program_on_the_terminal(sb):
    term = await sb.pty(["sh"], cols=80, rows=24)
    screen = Screen(term)
    # A foreground job that waits for SIGWINCH (an interactive shell runs its traps only later).
    await term.write(b"sh -c 'trap \"echo resized$((1+1)); stty size; exit\" WINCH; echo ready$((1+1)); "
                     b"while :; do sleep 1; done'\r")
    await screen.until(r"ready2\r\n")
    await term.resize(132, 50)
    await screen.until(r"resized2\r\n50 132\r\n")  # SIGWINCH came, and the new size with it
    await term.write(b"stty size\r")
    await screen.until(r"\b50 132\r\n")
    await term.kill()
    assert (await term.wait()).signal == 9


async def _wait_for_sleep(sb) -> None:
    """Until `sleep 100` runs in the sandbox (its command line seen in the sandbox's /proc)."""
    async with asyncio.timeout(SCREEN_WAIT_S):
        while b"sleep\x00100\x00" not in (await sb.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline"])).stdout:
            await asyncio.sleep(0.05)


async def test_ctrl_c_interrupts_the_foreground_job_and_the_shell_goes_on(sb):
    term = await sb.pty(["sh"])
    screen = Screen(term)
    await term.write(b"sleep 100\r")
    await _wait_for_sleep(sb)
    await term.write(b"\x03")
    await term.write(b"echo rc=$?\r")
    assert (await screen.until(r"rc=(\d+)"))[1] == "130"  # the sleep died of SIGINT, not the shell
    await term.write(b"echo $((6*7))\r")
    await screen.until(r"\b42\r\n")
    assert (await term.process.info()).exit is None


async def test_a_terminal_reattaches_and_its_screen_output_is_kept(sb):
    term = await sb.pty(["sh", "-c", "echo first$((1+1)); read line; echo got:$line"])
    await Screen(term).until(r"first2")
    again = sb.terminal(term.pid)  # a handle of its own, as a second client makes it
    await again.write(b"typed\r")
    screen = Screen(again)  # from offset 0: what it printed before this handle existed
    await screen.until(r"first2\r\n")
    await screen.until(r"got:typed\r\n")
    assert (await again.wait()).exit_code == 0
    listed = {p.pid: p for p in await sb.processes()}
    assert listed[term.pid].exit is not None


async def test_screen_output_past_the_buffer_drops_the_oldest_and_tells_how_much(sb):
    script = "i=0; while [ $i -lt 2000 ]; do echo line$i; i=$((i+1)); done"
    term = await sb.pty(["sh", "-c", script], buffer_bytes=4096)
    await term.wait()
    got = b"".join([chunk async for chunk in term.output(0)])
    assert len(got) <= 4096 and term.dropped > 0 and term.dropped + len(got) == term.offset
    assert got.endswith(b"line1999\r\n")


async def test_bad_terminal_input_gets_typed_errors_and_changes_nothing(sb, fleet):
    for cols, rows in ((0, 24), (80, 0), (10**6, 24), (80, 10**6), (-1, 24)):
        with pytest.raises(errors.InvalidRequest):
            await sb.pty(["sh"], cols=cols, rows=rows)
    assert await sb.processes() == []  # none of them started anything
    with pytest.raises(errors.NotFound):
        await sb.pty(["sh"], cwd="/no/such/dir")
    term = await sb.pty(["sh"], cols=100, rows=30)
    screen = Screen(term)
    for cols, rows in ((0, 30), (100, 0), (10**6, 30), (100, 10**6)):
        with pytest.raises(errors.InvalidRequest):
            await term.resize(cols, rows)
    await term.write(b"stty size\r")
    await screen.until(r"\b30 100\r\n")  # the size is the one it started with
    plain = await sb.spawn(["sleep", "1000"])
    with pytest.raises(errors.Conflict):  # a process without a terminal has no size
        await sb.terminal(plain.pid).resize(80, 24)
    with pytest.raises(errors.NotFound):
        await sb.terminal(2**31).resize(80, 24)
    await term.write(b"exit\r")
    await term.wait()
    with pytest.raises(errors.Conflict):  # input to an ended terminal
        await term.write(b"too late\r")
    with pytest.raises(errors.Conflict):
        await term.resize(80, 24)
    missing = await sb.pty(["no-such-command"])
    assert (await missing.wait()).exit_code == 127
    assert b"no-such-command" in b"".join([c async for c in missing.output(0)])


def _host_processes_in(sandbox_id: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cgroup") as f:
                if sandbox_id in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def _terminal_fds(pid: int) -> int:
    """How many pty masters the process holds."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").endswith("ptmx")
        except OSError:
            continue
    return count


async def test_destroying_the_sandbox_ends_its_terminals_and_leaves_nothing(sb, platform):
    launcher = platform.service_pid("launcher")
    before = _terminal_fds(launcher)
    terms = [await sb.pty(["sh"]) for _ in range(3)]
    assert _terminal_fds(launcher) >= before + 3
    await sb.destroy()
    for term in terms:
        with pytest.raises(errors.SandboxEnded):
            await term.wait()
    assert _host_processes_in(sb.id) == []
    assert _terminal_fds(launcher) == before


# -- `sandfleet shell`, driven through a real terminal multiplexer ------------------------------


def _tmux(sock: str, *args: str) -> str:
    return subprocess.run(["tmux", "-S", sock, *args], check=True, capture_output=True, text=True).stdout


async def _pane_shows(sock: str, pattern: str) -> re.Match:
    """Until the pane's screen matches `pattern` (multi-line regex)."""
    screen = ""
    try:
        async with asyncio.timeout(SCREEN_WAIT_S):
            while not (found := re.search(pattern, screen := _tmux(sock, "capture-pane", "-p", "-t", "pty"), re.M)):
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"{pattern!r} never showed in the pane:\n{screen}") from None
    return found


def _cli_env(platform) -> dict:
    return {**os.environ, "SANDFLEET_NATS_URL": platform.url, "PYTHONPATH": str(ROOT)}


def _start_tmux_shell(sock: str, tmp_path: Path, sb, platform) -> Path:
    """A detached tmux session `pty` (100x30) whose pane runs `sandfleet shell` in `sb`; the pane's
    own shell notes the local terminal's mode before and after, and the CLI's exit code in the
    file returned."""
    require(shutil.which("tmux") is not None, "tmux is installed (make install)")
    done = tmp_path / "done"
    cli = " ".join(shlex.quote(a) for a in CLI)
    script = (f"stty -g > {tmp_path}/before; {cli} shell {sb.id}; code=$?; stty -g > {tmp_path}/after; "
              f"echo $code > {done}; sleep 1000")
    _tmux(sock, "-f", "/dev/null", "new-session", "-d", "-s", "pty", "-x", "100", "-y", "30", "-c", str(ROOT),
          "-e", f"SANDFLEET_NATS_URL={platform.url}", "-e", f"PYTHONPATH={ROOT}", "sh", "-c", script)
    return done


async def _cli_ended(tmp_path: Path, done: Path) -> str:
    """The CLI's exit code, once it ended; the local terminal's mode must be as it found it."""
    async with asyncio.timeout(SCREEN_WAIT_S):
        while not done.exists() or not done.read_text():
            await asyncio.sleep(0.05)
    assert (tmp_path / "before").read_text() == (tmp_path / "after").read_text()  # raw mode undone
    return done.read_text().strip()


async def _stop_tmux(sock: str) -> None:
    tree = _descendants(int(_tmux(sock, "display-message", "-p", "#{pid}")))
    subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True)
    await _reap(tree)


async def test_sandfleet_shell_in_tmux_types_resizes_interrupts_and_exits_with_the_code(sb, platform, tmp_path):
    sock = str(tmp_path / "tmux.sock")
    done = _start_tmux_shell(sock, tmp_path, sb, platform)
    try:
        await _pane_shows(sock, r"#$")  # the sandbox's shell prompts (tmux drops the trailing space)
        _tmux(sock, "send-keys", "-t", "pty", "echo $((6*7))", "Enter")
        await _pane_shows(sock, r"^42$")

        _tmux(sock, "resize-window", "-t", "pty", "-x", "120", "-y", "40")
        rows, cols = _tmux(sock, "display-message", "-p", "-t", "pty", "#{pane_height} #{pane_width}").split()
        assert (rows, cols) != ("30", "100")
        for attempt in range(50):  # the resize travels beside the keys: ask until it has landed
            _tmux(sock, "send-keys", "-t", "pty", f"stty size | sed 's/^/size{attempt}: /'", "Enter")
            size = await _pane_shows(sock, rf"^size{attempt}: (\d+ \d+)$")
            if size[1] == f"{rows} {cols}":
                break
        assert size[1] == f"{rows} {cols}"

        _tmux(sock, "send-keys", "-t", "pty", "sleep 100", "Enter")
        await _wait_for_sleep(sb)
        _tmux(sock, "send-keys", "-t", "pty", "C-c")
        _tmux(sock, "send-keys", "-t", "pty", "echo rc=$?", "Enter")
        await _pane_shows(sock, r"rc=130$")  # the sandbox's sleep was interrupted, the CLI goes on
        assert not done.exists()

        _tmux(sock, "send-keys", "-t", "pty", "exit 5", "Enter")
        assert await _cli_ended(tmp_path, done) == "5"
    finally:
        await _stop_tmux(sock)


async def test_sandfleet_shell_restores_the_local_terminal_when_the_sandbox_ends_under_it(sb, platform, tmp_path):
    sock = str(tmp_path / "tmux.sock")
    done = _start_tmux_shell(sock, tmp_path, sb, platform)
    try:
        await _pane_shows(sock, r"#$")
        await sb.destroy()
        assert await _cli_ended(tmp_path, done) == "1"
        await _pane_shows(sock, r"sandfleet shell: sandbox \S+ ended \(requested\)")
    finally:
        await _stop_tmux(sock)


def _descendants(pid: int) -> set[int]:
    """`pid` and every process under it."""
    found, todo = set(), [pid]
    while todo:
        found.add(current := todo.pop())
        try:
            with open(f"/proc/{current}/task/{current}/children") as f:
                todo += [int(child) for child in f.read().split()]
        except OSError:
            continue
    return found


async def _reap(pids: set[int]) -> None:
    """Until each of `pids` is gone, reaping those that fall to us: the session is a subreaper
    (tests/conftest.py), and tmux's server and its panes are orphans once it is killed."""
    async with asyncio.timeout(SCREEN_WAIT_S):
        while pids:
            for pid in list(pids):
                try:
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        pids.discard(pid)
                except ChildProcessError:  # not ours (yet): gone, or its own parent reaps it
                    if not os.path.exists(f"/proc/{pid}"):
                        pids.discard(pid)
            await asyncio.sleep(0.05)


async def _cli(platform, tmp_path, command: str, stdin: bytes = b"") -> tuple[int, bytes, bytes]:
    """Run a shell command line holding the CLI (stdin from a file, not a terminal); its code,
    stdout and stderr. A CLI that never ends fails with what it had printed."""
    (tmp_path / "in").write_bytes(stdin)
    with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err, open(tmp_path / "in", "rb") as inp:
        run = await asyncio.create_subprocess_shell(command, stdin=inp, stdout=out, stderr=err, env=_cli_env(platform),
                                                    cwd=ROOT, start_new_session=True)
        try:
            async with asyncio.timeout(SCREEN_WAIT_S):
                await run.wait()
        except TimeoutError:
            os.killpg(run.pid, signal.SIGKILL)  # the CLI too, not only the shell holding it
            await run.wait()
            raise AssertionError(f"{command!r} never ended: it printed {(tmp_path / 'out').read_bytes()[-2000:]!r}, "
                                 f"{(tmp_path / 'err').read_bytes()[-2000:]!r}") from None
    return run.returncode, (tmp_path / "out").read_bytes(), (tmp_path / "err").read_bytes()


async def test_sandfleet_shell_without_a_terminal_types_its_stdin_and_exits_with_the_code(sb, platform, tmp_path):
    cli = " ".join(shlex.quote(a) for a in CLI)
    code, out, err = await _cli(platform, tmp_path, f"{cli} shell {sb.id}", b"echo $((6*7))\nexit 3\n")
    assert code == 3 and re.search(rb"\b42\r\n", out), (code, out, err)
    code, out, err = await _cli(platform, tmp_path, f"{cli} shell {sb.id} -- sh -c 'tty; exit 4'")
    assert code == 4 and re.match(rb"/dev/pts/\d+\r\n", out), (code, out, err)
    # A closed pipe ends the CLI quietly, and it hangs the remote terminal up on its way out.
    code, out, err = await _cli(platform, tmp_path, f"{cli} shell {sb.id} -- sh -c 'while :; do echo yes; done' "
                                "| head -n 1")
    assert code == 0 and out == b"yes\r\n" and b"Traceback" not in err, (code, out, err)
    looping = [p for p in await sb.processes() if p.argv[-1] == "while :; do echo yes; done"]
    assert len(looping) == 1
    assert (await sb.terminal(looping[0].pid).wait()).signal == 1  # SIGHUP
