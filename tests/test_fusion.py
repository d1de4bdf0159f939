"""The SandboxFusion-compatible endpoint (`services/fusion`) judged by the real `sandbox-fusion`
client from PyPI and by a POST shaped exactly as verl's reward function sends it, against the
session's platform: real sandboxes from a real Debian layer with every language's toolchain.

The layer is built once for this module (one Debian root with python3, g++, nodejs, golang-go and
default-jdk-headless: the heavy languages share one build, and one base system): 640 MiB, in
368, 408 and 464 s on this 2-core machine while other test suites loaded it (printed with `-s`). The endpoint runs as its own process
(`python -m services.fusion`), as `sandfleet up` would start it."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import requests
import sandbox_fusion
from sandbox_fusion import RunCodeRequest, RunStatus, SummaryMapping, summary_run_code_result

from sandfleet.layers_client import Layers
from sandfleet.config import free_port
from tests.conftest import NODE_ID, ROOT, assert_nothing_left, start_platform, stop_platform
from tests.kernel import require

LAYER = "fz-langs"
PACKAGES = ["python3", "g++", "nodejs", "golang-go", "default-jdk-headless"]
LANGUAGES = ["python", "bash", "cpp", "nodejs", "go", "java"]
# The first test's setup builds the layer: more than the suite's 300 s per test on a loaded machine.
pytestmark = pytest.mark.timeout(900)
COMPILE_S = 120.0  # generous: what is judged here is the outcome, not how fast a loaded machine compiles


@pytest.fixture(scope="module")
async def endpoint(fleet, platform, tmp_path_factory):
    require(os.geteuid() == 0, "sandboxes need root")
    started = time.monotonic()
    built = await Layers(fleet.bus).build_debian(LAYER, PACKAGES)
    print(f"\nfusion: layer {LAYER} ({' '.join(PACKAGES)}): {built.layer.size / 2**20:.0f} MiB, "
          f"built in {time.monotonic() - started:.0f} s")
    port = free_port()
    env = {**platform.env, "SANDFLEET_NATS_URL": platform.url, "SANDFLEET_DATA_DIR": str(platform.data_dir),
           "SANDFLEET_FUSION_PORT": str(port),
           "SANDFLEET_FUSION_LAYERS": ",".join(f"{lang}={LAYER}" for lang in LANGUAGES)}
    log = open(tmp_path_factory.mktemp("fusion") / "fusion.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.fusion"], env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(_wait_for, url, lambda: proc.poll() is None)
        sandbox_fusion.set_endpoint(url)  # the client's own setting, as a user points it elsewhere
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _wait_for(url: str, alive) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert alive(), "the endpoint exited"
        try:
            with urllib.request.urlopen(f"{url}/v1/ping", timeout=1):
                return
        except (OSError, urllib.error.URLError):
            time.sleep(0.1)
    raise AssertionError("the endpoint did not listen within 60 s")


async def _run(**fields) -> sandbox_fusion.RunCodeResponse:
    """The real client's call (sync, on a thread), with no retries so a failure shows at once."""
    fields.setdefault("compile_timeout", COMPILE_S)
    fields.setdefault("run_timeout", COMPILE_S)  # a JVM's start on a loaded machine, not the default 10 s
    return await asyncio.to_thread(sandbox_fusion.run_code, RunCodeRequest(**fields), max_attempts=1)


async def _post(url: str, body: bytes | str) -> requests.Response:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    return await asyncio.to_thread(requests.post, f"{url}/run_code", headers=headers, data=body, timeout=120)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# Per language: hello world, a failing assert, an endless loop, and a program that reads
# data/in.txt (sent in `files`) and writes out.txt (asked back in `fetch_files`).
PROGRAMS = {
    "python": (
        'print("hello world")',
        'assert 1 + 1 == 3, "arithmetic"',
        "while True:\n    pass",
        'open("out.txt", "w").write(open("data/in.txt").read().upper())',
    ),
    "bash": (
        "echo hello world",
        '[[ $((1 + 1)) -eq 3 ]] || { echo "assertion failed: arithmetic" >&2; exit 1; }',
        "while true; do :; done",
        "tr a-z A-Z < data/in.txt > out.txt",
    ),
    "cpp": (
        '#include <cstdio>\nint main() { std::puts("hello world"); }',
        "#include <cassert>\nint main() { assert(1 + 1 == 3); }",
        "int main() { volatile unsigned x = 0; for (;;) x++; }",
        '#include <cctype>\n#include <fstream>\n#include <iterator>\n#include <string>\n'
        'int main() { std::ifstream in("data/in.txt"); std::string s((std::istreambuf_iterator<char>(in)), {});\n'
        "  for (auto &c : s) c = std::toupper(c); std::ofstream(\"out.txt\") << s; }",
    ),
    "nodejs": (
        'console.log("hello world")',
        'require("assert").strictEqual(1 + 1, 3)',
        "while (true) {}",
        'const fs = require("fs"); fs.writeFileSync("out.txt", fs.readFileSync("data/in.txt", "utf8").toUpperCase())',
    ),
    "go": (
        'package main\nimport "fmt"\nfunc main() { fmt.Println("hello world") }',
        'package main\nfunc main() { if 1+1 != 3 { panic("assertion failed: arithmetic") } }',
        "package main\nfunc main() { x := 0; for { x++ } }",
        'package main\nimport ("os"; "strings")\nfunc main() { b, _ := os.ReadFile("data/in.txt"); '
        'os.WriteFile("out.txt", []byte(strings.ToUpper(string(b))), 0o644) }',
    ),
    "java": (
        'public class Main { public static void main(String[] a) { System.out.println("hello world"); } }',
        'public class Main { public static void main(String[] a) { if (1 + 1 != 3) throw new AssertionError("arithmetic"); } }',
        "public class Main { public static void main(String[] a) { long x = 0; while (true) x++; } }",
        "import java.nio.file.*;\npublic class Solution { public static void main(String[] a) throws Exception {\n"
        '  Files.writeString(Path.of("out.txt"), Files.readString(Path.of("data/in.txt")).toUpperCase()); } }',
    ),
}


@pytest.mark.parametrize("language", LANGUAGES)
async def test_each_language_through_the_sandbox_fusion_client(endpoint, language):
    hello, failing, endless, files = PROGRAMS[language]
    ok, failed, slow, copied = await asyncio.gather(
        _run(code=hello, language=language),
        _run(code=failing, language=language),
        _run(code=endless, language=language, run_timeout=1),
        _run(code=files, language=language, files={"data/in.txt": _b64("judged\n")}, fetch_files=["out.txt"]),
    )
    mapping = SummaryMapping(CompileFailed="compile failed", RunFailed="run failed", RunTimeout="run timeout")

    assert ok.status == RunStatus.Success and ok.message == "", ok
    assert ok.run_result.status == "Finished" and ok.run_result.return_code == 0
    assert ok.run_result.stdout == "hello world\n" and ok.run_result.execution_time > 0
    compiled = language in ("cpp", "go", "java")
    assert (ok.compile_result is not None) == compiled
    if compiled:
        assert ok.compile_result.status == "Finished" and ok.compile_result.return_code == 0

    assert failed.status == RunStatus.Failed, failed
    assert failed.run_result.status == "Finished" and failed.run_result.return_code not in (0, None)
    assert summary_run_code_result(failed, mapping) == "run failed"
    if language != "bash":  # each language's own assertion machinery says what failed
        assert "ssert" in failed.run_result.stderr or "arithmetic" in failed.run_result.stderr, failed.run_result

    assert slow.status == RunStatus.Failed, slow
    assert slow.run_result.status == "TimeLimitExceeded" and slow.run_result.return_code is None
    assert summary_run_code_result(slow, mapping) == "run timeout"

    assert copied.status == RunStatus.Success, copied
    assert base64.b64decode(copied.files["out.txt"]) == b"JUDGED\n"


async def test_a_compile_error_and_a_compile_timeout_stop_before_the_run(endpoint):
    broken, late = await asyncio.gather(
        _run(code="int main() { return undeclared; }", language="cpp"),
        _run(code="#include <bits/stdc++.h>\nint main() {}", language="cpp", compile_timeout=0.05),
    )
    mapping = SummaryMapping(CompileFailed="compile failed", CompileTimeout="compile timeout")
    assert broken.status == RunStatus.Failed and broken.run_result is None
    assert broken.compile_result.status == "Finished" and broken.compile_result.return_code != 0
    assert "undeclared" in broken.compile_result.stderr
    assert summary_run_code_result(broken, mapping) == "compile failed"
    assert late.status == RunStatus.Failed and late.run_result is None
    assert late.compile_result.status == "TimeLimitExceeded" and late.compile_result.return_code is None
    assert summary_run_code_result(late, mapping) == "compile timeout"


async def test_stdin_a_crash_and_files_that_are_not_there(endpoint):
    echoed, crashed, missing = await asyncio.gather(
        _run(code="import sys; print(sys.stdin.read()[::-1])", language="python", stdin="abc"),
        # null, but not to the compiler (which would turn a known null dereference into a trap)
        _run(code="int main(int argc, char **) { int *p = (int *)(long)(argc - 1); return *p; }", language="cpp"),
        _run(code="print('no file written')", language="python", fetch_files=["never.txt", "/tmp/nor-this"]),
    )
    assert echoed.run_result.stdout == "cba\n"
    assert crashed.status == RunStatus.Failed
    assert crashed.run_result.status == "Finished" and crashed.run_result.return_code == 128 + 11  # SIGSEGV
    assert missing.status == RunStatus.Success and missing.files == {}


def _verl_payload(code: str, stdin: str, timeout: int, memory_limit_mb: int | None, language: str) -> str:
    """The body verl's `call_sandbox_api` (verl/utils/reward_score/sandbox_fusion/utils.py, as of
    commit 10f0796) sends, key for key; later versions add `memory_limit_MB` (verl's
    `reward_model.sandbox_fusion.memory_limit_mb`), given here unless `memory_limit_mb` is None."""
    payload = {
        "compile_timeout": timeout,
        "run_timeout": timeout,
        "code": code,
        "stdin": stdin,
        "language": language,
        "files": {},
        "fetch_files": [],
    }
    if memory_limit_mb is not None:
        payload = {**payload, "memory_limit_MB": memory_limit_mb}
    return json.dumps(payload)


async def test_a_post_shaped_as_verls_reward_function_sends_it(endpoint):
    solution = "a, b = map(int, input().split())\nprint(a + b)"
    replies = await asyncio.gather(*(_post(endpoint, _verl_payload(solution, stdin, 10, memory, "python"))
                                     for stdin, memory in (("1 2", None), ("40 2", 1024))))
    for reply, expected in zip(replies, ("3", "42")):
        assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
        body = reply.json()
        # What verl reads to call a case passed: status Success, a Finished run, stdout equal.
        assert body["status"] == "Success" and body["run_result"]["status"] == "Finished", body
        assert body["run_result"]["stdout"].rstrip("\n") == expected
        assert body["run_result"]["return_code"] == 0 and body["compile_result"] is None

    wrong = (await _post(endpoint, _verl_payload("raise SystemExit(3)", "", 10, 1024, "python"))).json()
    assert wrong["status"] == "Failed" and wrong["run_result"]["return_code"] == 3


async def test_memory_limit_mb_is_the_sandboxs_memory(endpoint):
    hog = "x = bytearray(200 * 2**20); x[::4096] = b'1' * len(x[::4096]); print(len(x))"
    small, large = await asyncio.gather(_post(endpoint, _verl_payload(hog, "", 20, 64, "python")),
                                        _post(endpoint, _verl_payload(hog, "", 20, 512, "python")))
    small, large = small.json(), large.json()
    assert small["status"] == "Failed" and small["run_result"]["return_code"] == 128 + 9, small  # OOM-killed
    assert large["status"] == "Success" and large["run_result"]["stdout"] == f"{200 * 2**20}\n", large


async def test_malformed_requests_get_its_error_shape(endpoint):
    cases = [
        (b"not json", ["body"]),
        (json.dumps({"language": "python"}), ["body", "code"]),
        (json.dumps({"code": 1, "language": "python"}), ["body", "code"]),
        (json.dumps({"code": "", "language": "cobol"}), ["body", "language"]),
        (json.dumps({"code": "", "language": "python", "run_timeout": "soon"}), ["body", "run_timeout"]),
        (json.dumps({"code": "", "language": "python", "files": {"a.txt": "%%%"}}), ["body", "files", "a.txt"]),
    ]
    for body, loc in cases:
        reply = await _post(endpoint, body)
        assert reply.status_code == 422, (body, reply.text)
        detail = reply.json()["detail"]
        assert detail[0]["loc"] == loc and detail[0]["msg"], (body, detail)
    assert (await asyncio.to_thread(requests.get, f"{endpoint}/run_code")).status_code == 405
    missing = await asyncio.to_thread(requests.post, f"{endpoint}/no_such_route", json={})
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}


async def test_a_language_it_does_not_judge_is_a_sandbox_error_the_client_raises_on(endpoint):
    body = (await _post(endpoint, json.dumps({"code": "fn main() {}", "language": "rust"}))).json()
    assert body["status"] == "SandboxError" and "rust" in body["message"]
    with pytest.raises(Exception, match="Sandbox responded with error"):
        await _run(code="fn main() {}", language="rust")


async def _jupyter(**fields) -> sandbox_fusion.RunJupyterResponse:
    fields.setdefault("total_timeout", COMPILE_S)
    return await asyncio.to_thread(sandbox_fusion.run_jupyter, sandbox_fusion.RunJupyterRequest(**fields),
                                   max_attempts=1)


async def test_notebook_cells_share_one_kernel_and_each_reports_its_output_display_and_error(endpoint):
    """The client's own example cells: state lasts from cell to cell, the last expression is the
    cell's display, stderr and an exception are the cell's own, and the next cell still runs."""
    r = await _jupyter(cells=["a = 123", "a", "print(a)", 'import sys; sys.stderr.write("stderr message")',
                              'raise RuntimeError("error message")', "a + 1",
                              'print(open("data/in.txt").read()); open("out.txt", "w").write("nb")'],
                       files={"data/in.txt": _b64("from files")}, fetch_files=["out.txt"])
    assert r.status == RunStatus.Failed and r.driver is not None and r.driver.return_code == 0, r
    cells = r.cells
    assert len(cells) == 7
    assert cells[0].display == [] and cells[0].error == []
    assert cells[1].display == [{"text/plain": "123"}]
    assert cells[2].stdout == "123\n"
    assert cells[3].stderr == "stderr message"
    assert cells[4].error[0]["ename"] == "RuntimeError" and cells[4].error[0]["evalue"] == "error message"
    assert any("<cell>" in line for line in cells[4].error[0]["traceback"])
    assert cells[5].display == [{"text/plain": "124"}] and cells[5].error == []
    assert cells[6].stdout == "from files\n"
    assert base64.b64decode(r.files["out.txt"]) == b"nb"
    ok = await _jupyter(cells=["x = [1, 2]", "x * 2"])
    assert ok.status == RunStatus.Success and ok.cells[1].display == [{"text/plain": "[1, 2, 1, 2]"}]


async def test_a_cell_past_its_timeout_is_stopped_and_no_cell_after_it_runs(endpoint):
    r = await _jupyter(cells=["n = 1", "while True:\n    n += 1", "print('after')"], cell_timeout=2)
    assert r.status == RunStatus.Failed and len(r.cells) == 2, r
    assert r.cells[1].error[0]["ename"] == "TimeoutError"
    late = await _jupyter(cells=["import time", "time.sleep(60)"], total_timeout=3)
    assert late.status == RunStatus.Failed and late.driver.status.value == "TimeLimitExceeded", late
    assert len(late.cells) == 1  # the first cell's result, written before the run was cut


async def test_a_malformed_notebook_request_gets_its_error_shape(endpoint):
    reply = await asyncio.to_thread(requests.post, f"{endpoint}/run_jupyter", json={"cells": "not a list"},
                                    timeout=60)
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"][:2] == ["body", "cells"]
    reply = await asyncio.to_thread(requests.post, f"{endpoint}/run_jupyter", json={"cells": [], "kernel": "ruby"},
                                    timeout=60)
    assert reply.status_code == 422


def test_a_kernel_results_file_is_read_up_to_its_first_line_that_is_not_a_cell():
    from services.fusion.jupyter import cell_results

    good = b'{"stdout": "1\\n", "stderr": "", "display": [], "error": []}'
    assert [c.stdout for c in cell_results(good + b"\n" + good + b"\n")] == ["1\n", "1\n"]
    assert len(cell_results(good + b'\n{"stdout": 5}\n' + good)) == 1  # a forged or cut line ends it
    assert cell_results(b"\x00" * 100) == []


async def test_every_call_left_no_sandbox_behind(endpoint, fleet):
    await _run(code="print(1)", language="python")
    left = [r for r in await fleet.list() if r.spec.labels.get("client") == "sandbox-fusion"]
    assert left == []


def test_sandfleet_up_starts_the_endpoint_when_asked_and_down_stops_it(leak_check, tmp_path_factory):
    port = free_port()
    p = start_platform(tmp_path_factory.mktemp("fusion-up"), f"{NODE_ID}-fz", env={"SANDFLEET_FUSION_PORT": str(port)})
    url = f"http://127.0.0.1:{port}"
    try:
        pid = p.service_pid("fusion")
        _wait_for(url, lambda: os.path.exists(f"/proc/{pid}"))
        # This platform has no language layers: the endpoint says which to build.
        body = requests.post(f"{url}/run_code", json={"code": "print(1)", "language": "python"}, timeout=60).json()
        assert body["status"] == "SandboxError" and "lang-python" in body["message"], body
    finally:
        stop_platform(p)
    assert_nothing_left(leak_check, p.data_dir, [p.node_id])
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/v1/ping", timeout=5)


# -- without a platform: the wire shapes, the plans, the layer recipes -------------------------


def test_requests_decode_as_its_server_takes_them():
    from services.fusion.protocol import BadRequest, decode_request

    req = decode_request(b'{"code": "x", "language": "go", "compile_timeout": 3, "extra": 1, "files": {"a": null}}')
    assert (req.compile_timeout, req.run_timeout, req.memory_limit_MB, req.files) == (3.0, 10.0, -1, {"a": None})
    with pytest.raises(BadRequest) as bad:
        decode_request(b'{"code": "x", "language": "go", "fetch_files": ["a", 2]}')
    assert bad.value.detail[0]["loc"] == ["body", "fetch_files", 1]


def test_each_language_compiles_and_runs_as_sandbox_fusion_does():
    from services.fusion import languages

    assert languages.plan("python", "").run == ["python3", "main.py"]
    assert languages.plan("cpp", "").compile[:2] == ["g++", "-std=c++17"]
    java = languages.plan("java", "import x;\npublic final class Solution {}")
    assert (java.source, java.run[-1]) == ("Solution.java", "Solution")
    assert languages.plan("java", "class Hidden {}").source == "Main.java"
    assert languages.plan("rust", "") is None
    assert languages.in_workdir("a/b") == "/workspace/a/b" and languages.in_workdir("/tmp/x") == "/tmp/x"


def test_layers_are_lang_language_unless_the_setting_names_another():
    from services.fusion.languages import layer_map

    assert layer_map("")["go"] == "lang-go"
    assert layer_map("go=toolchains, cpp=toolchains")["cpp"] == "toolchains"
    with pytest.raises(ValueError):
        layer_map("cobol=x")


def test_the_layer_recipes_build_one_layer_each_or_one_for_all():
    from sandfleet.cli_fusion import PACKAGES, build_plan

    assert build_plan(",".join(PACKAGES), None)[0] == ("lang-python", ["python3"])
    assert build_plan("cpp,go", "tc") == [("tc", ["g++", "golang-go"])]
    with pytest.raises(ValueError):
        build_plan("cobol", None)
