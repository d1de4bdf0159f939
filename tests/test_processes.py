"""Background processes, streaming exec, shell sessions and why a command ended, on the real
platform for both `process` (host view) and `container` (busybox base layer) sandboxes.

The node enters the sandbox from outside for every byte: a dev server started in the
background is reached by a client exec'd in the same sandbox (port forwarding is another
capability), a second real Python process re-attaches to a process and reads its earlier
output, and every bad input gets a typed error that changes nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandfleet import errors
from services.launcher.process_output import OutputBuffer
from tests.layer_trees import APPLETS, busybox_layer, level_sandbox

BASE = "proc-base"
CLI = [sys.executable, "-m", "sandfleet.cli"]
ROOT = Path(__file__).resolve().parent.parent
LEVELS = ["process", "container"]


async def _busybox_base(fleet, tmp_path_factory) -> str:
    return await busybox_layer(fleet, tmp_path_factory, BASE, hostname="ct",
                               applets=(*APPLETS, "mkdir", "httpd", "wget", "seq"))


@pytest.fixture(params=LEVELS)
async def sb(request, fleet, tmp_path_factory):
    async with level_sandbox(fleet, request.param, lambda: _busybox_base(fleet, tmp_path_factory)) as box:
        yield box


def test_the_output_buffer_keeps_the_newest_bytes_and_counts_what_it_dropped():
    buffer = OutputBuffer(10)
    buffer.append(1, b"abcdef")
    buffer.append(2, b"ghijkl")
    assert (buffer.start, buffer.end, buffer.held) == (2, 12, 10)
    chunks, next_offset, dropped = buffer.read(0, 100)
    assert dropped == 2 and next_offset == 12
    assert [(c.stream, c.offset, c.data) for c in chunks] == [(1, 2, b"cdef"), (2, 6, b"ghijkl")]
    chunks, next_offset, dropped = buffer.read(7, 3)
    assert [(c.offset, c.data) for c in chunks] == [(7, b"hij")] and next_offset == 10 and dropped == 0
    assert buffer.read(12, 100) == ([], 12, 0)
    buffer.append(1, b"x" * 25)  # one chunk larger than the whole buffer: its newest part stays
    chunks, _, dropped = buffer.read(0, 100)
    assert b"".join(c.data for c in chunks) == b"x" * 10 and dropped == 27


async def _all_output(proc) -> dict[str, bytes]:
    got = {"stdout": b"", "stderr": b""}
    async for out in proc.output():
        got[out.stream] += out.data
    return got


async def test_a_background_process_streams_output_takes_stdin_and_reports_its_exit(sb):
    proc = await sb.spawn(["sh", "-c", "echo ready; read line; echo got:$line; echo oops >&2; exit 3"], stdin=True)
    assert proc.pid >= 1 and proc.os_pid is not None and proc.os_pid > 1
    listed = {p.pid: p for p in await sb.processes()}
    assert listed[proc.pid].exit is None and listed[proc.pid].stdin_open
    await proc.send_stdin(b"hello\n")
    got = await _all_output(proc)
    assert got == {"stdout": b"ready\ngot:hello\n", "stderr": b"oops\n"}
    exit = await proc.wait()
    assert exit.exit_code == 3 and exit.signal is None and not exit.sandbox_ended


async def test_signal_and_kill_end_a_process_with_the_signal_reported(sb):
    proc = await sb.spawn(["sleep", "1000"])
    await proc.signal(15)
    exit = await proc.wait()
    assert exit.signal == 15 and exit.exit_code == 128 + 15
    proc = await sb.spawn(["sh", "-c", "trap '' TERM; echo up; sleep 1000"])
    async for out in proc.output():
        if out.data == b"up\n":
            break
    await proc.kill()
    assert (await proc.wait()).signal == 9


async def test_a_dev_server_in_the_background_answers_a_client_in_the_sandbox(sb):
    if sb.level == "container":
        r = await sb.exec(["mkdir", "-p", "/workspace/www"])
        assert r.exit_code == 0, r
        await sb.write_file("/workspace/www/index.html", b"hello from the dev server\n")
        server = await sb.spawn(["httpd", "-f", "-p", "127.0.0.1:8000", "-h", "/workspace/www"])
        client = ["sh", "-c", "for i in $(seq 50); do wget -q -O - http://127.0.0.1:8000/index.html && exit 0;"
                              " sleep 0.1; done; exit 1"]
    else:
        await sb.write_file("/workspace/index.html", b"hello from the dev server\n")
        server = await sb.spawn(["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1"])
        client = ["python3", "-c", textwrap.dedent("""
            import time, urllib.request
            for _ in range(100):
                try:
                    print(urllib.request.urlopen("http://127.0.0.1:8000/index.html").read().decode(), end="")
                    break
                except OSError:
                    time.sleep(0.1)
            """)]
    r = await sb.exec(client, timeout_s=30)
    assert r.exit_code == 0 and r.stdout == b"hello from the dev server\n", r
    assert server.pid in {p.pid for p in await sb.processes() if p.exit is None}
    await server.kill()
    await server.wait()


async def test_streaming_exec_calls_back_as_output_comes_and_returns_the_whole_result(sb):
    seen: list[tuple[str, bytes]] = []
    first_seen = asyncio.Event()

    async def on_stdout(data: bytes) -> None:
        seen.append(("out", data))
        first_seen.set()

    # The command waits for a file the test writes only after the first chunk reached the callback.
    task = asyncio.ensure_future(sb.exec(
        ["sh", "-c", "echo first; while [ ! -e /workspace/go ]; do sleep 0.05; done; echo second; echo err >&2"],
        on_stdout=on_stdout, on_stderr=lambda d: seen.append(("err", d))))
    await asyncio.wait_for(first_seen.wait(), 30)
    assert seen == [("out", b"first\n")] and not task.done()
    await sb.write_file("/workspace/go", b"")
    r = await task
    assert r.exit_code == 0 and r.stdout == b"first\nsecond\n" and r.stderr == b"err\n"
    assert b"".join(d for k, d in seen if k == "out") == r.stdout and ("err", b"err\n") in seen


async def test_a_streaming_exec_past_its_timeout_is_killed_and_says_so(sb):
    r = await sb.exec(["sh", "-c", "echo begun; sleep 1000"], timeout_s=0.5, on_stdout=lambda d: None)
    assert r.timed_out and r.exit_code == 137 and r.stdout == b"begun\n"


async def test_a_fast_command_streamed_to_a_live_reader_loses_nothing(sb):
    """Output travels as raw bytes and a reader that keeps reading holds the command back (its
    pipe fills) instead of having the oldest dropped: from the first byte to the last, even
    when the command writes far faster than the bus carries it (64 MiB through a streamed exec's
    16 MiB buffer, and through 1 MiB)."""
    size = 64 << 20
    streamed: list[int] = []
    r = await sb.exec(["head", "-c", str(size), "/dev/zero"], on_stdout=lambda d: streamed.append(len(d)),
                      timeout_s=600)
    assert r.exit_code == 0 and sum(streamed) == size
    proc = await sb.spawn(["head", "-c", str(size), "/dev/zero"], buffer_bytes=1 << 20)
    outputs = [o async for o in proc.output()]
    assert sum(len(o.data) for o in outputs) == size and not any(o.dropped for o in outputs)
    assert proc.exit is not None and proc.exit.exit_code == 0


async def test_output_past_the_buffer_drops_the_oldest_and_tells_how_much(sb):
    proc = await sb.spawn(["sh", "-c", "i=0; while [ $i -lt 2000 ]; do echo line-$i; i=$((i+1)); done"],
                          buffer_bytes=4096)
    await proc.wait()
    outputs = [o async for o in proc.output()]
    written = sum(len(f"line-{i}\n") for i in range(2000))
    assert outputs[0].dropped == written - 4096
    data = b"".join(o.data for o in outputs)
    assert len(data) == 4096 and data.endswith(b"line-1999\n")
    info = (await proc.info())
    assert info.written == written and info.dropped == written - 4096


async def test_a_second_client_process_reattaches_and_reads_the_earlier_output(sb, platform):
    proc = await sb.spawn(["sh", "-c", "echo before-detach; read x; echo after:$x"], stdin=True)
    script = textwrap.dedent(f"""
        import asyncio, sandfleet
        async def main():
            async with sandfleet.connect({platform.url!r}) as fleet:
                sb = await fleet.sandbox({sb.id!r})
                proc = sb.process({proc.pid})
                async for out in proc.output():
                    print(out.stream, out.data.decode().strip(), flush=True)
                    if out.data == b"before-detach\\n":
                        await proc.send_stdin(b"from-second-client\\n")
                print("exit", (await proc.wait()).exit_code, flush=True)
        asyncio.run(main())
        """)
    second = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=subprocess.PIPE,
                                                  stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(second.communicate(), 60)
    assert second.returncode == 0, err.decode()
    assert out.decode().splitlines() == ["stdout before-detach", "stdout after:from-second-client", "exit 0"]


async def test_a_client_that_goes_away_leaves_its_process_running(sb, platform):
    script = textwrap.dedent(f"""
        import asyncio, sandfleet
        async def main():
            async with sandfleet.connect({platform.url!r}) as fleet:
                sb = await fleet.sandbox({sb.id!r})
                proc = await sb.spawn(["sh", "-c", "echo one; read x; echo two:$x"], stdin=True)
                print(proc.pid, flush=True)
        asyncio.run(main())
        """)
    done = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=subprocess.PIPE)
    pid = int((await done.communicate())[0])
    proc = sb.process(pid)
    assert (await proc.info()).exit is None
    await proc.send_stdin(b"later\n")
    assert (await _all_output(proc))["stdout"] == b"one\ntwo:later\n"


async def test_a_swe_loop_in_one_shell_session_keeps_its_state(sb):
    await sb.exec(["mkdir", "-p", "/workspace/repo"])
    if sb.level == "container":  # busybox has no Python: the same loop with a shell test
        await sb.write_file("/workspace/repo/calc.sh", b"add() { echo $(($1 - $2)); }\n")
        await sb.write_file("/workspace/repo/test.sh",
                            b". ./calc.sh\n[ \"$(add 2 3)\" = 5 ] && echo PASSED || { echo FAILED; exit 1; }\n")
        test_cmd, fix = "sh test.sh", ("calc.sh", b"add() { echo $(($1 + $2)); }\n")
    else:
        await sb.write_file("/workspace/repo/calc.py", b"def add(a, b):\n    return a - b\n")
        await sb.write_file("/workspace/repo/test_calc.py",
                            b"from calc import add\n\nassert add(2, 3) == 5, 'FAILED'\nprint('PASSED')\n")
        test_cmd, fix = "python3 test_calc.py", ("calc.py", b"def add(a, b):\n    return a + b\n")
    sh = await sb.shell()
    try:
        r = await sh.run("cd /workspace/repo && export TASK=calc && LEVEL=one")
        assert r.exit_code == 0 and r.stdout == b"" and r.stderr == b""
        r = await sh.run("pwd; echo $TASK $LEVEL")
        assert r.stdout == b"/workspace/repo\ncalc one\n"
        r = await sh.run(test_cmd, timeout_s=60)
        assert r.exit_code == 1 and b"FAILED" in r.stdout + r.stderr
        await sb.write_file(f"/workspace/repo/{fix[0]}", fix[1])
        r = await sh.run(test_cmd, timeout_s=60)
        assert r.exit_code == 0 and r.stdout == b"PASSED\n", r
        r = await sh.run("if")  # a syntax error is the run's, not the session's end
        assert r.exit_code != 0 and r.stderr
        r = await sh.run("sleep 1000 & echo started-job")
        assert r.stdout == b"started-job\n"
        assert b"Running" in (await sh.run("jobs")).stdout
        other = await sb.shell()  # several sessions: each its own state
        assert (await other.run("pwd; echo [$TASK]")).stdout == b"/workspace\n[]\n"
        await other.close()
    finally:
        await sh.close()


async def test_a_run_past_its_timeout_is_interrupted_and_the_session_answers(sb):
    sh = await sb.shell()
    try:
        await sh.run("X=kept")
        r = await sh.run("echo started; sleep 1000", timeout_s=0.5)
        assert r.timed_out and r.stdout == b"started\n"
        r = await sh.run("echo $X")
        assert r.exit_code == 0 and r.stdout == b"kept\n"
    finally:
        await sh.close()


async def test_an_ended_sandbox_is_told_apart_from_an_ended_command(sb, fleet):
    proc = await sb.spawn(["sleep", "1000"])
    running = asyncio.ensure_future(sb.exec(["sleep", "1000"], timeout_s=120))
    streamed = asyncio.ensure_future(sb.exec(["sleep", "1000"], timeout_s=120, on_stdout=lambda d: None))
    await asyncio.sleep(0.5)  # both commands are running (no assertion on time: only a head start)
    await sb.destroy()
    for ended in (proc.wait(), running, streamed):
        with pytest.raises(errors.SandboxEnded) as caught:
            await ended
        assert caught.value.reason == "requested"
    # Nothing of the process is kept for a sandbox that ended, and no exec helper outlives it.
    with pytest.raises(errors.SandboxEnded):
        await sb.processes()
    assert _host_processes_in(sb.id) == []


async def test_a_sandbox_whose_init_died_ends_its_processes_and_commands_with_that_reason(sb, fleet):
    proc = await sb.spawn(["sleep", "1000"])
    running = asyncio.ensure_future(sb.exec(["sleep", "1000"], timeout_s=120))
    await asyncio.sleep(0.5)  # the command is running (a head start, not an assertion on time)
    os.kill((await fleet.get(sb.id)).init_pid, signal.SIGKILL)  # as the kernel's OOM killer would
    for ended in (proc.wait(), running):  # the plain exec's 137 is the sandbox's, not the command's
        with pytest.raises(errors.SandboxEnded) as caught:
            await ended
        assert caught.value.reason == "process_exited"


def _host_processes_in(sandbox_id: str) -> list[int]:
    """Host pids whose cgroups name the sandbox (the helpers of its commands join them)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cgroup") as f:
                if sandbox_id in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


async def test_bad_process_input_gets_typed_errors_and_changes_nothing(sb, fleet):
    proc = await sb.spawn(["true"])
    await proc.wait()
    with pytest.raises(errors.Conflict):
        await proc.send_stdin(b"too late\n")
    with pytest.raises(errors.Conflict):
        await proc.signal(15)
    with pytest.raises(errors.NotFound):
        await sb.process(2**31).signal(15)
    no_stdin = await sb.spawn(["sleep", "1000"])
    with pytest.raises(errors.Conflict):
        await no_stdin.send_stdin(b"x")
    with pytest.raises(errors.NotFound):
        await sb.spawn(["true"], cwd="/no/such/dir")
    other = await fleet.create(memory_mb=64, host_view=True)
    try:
        with pytest.raises(errors.NotFound):  # a pid of another sandbox is no pid of this one
            await other.process(no_stdin.pid).signal(9)
    finally:
        await other.destroy()
    with pytest.raises(errors.InvalidRequest):
        await no_stdin.signal(0)
    assert (await no_stdin.info()).exit is None  # none of it touched the process
    await no_stdin.kill()
    await no_stdin.wait()


async def test_too_many_processes_in_one_sandbox_are_refused(sb):
    started = []
    with pytest.raises(errors.Capacity):
        for _ in range(1000):
            started.append(await sb.spawn(["sleep", "1000"]))
    assert len(started) == 32  # the launcher's default limit (SANDFLEET_MAX_PROCESSES)
    await started[0].kill()
    await started[0].wait()
    started.append(await sb.spawn(["true"]))  # room again


async def test_the_cli_streams_exec_lists_processes_and_prints_their_logs(sb, platform):
    out = await asyncio.to_thread(platform.cli, "exec", sb.id, "--", "sh", "-c", "echo out; echo err >&2; exit 4",
                                  check=False)
    assert (out.returncode, out.stdout, out.stderr) == (4, b"out\n", b"err\n")
    proc = await sb.spawn(["sh", "-c", "echo logged; echo also >&2"])
    await proc.wait()
    logs = await asyncio.to_thread(platform.cli, "logs", sb.id, str(proc.pid), "--follow")
    assert (logs.stdout, logs.stderr) == (b"logged\n", b"also\n")
    listed = await asyncio.to_thread(platform.cli, "ps", sb.id)
    assert f"{proc.pid}" in listed.stdout.decode() and "exit 0" in listed.stdout.decode()
    # A reader that goes away (`| head`) ends the CLI quietly, without a traceback.
    piped = await asyncio.to_thread(
        subprocess.run, " ".join([*CLI, "exec", sb.id, "--", "sh", "-c", "'yes | head -c 3000000'"]) + " | head -c 5",
        shell=True, capture_output=True, env={**platform.env, "SANDFLEET_NATS_URL": platform.url}, cwd=ROOT,
        timeout=60)
    assert piped.stdout == b"y\ny\ny" and b"Traceback" not in piped.stderr, piped.stderr
