"""SWE-ReX (SWE-agent's runtime) on sandfleet, driven only through SWE-ReX's own interfaces and
types from the `swe-rex` package: a deployment started and stopped, bash sessions whose state
lasts, timeouts, checked exit codes, syntax errors, commands, files and uploads, and a small
SWE-agent-style loop that fixes a failing test. Both levels: `process` (host view: bash and
python3 from the host) and `container` (a busybox layer: `sh`, no python).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from swerex.deployment.abstract import AbstractDeployment
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from sandfleet import errors
from sandfleet.integrations.swerex import SandfleetDeployment, UnsupportedActionError
from tests.conftest import ROOT
from tests.layer_trees import APPLETS, busybox_layer

BASE = "swerex-base"
async def _busybox_base(fleet, tmp_path_factory) -> str:
    return await busybox_layer(fleet, tmp_path_factory, BASE, hostname="swerex",
                               applets=(*APPLETS, "mkdir", "touch", "pwd", "printf", "grep"))


async def _spec(level: str, fleet, tmp_path_factory) -> dict:
    if level == "container":
        return dict(isolation="container", layers=[await _busybox_base(fleet, tmp_path_factory)], memory_mb=256)
    return dict(host_view=True, memory_mb=256)


@pytest.fixture(params=["process", "container"])
async def deployment(request, platform, fleet, tmp_path_factory):
    # Its own connection, as a user's; called from the tests' loop, not the one it lives on
    d = SandfleetDeployment(url=platform.url, **await _spec(request.param, fleet, tmp_path_factory))
    assert isinstance(d, AbstractDeployment)
    await d.start()
    d.level = request.param
    yield d
    await d.stop()


async def _session(runtime: AbstractRuntime, name: str = "default") -> None:
    await runtime.create_session(CreateBashSessionRequest(session=name))


async def test_a_session_keeps_its_cwd_and_environment_and_checks_exit_codes(deployment):
    runtime = deployment.runtime
    assert isinstance(runtime, AbstractRuntime)
    assert await deployment.is_alive()
    await _session(runtime)
    r = await runtime.run_in_session(BashAction(command="mkdir -p /tmp/sess && cd /tmp/sess && export TASK=calc\nLEVEL=one"))
    assert r.exit_code == 0 and r.output == ""
    r = await runtime.run_in_session(BashAction(command="pwd; echo $TASK $LEVEL; echo to-stderr >&2"))
    assert r.output == "/tmp/sess\ncalc one\nto-stderr\n"  # one stream, as from SWE-ReX's terminal

    # What agents send: a heredoc that writes a file, quotes of both kinds, a comment, a chain
    r = await runtime.run_in_session(BashAction(command=(
        "cat > notes.txt <<'EOF'\nit's \"quoted\" $TASK\nEOF\n# a comment\ncat notes.txt && echo \"it's $TASK\"")))
    assert r.output == "it's \"quoted\" $TASK\nit's calc\n"
    with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
        await runtime.run_in_session(BashAction(command="echo before; (exit 3)", check="raise"))
    r = await runtime.run_in_session(BashAction(command="echo before; (exit 3)", check="silent"))
    assert r.exit_code == 3 and r.output == "before\n"
    r = await runtime.run_in_session(BashAction(command="false", check="ignore"))
    assert r.exit_code is None

    # A syntax error raises before anything of the command runs, and the session lives on
    with pytest.raises(BashIncorrectSyntaxError) as caught:
        await runtime.run_in_session(BashAction(command="touch /tmp/sess/ran\nif"))
    assert caught.value.extra_info["bash_stderr"]
    r = await runtime.run_in_session(BashAction(command="test -e /tmp/sess/ran", check="silent"))
    assert r.exit_code == 1
    assert (await runtime.run_in_session(BashAction(command="echo $TASK"))).output == "calc\n"

    # Sessions are independent; names are checked as SWE-ReX's own runtime checks them
    with pytest.raises(SessionExistsError):
        await _session(runtime)
    await _session(runtime, "other")
    assert (await runtime.run_in_session(BashAction(command="echo [$TASK]", session="other"))).output == "[]\n"
    await runtime.close_session(CloseBashSessionRequest(session="other"))
    with pytest.raises(SessionDoesNotExistError):
        await runtime.run_in_session(BashAction(command="true", session="other"))
    with pytest.raises(SessionDoesNotExistError):
        await runtime.close_session(CloseBashSessionRequest(session="never"))
    with pytest.raises(UnsupportedActionError):  # expect stops interactive actions only
        await runtime.run_in_session(BashAction(command="echo x", expect=["x"]))

    await runtime.close()  # every session ends; the sandbox stays, the deployment's to destroy
    with pytest.raises(SessionDoesNotExistError):
        await runtime.run_in_session(BashAction(command="true"))
    assert await deployment.is_alive()


async def test_a_run_past_its_timeout_raises_and_the_session_answers_after(deployment):
    runtime = deployment.runtime
    await _session(runtime)
    await runtime.run_in_session(BashAction(command="X=kept"))
    with pytest.raises(CommandTimeoutError):
        await runtime.run_in_session(BashAction(command="echo started; sleep 1000", timeout=0.5))
    r = await runtime.run_in_session(BashInterruptAction())  # what SWE-agent sends next: nothing left to stop
    assert r.exit_code == 0
    r = await runtime.run_in_session(BashAction(command="echo $X", timeout=30))
    assert r.output == "kept\n" and r.exit_code == 0


REPL = """echo "ready>"
while read -r line; do
  [ "$line" = quit ] && { echo bye; exit 0; }
  echo "got $line"; echo "ready>"
done
"""


async def test_an_interactive_program_reads_the_session_until_it_quits(deployment):
    runtime = deployment.runtime
    await runtime.write_file(WriteFileRequest(path="/workspace/repl.sh", content=REPL))
    await _session(runtime)
    await runtime.run_in_session(BashAction(command="X=kept; cd /workspace"))

    def line(command: str, **kw) -> BashAction:
        return BashAction(command=command, is_interactive_command=True, expect=["ready>"], timeout=30, **kw)

    r = await runtime.run_in_session(line("sh repl.sh"))
    assert (r.output, r.expect_string, r.exit_code) == ("", "ready>", 0)
    r = await runtime.run_in_session(line("hello"))
    assert (r.output, r.expect_string) == ("got hello", "ready>")
    with pytest.raises(UnsupportedActionError):  # the program holds the session
        await runtime.run_in_session(BashAction(command="echo $X"))
    r = await runtime.run_in_session(BashAction(command="quit", is_interactive_quit=True, timeout=30))
    assert (r.output, r.expect_string) == ("bye", "")  # "": back at the shell, SWE-ReX's prompt
    assert (await runtime.run_in_session(BashAction(command="echo $X"))).output == "kept\n"

    # A program that does not answer: the action times out, an interrupt ends it
    with pytest.raises(CommandTimeoutError):
        await runtime.run_in_session(BashAction(command="sleep 1000", is_interactive_command=True, timeout=0.5))
    r = await runtime.run_in_session(BashInterruptAction(timeout=10))
    assert r.expect_string == ""
    assert (await runtime.run_in_session(BashAction(command="echo $X"))).output == "kept\n"
    with pytest.raises(UnsupportedActionError):
        await runtime.run_in_session(BashAction(command="quit", is_interactive_quit=True))

    if deployment.level == "process":  # a REPL users know, on the host's python
        prompt = dict(is_interactive_command=True, expect=[">>> "], timeout=30)
        await runtime.run_in_session(BashAction(command="python3 -i -q", **prompt))
        r = await runtime.run_in_session(BashAction(command="print(6 * 7)", **prompt))
        assert r.output == "42"
        r = await runtime.run_in_session(BashAction(command="exit()", is_interactive_quit=True, timeout=30))
        assert r.expect_string == ""


async def test_sessions_source_startup_files(deployment):
    runtime = deployment.runtime
    await runtime.write_file(WriteFileRequest(path="/workspace/tools.sh",
                                              content="greet() { echo \"hello $1\"; }\necho sourced\n"))
    created = await runtime.create_session(CreateBashSessionRequest(
        session="tools", startup_source=["/workspace/missing.sh", "/workspace/tools.sh"], startup_timeout=30))
    assert "missing.sh" in created.output and created.output.endswith("sourced\n")  # a missing one is said, not fatal
    assert (await runtime.run_in_session(BashAction(command="greet agent", session="tools"))).output == "hello agent\n"


async def test_execute_runs_a_command_as_subprocess_run_would(deployment):
    runtime = deployment.runtime
    r = await runtime.execute(Command(command=["sh", "-c", "echo out; echo err >&2; exit 3"]))
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
    with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
        await runtime.execute(Command(command=["sh", "-c", "exit 3"], check=True))
    r = await runtime.execute(Command(command="echo $GREETING from $(pwd)", shell=True, cwd="/tmp",
                                      env={"GREETING": "hi"}))
    assert r.stdout == "hi from /tmp\n" and r.exit_code == 0
    r = await runtime.execute(Command(command=["sh", "-c", "echo a; echo b >&2"], merge_output_streams=True))
    assert r.stdout == "a\nb\n" and r.stderr == ""
    with pytest.raises(CommandTimeoutError):
        await runtime.execute(Command(command=["sleep", "1000"], timeout=0.5))


async def test_files_are_written_read_and_directories_uploaded(deployment, tmp_path):
    runtime = deployment.runtime
    await runtime.write_file(WriteFileRequest(path="/workspace/deep/er/notes.txt", content="one\r\ntwo\n"))
    r = await runtime.read_file(ReadFileRequest(path="/workspace/deep/er/notes.txt"))
    assert r.content == "one\ntwo\n"  # Path.read_text's universal newlines
    big = "x" * (5 * 1024 * 1024) + "end\n"  # more than one bus message
    await runtime.write_file(WriteFileRequest(path="/workspace/big.txt", content=big))
    assert (await runtime.read_file(ReadFileRequest(path="/workspace/big.txt"))).content == big
    with pytest.raises(FileNotFoundError):
        await runtime.read_file(ReadFileRequest(path="/workspace/missing.txt"))
    with pytest.raises(IsADirectoryError):
        await runtime.read_file(ReadFileRequest(path="/workspace/deep"))

    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "data.txt").write_text("data\n")
    (tree / "run.sh").write_text("#!/bin/sh\necho ran $(cat sub/data.txt)\n")
    (tree / "run.sh").chmod(0o755)
    await runtime.upload(UploadRequest(source_path=str(tree), target_path="/workspace/up/tree"))
    r = await runtime.execute(Command(command="./run.sh", shell=True, cwd="/workspace/up/tree"))
    assert r.stdout == "ran data\n"
    await runtime.upload(UploadRequest(source_path=str(tree / "sub" / "data.txt"), target_path="/workspace/one.txt"))
    assert (await runtime.read_file(ReadFileRequest(path="/workspace/one.txt"))).content == "data\n"
    with pytest.raises(ValueError):
        await runtime.upload(UploadRequest(source_path=str(tmp_path / "nothing"), target_path="/workspace/x"))


def _swe_agent_loop(deployment: SandfleetDeployment, repo, test_cmd: str, fix: tuple[str, str]) -> str:
    """What SWE-agent's environment does, the way it does it: plain functions, each SWE-ReX call
    in a fresh `asyncio.run` (so on a new event loop every time)."""
    run = asyncio.run
    run(deployment.start())
    run(deployment.runtime.create_session(CreateBashSessionRequest(startup_source=["/root/.bashrc"],
                                                                   startup_timeout=10)))
    run(deployment.runtime.run_in_session(BashAction(command="export PAGER=cat LANG=C.UTF-8", check="raise")))
    run(deployment.runtime.upload(UploadRequest(source_path=str(repo), target_path="/workspace/repo")))
    run(deployment.runtime.run_in_session(BashAction(command="cd /workspace/repo")))
    r = run(deployment.runtime.run_in_session(BashAction(command=test_cmd, timeout=60, check="silent")))
    assert r.exit_code != 0 and "FAILED" in r.output
    source = run(deployment.runtime.read_file(ReadFileRequest(path=f"/workspace/repo/{fix[0]}"))).content
    assert source != fix[1]
    run(deployment.runtime.write_file(WriteFileRequest(path=f"/workspace/repo/{fix[0]}", content=fix[1])))
    r = run(deployment.runtime.run_in_session(BashAction(command=test_cmd, timeout=60)))
    assert r.exit_code == 0 and r.output == "PASSED\n"
    sandbox_id = deployment.sandbox.id
    run(deployment.stop())
    assert not run(deployment.is_alive())
    return sandbox_id


@pytest.mark.parametrize("level", ["process", "container"])
async def test_an_swe_agent_style_loop_fixes_a_failing_test(level, platform, fleet, tmp_path, tmp_path_factory):
    repo = tmp_path / "repo"
    repo.mkdir()
    if level == "container":  # busybox has no python: the same loop with a shell test
        (repo / "calc.sh").write_text("add() { echo $(($1 - $2)); }\n")
        (repo / "test.sh").write_text(". ./calc.sh\n[ \"$(add 2 3)\" = 5 ] && echo PASSED || { echo FAILED; exit 1; }\n")
        test_cmd, fix = "sh test.sh", ("calc.sh", "add() { echo $(($1 + $2)); }\n")
    else:
        (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
        (repo / "test_calc.py").write_text("from calc import add\n\nassert add(2, 3) == 5, 'FAILED'\nprint('PASSED')\n")
        test_cmd, fix = "python3 test_calc.py", ("calc.py", "def add(a, b):\n    return a + b\n")
    deployment = SandfleetDeployment(url=platform.url, **await _spec(level, fleet, tmp_path_factory))
    try:
        sandbox_id = await asyncio.to_thread(_swe_agent_loop, deployment, repo, test_cmd, fix)
    finally:
        await deployment.stop()  # a no-op once the loop stopped it
    with pytest.raises(DeploymentNotStartedError):
        deployment.runtime
    with pytest.raises(errors.NotFound):  # the sandbox is gone with the deployment
        await fleet.get(sandbox_id)


def test_without_the_extra_the_import_says_what_to_install():
    script = ("import sys; sys.modules['swerex'] = None\n"  # as if swe-rex were not installed
              "from sandfleet.extras import MissingExtra\n"
              "try:\n    import sandfleet.integrations.swerex\n"
              "except MissingExtra as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "pip install 'sandfleet[swerex]'" in out.stdout, out
