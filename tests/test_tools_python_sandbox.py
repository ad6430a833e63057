"""The Python tool's sandbox: notebook behaviour, limits, and what model code must not reach.

Each containment test has a positive control (the same action outside the sandbox succeeds),
so a test cannot pass because the action was impossible anyway.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tools.python_sandbox import PythonSandbox, SandboxLimits, probe_isolation
from tools.python_tool import PythonToolServer

REPO = Path(__file__).resolve().parents[1]
FAST = SandboxLimits(wall_seconds=3.0, interrupt_grace_seconds=1.0, cpu_seconds=60)


@pytest.fixture
async def sandbox():
    box = PythonSandbox(FAST)
    yield box
    await box.close()


@pytest.fixture(scope="module")
def isolation():
    return asyncio.run(probe_isolation())


def processes_mentioning(text: str) -> list[int]:
    """Processes whose command line contains `text` (each sandbox's holds its scratch path)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


class Ticker:
    """Counts event-loop iterations while a sandbox call runs: the server stays responsive."""

    def __init__(self):
        self.ticks = 0
        self.task = asyncio.create_task(self._run())

    async def _run(self):
        while True:
            await asyncio.sleep(0.05)
            self.ticks += 1

    def stop(self) -> int:
        self.task.cancel()
        return self.ticks


async def test_notebook_state_display_and_errors(sandbox):
    assert (await sandbox.execute("x = 41\nimport math")).tool_text() == ""
    result = await sandbox.execute("x + 1")
    assert result.status == "ok" and result.tool_text() == "42"
    result = await sandbox.execute("print('a'); print('b', file=__import__('sys').stderr); None")
    assert (result.stdout, result.stderr) == ("a\n", "b\n")
    result = await sandbox.execute("def f():\n    return 1 / 0\n\nf()")
    assert result.status == "error"
    assert result.stderr.startswith("Traceback (most recent call last):\n")
    assert 'File "<cell 4>", line 2, in f\n    return 1 / 0' in result.stderr
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "python_sandbox_worker" not in result.stderr
    result = await sandbox.execute("def g(:\n  pass")
    assert result.status == "error" and "SyntaxError" in result.stderr
    result = await sandbox.execute("import asyncio\nawait asyncio.sleep(0)\nmath.sqrt(x + 8)")
    assert result.tool_text() == "7.0"
    result = await sandbox.execute("open('notes.txt', 'w').write('kept'); import os; os.getcwd()")
    assert (Path(sandbox.scratch_dir) / "notes.txt").read_text() == "kept"


async def test_infinite_loop_is_interrupted_and_state_kept(sandbox):
    await sandbox.execute("counter = 5")
    ticker = Ticker()
    start = time.monotonic()
    result = await sandbox.execute("while True:\n    counter += 1")
    elapsed = time.monotonic() - start
    assert ticker.stop() >= 20  # the event loop kept running during the 3 s cell
    assert result.status == "timeout" and 2.9 < elapsed < 6
    assert "KeyboardInterrupt" in result.stderr
    assert "timed out after 3 seconds and was interrupted; the session state was kept" in result.tool_text()
    result = await sandbox.execute("counter > 5")
    assert result.tool_text() == "True"


async def test_loop_that_ignores_interrupts_is_killed(sandbox):
    await sandbox.execute("saved = 1")
    code = ("import time\nwhile True:\n    try:\n        time.sleep(0.01)\n"
            "    except KeyboardInterrupt:\n        pass")
    result = await sandbox.execute(code)
    assert result.status == "timeout" and "restarted and its state is lost" in result.note
    assert processes_mentioning(os.path.basename(sandbox.scratch_dir)) == []
    result = await sandbox.execute("saved")
    assert "NameError" in result.stderr and "new one" in result.note
    assert (await sandbox.execute("1 + 1")).tool_text() == "2"


async def test_caller_giving_up_mid_cell_leaves_nothing_running(sandbox):
    await sandbox.start()
    scratch_name = os.path.basename(sandbox.scratch_dir)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(sandbox.execute("while True: pass"), 0.5)
    await asyncio.sleep(0.2)
    assert processes_mentioning(scratch_name) == []
    result = await sandbox.execute("'fresh'")
    assert result.tool_text().startswith("'fresh'") and "new one" in result.note


async def test_fork_bomb_is_contained(sandbox, isolation):
    if isolation.user == "root without capabilities":
        pytest.skip("uid 0 is exempt from RLIMIT_NPROC and no namespaces here")
    await sandbox.start()
    result = await sandbox.execute("import os\nwhile True:\n    os.fork()")
    assert result.status in ("error", "timeout")
    assert "Resource temporarily unavailable" in result.stderr or result.status == "timeout"
    scratch_name = os.path.basename(sandbox.scratch_dir)
    assert len(processes_mentioning(scratch_name)) <= FAST.max_processes + 2
    assert (await sandbox.execute("print('still here')")).tool_text() == "still here"
    await sandbox.close()
    await asyncio.sleep(0.2)
    assert processes_mentioning(scratch_name) == []  # nothing of the session outlives it


async def test_ten_gigabyte_allocation_fails_cleanly(sandbox):
    result = await sandbox.execute("block = bytearray(10 * 1024**3)")
    assert result.status == "error" and "MemoryError" in result.stderr
    assert (await sandbox.execute("len(bytearray(10 * 1024**2))")).tool_text() == str(10 * 1024**2)


async def test_cpu_time_limit_ends_the_session():
    box = PythonSandbox(SandboxLimits(wall_seconds=20, cpu_seconds=1))
    try:
        start = time.monotonic()
        result = await box.execute("while True: pass")
        assert time.monotonic() - start < 15  # well before the 20 s wall limit
        assert result.status == "crashed" and "used up its CPU time (1 s per session)" in result.note
        assert (await box.execute("2 * 21")).tool_text().startswith("42")
    finally:
        await box.close()


async def test_output_is_capped():
    box = PythonSandbox(SandboxLimits(wall_seconds=10, max_output_chars=1000))
    try:
        result = await box.execute("print('y' * 2_000_000)\nprint('tail marker')")
        assert len(result.stdout) < 1100
        assert "characters omitted" in result.stdout and result.stdout.endswith("tail marker\n")
    finally:
        await box.close()


SCAN_FOR_SECRET = """
import os
found = [k for k in os.environ if k == "OSS_AGENT_TEST_SECRET"]
try:
    entries = os.listdir("/proc")
except OSError as e:
    entries = []
for entry in entries:
    try:
        with open(f"/proc/{entry}/environ", "rb") as f:
            if b"OSS_AGENT_TEST_SECRET=" in f.read():
                found.append(entry)
    except OSError:
        pass
print("FOUND" if found else "CLEAN", found)
"""

SERVER = """
import asyncio, json, subprocess, sys
sys.path.insert(0, sys.argv[1])
from tools.python_sandbox import PythonSandbox, SandboxLimits
scan = sys.argv[2]

async def main():
    sandbox = PythonSandbox(SandboxLimits(wall_seconds=20), use_namespaces=sys.argv[3] == "1")
    try:
        inside = await sandbox.execute(scan)
    finally:
        await sandbox.close()
    plain = subprocess.run([sys.executable, "-c", scan], capture_output=True, text=True)
    print(json.dumps({"sandbox": inside.tool_text(), "plain": plain.stdout}))

asyncio.run(main())
"""


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "landlock-only"])
def test_server_environment_is_out_of_reach(isolation, namespaces):
    if not namespaces and not isolation.landlock_abi:
        pytest.skip("no Landlock on this kernel")
    if namespaces and not isolation.namespaces:
        pytest.skip("no namespaces here")
    # A stand-in server whose environment (its initial one, as /proc shows it) holds a secret.
    env = {**os.environ, "OSS_AGENT_TEST_SECRET": os.urandom(8).hex()}
    done = subprocess.run([sys.executable, "-c", SERVER, str(REPO), SCAN_FOR_SECRET,
                           "1" if namespaces else "0"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["plain"].startswith("FOUND")  # an ordinary child sees it...
    assert outcome["sandbox"].startswith("CLEAN"), outcome["sandbox"]  # ...the sandbox does not


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "landlock-only"])
async def test_writing_outside_scratch_is_denied(tmp_path, isolation, namespaces):
    if not (isolation.landlock_abi or (namespaces and isolation.namespaces)):
        pytest.skip("neither Landlock nor namespaces here")
    target = tmp_path / "open-to-all"
    target.mkdir(mode=0o777)
    target.chmod(0o777)
    (target / "control.txt").write_text("the test itself can write here")  # positive control
    escapes = [target / "escape.txt", REPO / "escape.txt", Path("/tmp/escape-sandbox.txt"),
               Path(tempfile.gettempdir()) / "escape.txt"]  # the last: next to the scratch dir
    for path in escapes:
        path.unlink(missing_ok=True)
    box = PythonSandbox(FAST, use_namespaces=namespaces)
    try:
        code = f"""
import os
for path in [{str(target / 'escape.txt')!r}, {str(REPO / 'escape.txt')!r},
             os.path.join(os.path.dirname(os.path.realpath('.')), 'escape.txt'), '/tmp/escape-sandbox.txt']:
    try:
        with open(path, 'w') as f:
            f.write('x')
        print('WROTE', path)
    except OSError as e:
        print('DENIED', path, type(e).__name__)
open('inside.txt', 'w').write('fine')
"""
        result = await box.execute(code)
        assert "WROTE" not in result.stdout and result.stdout.count("DENIED") == 4, result.tool_text()
        assert Path(box.scratch_dir).parent == Path(tempfile.gettempdir())
        assert not any(path.exists() for path in escapes)
        assert (Path(box.scratch_dir) / "inside.txt").read_text() == "fine"
    finally:
        await box.close()
        for path in escapes:  # should a broken sandbox have written them
            path.unlink(missing_ok=True)


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "landlock-only"])
async def test_network_is_unreachable(isolation, namespaces):
    if not (isolation.landlock_abi >= 4 or (namespaces and isolation.namespaces)):
        pytest.skip("no network isolation available here")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=2):  # positive control
        pass
    listener.accept()[0].close()
    box = PythonSandbox(FAST, use_namespaces=namespaces)
    try:
        code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("CONNECTED")
except OSError as e:
    print("BLOCKED", type(e).__name__)
"""
        result = await box.execute(code)
        assert result.stdout.startswith("BLOCKED"), result.tool_text()
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing arrived
    finally:
        listener.close()
        await box.close()


async def test_tool_server_and_sessions(isolation):
    server = await PythonToolServer.start(SandboxLimits(wall_seconds=2.0, interrupt_grace_seconds=0.5))
    namespace = server.harmony_namespace()
    assert namespace.name == "python" and namespace.tools == []
    assert "stateful Jupyter notebook environment" in namespace.description
    assert "time out after 2.0 seconds" in namespace.description
    if isolation.namespaces:
        assert "The drive at '/mnt/data'" in namespace.description
        assert "Internet access for this session is disabled." in namespace.description

    first, second = server.open_session(), server.open_session()
    result = await first.call("python", "value = 'first'\nvalue")
    assert result.text == "'first'" and not result.is_error
    assert result.details == {"code": "value = 'first'\nvalue", "stdout": "'first'\n", "stderr": "",
                              "status": "ok", "exit": 0}
    # Sessions are separate notebooks.
    result = await second.call("python", '{"code": "value"}')
    assert "NameError" in result.text and not result.is_error and result.details["exit"] == 1
    result = await first.call("python", "import time\ntime.sleep(10)")
    assert result.is_error and result.details["status"] == "timeout"
    assert (await first.call("python", "value")).text == "'first'"
    assert (await first.call("browser.search", "{}")).is_error

    scratch = first.sandbox.scratch_dir
    await server.aclose()  # closes every open session
    assert not Path(scratch).exists()
    assert processes_mentioning(os.path.basename(scratch)) == []
