"""The Python tool's sandbox: notebook behaviour, limits, and what model code must not reach.

Each containment test has a positive control (the same action outside the sandbox succeeds),
so a test cannot pass because the action was impossible anyway. A test whose protection this
machine lacks skips, except under CI (CI=true), where it fails: CI machines have namespaces,
Landlock and seccomp, and a containment test that skips there would check nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tools.python.sandbox import PythonSandbox, SandboxLimits, probe_isolation
from tools.python.server import PythonToolServer

REPO = Path(__file__).resolve().parents[3]
FAST = SandboxLimits(wall_seconds=3.0, interrupt_grace_seconds=1.0, cpu_seconds=60)
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")


def require(condition: bool, reason: str) -> None:
    """Skip when this machine lacks what a test needs; under CI, fail instead."""
    if not condition:
        if IN_CI:
            pytest.fail(f"CI must run this containment test, but: {reason}")
        pytest.skip(reason)


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


async def test_output_before_a_kill_or_crash_reaches_the_model(sandbox):
    # stdout is a pipe: block-buffered, it would hold the prints of a cell that is then killed
    # (or crashes) and lose them, and show a child process's output before earlier prints.
    code = ("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "print('progress 1')\ntime.sleep(100)")
    result = await sandbox.execute(code)
    assert result.status == "timeout" and "restarted" in result.note
    assert result.stdout == "progress 1\n"
    result = await sandbox.execute("import os\nprint('last words')\nos._exit(3)")
    assert result.status == "crashed" and result.stdout == "last words\n"
    result = await sandbox.execute("import subprocess\nprint('first')\nsubprocess.run(['echo', 'second'])\nNone")
    assert result.stdout == "first\nsecond\n"


async def test_files_stay_writable_after_the_session_restarts(sandbox):
    # The scratch directory outlives a restart; its files must stay the new session's to change.
    await sandbox.execute("import os\nos.makedirs('out')\nopen('out/notes.txt', 'w').write('one')")
    result = await sandbox.execute("import os\nos._exit(1)")
    assert result.status == "crashed"
    result = await sandbox.execute("open('out/notes.txt', 'a').write('two')\n"
                                   "open('out/more.txt', 'w').write('three')\nNone")
    assert result.status == "ok" and "new one" in result.note, result.tool_text()
    assert (Path(sandbox.scratch_dir) / "out" / "notes.txt").read_text() == "onetwo"


async def test_caller_giving_up_mid_cell_leaves_nothing_running(sandbox):
    await sandbox.start()
    scratch_name = os.path.basename(sandbox.scratch_dir)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(sandbox.execute("while True: pass"), 0.5)
    await asyncio.sleep(0.2)
    assert processes_mentioning(scratch_name) == []
    result = await sandbox.execute("'fresh'")
    assert result.tool_text().startswith("'fresh'") and "new one" in result.note
    # The next call at once, before the killed worker is reaped: it runs, in a new session.
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(sandbox.execute("while True: pass"), 0.5)
    result = await sandbox.execute("'again'")
    assert result.tool_text().startswith("'again'") and "new one" in result.note


async def test_fork_bomb_is_contained(sandbox, isolation):
    require(isolation.user != "root without capabilities",
            "uid 0 is exempt from RLIMIT_NPROC and no namespaces here")
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


async def test_omitted_output_is_counted_in_characters():
    # The note counts characters, as the model reads them, not UTF-8 bytes.
    box = PythonSandbox(SandboxLimits(wall_seconds=10, max_output_chars=1000))
    try:
        result = await box.execute("print('\u00e9' * 200_000)\nprint('\u6587' * 100_000)")
        omitted = int(re.search(r"about (\d+) characters omitted", result.stdout).group(1))
        assert abs(omitted - (300_002 - 1000)) < 100
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
from tools.python.sandbox import PythonSandbox, SandboxLimits
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
    require(namespaces or isolation.landlock_abi, "no Landlock on this kernel")
    require(not namespaces or isolation.namespaces, "no namespaces here")
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
    require(isolation.landlock_abi or (namespaces and isolation.namespaces),
            "neither Landlock nor namespaces here")
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


class Listeners:
    """A TCP and a UDP socket on loopback, each checked reachable from outside the sandbox."""

    def __init__(self):
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        for listener in (self.tcp, self.udp):
            listener.setblocking(False)
        with socket.create_connection(self.tcp.getsockname(), timeout=2):  # positive controls
            pass
        self.tcp.accept()[0].close()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            sender.sendto(b"control", self.udp.getsockname())
        assert self.udp.recv(64) == b"control"

    def probe_code(self) -> str:
        """A cell that tries both, printing CONNECTED/SENT or BLOCKED for each."""
        return f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {self.tcp.getsockname()[1]}), timeout=2).close()
    print("tcp CONNECTED")
except OSError as e:
    print("tcp BLOCKED", type(e).__name__)
try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b"escaped", ("127.0.0.1", {self.udp.getsockname()[1]}))
    print("udp SENT")
except OSError as e:
    print("udp BLOCKED", type(e).__name__)
"""

    def tcp_arrived(self) -> bool:
        try:
            self.tcp.accept()[0].close()
            return True
        except BlockingIOError:
            return False

    def udp_arrived(self) -> bool:
        try:
            return self.udp.recv(64) == b"escaped"
        except BlockingIOError:
            return False

    def close(self) -> None:
        self.tcp.close()
        self.udp.close()


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "landlock-only"])
async def test_network_is_unreachable(isolation, namespaces):
    require(isolation.seccomp, "no seccomp socket filter here")
    require(not namespaces or isolation.namespaces, "no namespaces here")
    listeners = Listeners()
    box = PythonSandbox(FAST, use_namespaces=namespaces)
    try:
        report = await box.start()
        assert report.namespaces == namespaces and report.seccomp and report.network_blocked
        assert not any("UDP" in gap or "network" in gap for gap in report.gaps())
        result = await box.execute(listeners.probe_code())
        # The seccomp filter refuses IP sockets outright, in either mode.
        assert result.stdout == "tcp BLOCKED PermissionError\nudp BLOCKED PermissionError\n", result.tool_text()
        assert not listeners.tcp_arrived() and not listeners.udp_arrived()
    finally:
        listeners.close()
        await box.close()


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "landlock-only"])
async def test_network_stays_closed_without_the_socket_filter(isolation, namespaces):
    """With seccomp off, the other layers still block what they claim to: the network
    namespace everything, Landlock only TCP. The landlock-only case is also the control for
    the test above: its probe does see a datagram leave when nothing stops UDP."""
    require(isolation.landlock_abi >= 4, "no Landlock network rules on this kernel")
    require(not namespaces or isolation.namespaces, "no namespaces here")
    listeners = Listeners()
    box = PythonSandbox(FAST, use_namespaces=namespaces, use_seccomp=False)
    try:
        report = await box.start()
        assert not report.seccomp and report.network_blocked
        result = await box.execute(listeners.probe_code())
        assert result.stdout.startswith("tcp BLOCKED"), result.tool_text()
        assert not listeners.tcp_arrived()
        if namespaces:
            # No interface is up in the namespace, so the datagram goes nowhere.
            assert "udp BLOCKED" in result.stdout and not listeners.udp_arrived()
            assert report.gaps() == []
        else:
            assert "udp SENT" in result.stdout and listeners.udp_arrived()
            assert "only TCP is blocked (Landlock), not UDP" in report.gaps()
    finally:
        listeners.close()
        await box.close()


X32_SOCKET = 0x40000000 | 41  # socket() through the x32 ABI, which the filter must not let by
SYSCALL_PROBE = f"""
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def errno_of(number, *args):
    result = libc.syscall(ctypes.c_long(number), *args)
    return "ok" if result >= 0 else os.strerror(ctypes.get_errno())
params = ctypes.create_string_buffer(120)
print("io_uring", errno_of(425, 1, params))
if os.uname().machine == "x86_64":
    print("x32 socket", errno_of({X32_SOCKET}, socket.AF_INET, socket.SOCK_DGRAM, 0))
a, b = socket.socketpair()
a.sendall(b"unix ok")
print(b.recv(16).decode())
import asyncio
async def main():
    await asyncio.sleep(0)
    return "asyncio ok"
print(asyncio.run(main()))
"""


async def test_socket_filter_leaves_unix_sockets_and_closes_side_doors(isolation):
    """AF_UNIX (socketpair, asyncio's self-pipe) keeps working; io_uring (which can open
    sockets without socket()) and the x32 ABI's socket() are refused."""
    require(isolation.seccomp, "no seccomp socket filter here")
    outside = subprocess.run([sys.executable, "-c", SYSCALL_PROBE], capture_output=True, text=True, timeout=30)
    assert "io_uring ok" in outside.stdout, outside  # positive control: the kernel has io_uring
    assert "x32 socket Operation not permitted" not in outside.stdout
    box = PythonSandbox(FAST)
    try:
        result = await box.execute(SYSCALL_PROBE)
        lines = result.stdout.splitlines()
        assert "io_uring Operation not permitted" in lines, result.tool_text()
        if os.uname().machine == "x86_64":
            assert "x32 socket Operation not permitted" in lines
        assert lines[-2:] == ["unix ok", "asyncio ok"]
    finally:
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
