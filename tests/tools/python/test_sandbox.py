"""The Python tool's sandbox: notebook behaviour, limits, and what model code must not reach.

Each containment test has a positive control (the same action outside the sandbox succeeds),
so a test cannot pass because the action was impossible anyway. A test whose protection this
machine lacks skips, except under CI (CI=true), where it fails: CI machines have namespaces,
Landlock, seccomp and a writable cgroup, and a containment test that skips there would check
nothing. Tests of the fallback mode (no namespaces) run it through `tests.sandbox_host` where
this machine's Python is private to root (the sandbox refuses to run there, as one test checks).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.sandbox_host import host_command, make_sandbox, python_private_to_root
from tools.python.sandbox import PythonSandbox, SandboxError, SandboxLimits, probe_isolation
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
    # A cell bigger than a pipe holds reaches the notebook whole.
    assert (await sandbox.execute("s = '" + "y" * 300_000 + "'\nlen(s)")).tool_text() == "300000"


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
    code = "import time\nwhile True:\n    try:\n        time.sleep(0.01)\n    except KeyboardInterrupt:\n        pass"
    result = await sandbox.execute(code)
    assert result.status == "timeout" and "restarted and its state is lost" in result.note
    assert processes_mentioning(os.path.basename(sandbox.scratch_dir)) == []
    result = await sandbox.execute("saved")
    assert "NameError" in result.stderr and "new one" in result.note
    assert (await sandbox.execute("1 + 1")).tool_text() == "2"


async def test_output_before_a_kill_or_crash_reaches_the_model(sandbox):
    # stdout is a pipe: block-buffered, it would hold the prints of a cell that is then killed
    # (or crashes) and lose them, and show a child process's output before earlier prints.
    code = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('progress 1')\ntime.sleep(100)"
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
    result = await sandbox.execute(
        "open('out/notes.txt', 'a').write('two')\nopen('out/more.txt', 'w').write('three')\nNone"
    )
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


async def test_fork_bomb_is_contained(sandbox):
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
    done = subprocess.run(
        host_command(["-c", SERVER, str(REPO), SCAN_FOR_SECRET, "1" if namespaces else "0"]),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["plain"].startswith("FOUND")  # an ordinary child sees it...
    assert outcome["sandbox"].startswith("CLEAN"), outcome["sandbox"]  # ...the sandbox does not


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "landlock-only"])
async def test_writing_outside_scratch_is_denied(tmp_path, isolation, namespaces):
    require(isolation.landlock_abi or (namespaces and isolation.namespaces), "neither Landlock nor namespaces here")
    target = tmp_path / "open-to-all"
    target.mkdir(mode=0o777)
    target.chmod(0o777)
    (target / "control.txt").write_text("the test itself can write here")  # positive control
    escapes = [
        target / "escape.txt",
        REPO / "escape.txt",
        Path("/tmp/escape-sandbox.txt"),
        Path(tempfile.gettempdir()) / "escape.txt",
    ]  # the last: next to the scratch dir
    for path in escapes:
        path.unlink(missing_ok=True)
    box = make_sandbox(FAST, namespaces)
    try:
        code = f"""
import os
for path in [{str(target / "escape.txt")!r}, {str(REPO / "escape.txt")!r},
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
        assert Path(box.scratch_dir).parents[2] == Path(tempfile.gettempdir())
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
    box = make_sandbox(FAST, namespaces)
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
    box = make_sandbox(FAST, namespaces, use_seccomp=False)
    try:
        report = await box.start()
        assert not report.seccomp and report.network_blocked
        result = await box.execute(listeners.probe_code())
        assert result.stdout.startswith("tcp BLOCKED"), result.tool_text()
        assert not listeners.tcp_arrived()
        if namespaces:
            # No interface is up in the namespace, so the datagram goes nowhere.
            assert "udp BLOCKED" in result.stdout and not listeners.udp_arrived()
            assert not any("network" in gap or "UDP" in gap for gap in report.gaps())
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
try:
    socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    print("datagram pair ok")
except OSError as e:
    print("datagram pair", e.strerror)
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
    """Connected AF_UNIX stream pairs (socketpair, asyncio's self-pipe) keep working; a
    datagram pair (which sendto could point at a host socket), io_uring (which can open
    sockets without socket()) and the x32 ABI's socket() are refused."""
    require(isolation.seccomp, "no seccomp socket filter here")
    outside = subprocess.run([sys.executable, "-c", SYSCALL_PROBE], capture_output=True, text=True, timeout=30)
    assert "io_uring ok" in outside.stdout, outside  # positive control: the kernel has io_uring
    assert "x32 socket Operation not permitted" not in outside.stdout
    assert "datagram pair ok" in outside.stdout
    box = PythonSandbox(FAST)
    try:
        result = await box.execute(SYSCALL_PROBE)
        lines = result.stdout.splitlines()
        assert "io_uring Operation not permitted" in lines, result.tool_text()
        if os.uname().machine == "x86_64":
            assert "x32 socket Operation not permitted" in lines
        assert "datagram pair Operation not permitted" in lines
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
    assert result.details == {
        "code": "value = 'first'\nvalue",
        "stdout": "'first'\n",
        "stderr": "",
        "status": "ok",
        "exit": 0,
    }
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


MODES = pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "fallback"])


def require_fallback_host() -> None:
    """The fallback tests' host (`tests.sandbox_host`) needs a mount namespace where this
    machine's Python is private to root."""
    if python_private_to_root():
        require(
            os.geteuid() == 0 and subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0,
            "no mount namespace for the fallback mode's test host",
        )


async def test_root_without_namespaces_never_runs_code_as_root():
    """As root without namespaces, the sandbox either runs code as another uid or, where that
    uid cannot reach Python (a pyenv under /root), refuses to start, and says why. (It used to
    run the code as uid 0 without capabilities, which still reads root's files.)"""
    if os.geteuid() != 0:
        pytest.skip("the server is not root here")
    assert Path("/etc/shadow").read_bytes()  # positive control: root reads it
    box = PythonSandbox(FAST, use_namespaces=False)
    try:
        result = await box.execute("import os\nprint(os.getuid())\nopen('/etc/shadow').read()")
    except SandboxError as e:
        assert python_private_to_root(), e
        message = str(e)
        assert "refusing to run model code as root" in message and "no Linux namespaces" in message
        assert "Run the server as a non-root user" in message
    else:
        assert not python_private_to_root()
        assert result.stdout.split()[0] != "0" and "PermissionError" in result.stderr, result.tool_text()
    finally:
        await box.close()


ROOT_ONLY_PROBE = """
import os, socket
print("uid", os.getuid())
try:
    open("/etc/shadow").read()
    print("shadow READ")
except OSError as e:
    print("shadow DENIED", type(e).__name__)
for name, path in [("root-only", {root_only!r}), ("world", {world!r})]:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(path)
            s.sendall(b"escaped")
        print(name, "CONNECTED")
    except OSError as e:
        print(name, "BLOCKED", type(e).__name__)
"""


class UnixListeners:
    """A UNIX socket only root may connect to (0600) and one anyone may (0666), in a folder
    anyone may pass through; both checked reachable from outside the sandbox."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="h45-unix-")
        os.chmod(self.folder, 0o755)
        self.sockets = {}
        for name, mode in (("root-only", 0o600), ("world", 0o666)):
            path = os.path.join(self.folder, name)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(path)
            os.chmod(path, mode)
            listener.listen()
            listener.setblocking(False)
            self.sockets[name] = (path, listener)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:  # positive control
                client.connect(path)
            listener.accept()[0].close()

    def probe_code(self) -> str:
        return ROOT_ONLY_PROBE.format(root_only=self.sockets["root-only"][0], world=self.sockets["world"][0])

    def arrived(self, name: str) -> bool:
        try:
            self.sockets[name][1].accept()[0].close()
            return True
        except BlockingIOError:
            return False

    def close(self) -> None:
        for _, listener in self.sockets.values():
            listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)


@MODES
@pytest.mark.parametrize("seccomp", [True, False], ids=["seccomp", "no-seccomp"])
async def test_root_files_and_host_unix_sockets_are_out_of_reach(isolation, namespaces, seccomp):
    """Model code runs as an unprivileged uid in both modes, so root's files and root-only
    sockets are closed to it; and with the seccomp filter no socket can be opened at all, so
    not even a socket anyone may use is reachable (without the filter it is: the other layers
    do not cover pathname UNIX sockets)."""
    require(not namespaces or isolation.namespaces, "no namespaces here")
    require(not seccomp or isolation.seccomp, "no seccomp here")
    if not namespaces:
        require_fallback_host()
    require(os.geteuid() == 0, "needs a root server: a root-only socket and /etc/shadow to guard")
    listeners = UnixListeners()
    box = make_sandbox(FAST, namespaces, use_seccomp=seccomp)
    try:
        report = await box.start()
        assert report.namespaces == namespaces and report.seccomp == seccomp
        result = await box.execute(listeners.probe_code())
        lines = result.stdout.splitlines()
        assert lines[0] != "uid 0" and "shadow DENIED PermissionError" in lines, result.tool_text()
        assert "root-only BLOCKED PermissionError" in lines, result.tool_text()
        assert not listeners.arrived("root-only")
        if seccomp:
            assert "world BLOCKED PermissionError" in lines and not listeners.arrived("world")
        else:
            assert "world CONNECTED" in lines and listeners.arrived("world")
    finally:
        listeners.close()
        await box.close()


FORGE_FRAMES = """
import json, os, sys
# Every string the notebook holds that could be a frame's secret, and the frames of each kind.
found = set()
frame = sys._getframe()
while frame is not None:
    for value in list(frame.f_locals.values()):
        values = value.values() if isinstance(value, dict) else [value]
        found.update(v for v in values if isinstance(v, str) and 8 <= len(v) <= 64)
    frame = frame.f_back
tokens = sorted(found)[:50] + ["0" * 32]
fakes = [b"\\0" + t.encode() + b":ok\\0" + b"\\0" + t.encode() + b"\\0" for t in tokens]
fakes += [json.dumps(m).encode() + b"\\n" for m in (
    {"event": "done", "status": "ok"}, {"event": "exit", "code": 0},
    {"event": "ready", "report": {"namespaces": True}})]
# A frame's start without its end, then 64 MB: a reader waiting for the end holds it all.
for fd in (1, 2):
    for t in tokens:
        os.write(fd, b"\\0" + t.encode())
    block = b"A" * (1 << 20)
    for _ in range(64):
        os.write(fd, block)
# Fake frames and a MB without a line end to every other descriptor it can write to.
written = []
for fd in range(3, 1024):
    try:
        for fake in fakes:
            os.write(fd, fake)
        os.write(fd, b"B" * (1 << 20))
        written.append(fd)
    except OSError:
        pass
for fd in (1, 2):
    for fake in fakes:
        os.write(fd, fake)
print("REAL END", written)
"""


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@MODES
async def test_forged_frames_neither_grow_the_server_nor_end_the_cell(isolation, namespaces):
    """A cell writing fake frames (of the old in-band kind, with every string the notebook
    holds as its secret, and of the control pipe's kind) to stdout, stderr and every other
    descriptor it has, and 64 MB after a frame's start: the server's memory stays flat, the cell
    ends when it really ends, its output is what it wrote (bounded), and the session goes on."""
    require(not namespaces or isolation.namespaces, "no namespaces here")
    if not namespaces:
        require_fallback_host()
    box = make_sandbox(SandboxLimits(wall_seconds=60, max_output_chars=2000), namespaces)
    try:
        await box.start()
        server_pid = box.process.pid if hasattr(box, "process") else os.getpid()
        baseline, peak = resident_bytes(server_pid), 0

        async def sample():
            nonlocal peak
            while True:
                peak = max(peak, resident_bytes(server_pid))
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        try:
            result = await box.execute(FORGE_FRAMES)
        finally:
            sampler.cancel()
        assert result.status == "ok", result.tool_text()
        assert re.search(r"REAL END \[.*\]\n$", result.stdout), result.stdout[-300:]
        assert len(result.stdout) < 2200 and "characters omitted" in result.stdout
        assert peak - baseline < 32 << 20, (baseline, peak)
        assert (await box.execute("6 * 7")).tool_text() == "42"
    finally:
        await box.close()


DOUBLE_FORK_DAEMON = """
import os, time
if os.fork() == 0:
    os.setsid()  # out of the session's process group and session
    if os.fork() == 0:
        time.sleep(100_000)  # holds stdout and stderr open, forever
    os._exit(0)
os.wait()
print("daemon started")
"""


@MODES
async def test_a_detached_daemon_dies_with_its_session(isolation, namespaces):
    """A double-forked, setsid daemon holding the output pipes: the next cell still works,
    closing the session returns promptly (it waits on no pipe), and nothing of the session
    outlives it."""
    require(not namespaces or isolation.namespaces, "no namespaces here")
    if not namespaces:
        require_fallback_host()
    box = make_sandbox(FAST, namespaces)
    try:
        result = await box.execute(DOUBLE_FORK_DAEMON)
        assert result.tool_text() == "daemon started"
        scratch_name = os.path.basename(box.scratch_dir)
        assert len(processes_mentioning(scratch_name)) >= 3  # positive control: it runs
        assert (await box.execute("print('next')")).tool_text() == "next"
        start = time.monotonic()
        await asyncio.wait_for(box.close(), 20)
        assert time.monotonic() - start < 10
        await asyncio.sleep(0.2)
        assert processes_mentioning(scratch_name) == []
    finally:
        await box.close()


async def test_a_daemon_does_not_keep_a_response_from_finishing(isolation):
    """Through the tool: the call returns, and closing the tool session (the end of the
    response) returns, with a daemon of the session running."""
    server = await PythonToolServer.start(FAST)
    session = server.open_session()
    result = await asyncio.wait_for(session.call("python", DOUBLE_FORK_DAEMON), 20)
    assert result.text == "daemon started"
    scratch_name = os.path.basename(session.sandbox.scratch_dir)
    await asyncio.wait_for(session.close(), 20)
    await asyncio.sleep(0.2)
    assert processes_mentioning(scratch_name) == []
    await server.aclose()


MEMORY_HOGS = """
import subprocess, sys, time
child = "b = bytearray(b'x') * ({each} << 20); print('held', flush=True); import time; time.sleep({hold})"
children = [subprocess.Popen([sys.executable, "-c", child]) for _ in range({count})]
codes = [c.wait() for c in children]
print("exit codes", sorted(codes))
"""


@pytest.mark.slow
@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "watched"])
async def test_a_session_cannot_pass_its_memory_limit_with_several_processes(cgroup):
    """Four processes of 150 MB each, every one within the per-process limit, in a session
    allowed 400 MB in all: with a cgroup at most two of them get to hold their memory (the
    others are killed by the kernel); watched, the session is stopped within moments. (Before,
    all four held 600 MB.)"""
    limits = SandboxLimits(wall_seconds=30, session_memory_bytes=400 << 20)
    box = PythonSandbox(limits, use_cgroup=cgroup)
    try:
        report = await box.start()
        if cgroup:
            require(report.cgroup != "", "no writable cgroup here")
        assert report.cgroup == ("" if not cgroup else report.cgroup)
        start = time.monotonic()
        result = await box.execute(MEMORY_HOGS.format(each=150, hold=8, count=4))
        elapsed = time.monotonic() - start
        if cgroup:
            codes = re.search(r"exit codes \[(.*)\]", result.stdout).group(1).split(", ")
            assert codes.count("0") <= 2 and codes.count("-9") >= 2, result.tool_text()
            assert result.status == "ok"  # the notebook itself lives on
        else:
            assert result.status == "crashed" and elapsed < 7, (elapsed, result.tool_text())
            assert "in all its processes together, over its limit of 400 MiB" in result.note
            await asyncio.sleep(0.2)
            assert processes_mentioning(os.path.basename(box.scratch_dir)) == []
        # Within the limit, several processes are fine.
        result = await box.execute(MEMORY_HOGS.format(each=60, hold=1, count=3))
        assert "exit codes [0, 0, 0]" in result.stdout, result.tool_text()
    finally:
        await box.close()


@pytest.mark.parametrize("kind", ["bytes", "entries"])
async def test_the_scratch_folder_has_a_quota(kind):
    """Files within the per-file limit that together pass the folder's quota (in bytes, or in
    number): the session is stopped and the files deleted; the next cell runs in a new one.
    (Before, nothing bounded the folder as a whole.)"""
    limits = SandboxLimits(wall_seconds=20, scratch_bytes=20 << 20, scratch_entries=300)
    box = PythonSandbox(limits)
    try:
        if kind == "bytes":
            big = await box.execute("open('one.bin', 'wb').write(b'x' * (30 << 20))")
            assert "File too large" in big.stderr  # one file: RLIMIT_FSIZE, at the quota
            code = (
                "import time\nfor i in range(5):\n    open(f'part{i}.bin', 'wb').write(b'x' * (8 << 20))\ntime.sleep(5)"
            )
        else:
            code = "import time\nfor i in range(1000):\n    open(f'f{i}', 'w').close()\ntime.sleep(5)"
        start = time.monotonic()
        result = await box.execute(code)
        assert result.status == "crashed" and time.monotonic() - start < 4.5, result.tool_text()
        assert "passed the limit of its folder (20 MiB, 300 files and folders)" in result.note
        assert os.listdir(box.scratch_dir) == []
        # Written in one go, then the cell ends: checked as it ends.
        if kind == "bytes":
            code = "for i in range(3):\n    open(f'part{i}.bin', 'wb').write(b'x' * (8 << 20))"
        else:
            code = "for i in range(400):\n    open(f'f{i}', 'w').close()"
        result = await box.execute(code)
        assert result.status == "crashed" and "passed the limit" in result.note, result.tool_text()
        result = await box.execute("open('small.txt', 'w').write('fine')")
        assert result.status == "ok" and "new one" in result.note
        assert os.listdir(box.scratch_dir) == ["small.txt"]
    finally:
        await box.close()


CRASHING_SERVER = """
import asyncio, os, signal, sys
sys.path.insert(0, sys.argv[1])
from tools.python.sandbox import PythonSandbox

async def main():
    box = PythonSandbox()
    await box.execute("open('left.txt', 'w').write('behind')")
    print(box.scratch_dir, box.cgroup.path if box.cgroup else "", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup

asyncio.run(main())
"""


async def test_a_crashed_servers_leftovers_are_removed_at_start(isolation):
    live = PythonSandbox(FAST)
    try:
        await live.execute("open('mine.txt', 'w').write('in use')")
        done = subprocess.run(
            [sys.executable, "-c", CRASHING_SERVER, str(REPO)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == -9, done.stderr
        scratch, group = done.stdout.split("\n")[0].split(" ")
        assert (Path(scratch) / "left.txt").read_text() == "behind"  # positive control: left behind
        assert group == "" or os.path.isdir(group)
        server = await PythonToolServer.start(FAST)
        await server.aclose()
        assert not Path(scratch).exists() and not Path(scratch).parent.exists()
        assert group == "" or not os.path.exists(group)
        # A live server's are kept.
        assert (Path(live.scratch_dir) / "mine.txt").read_text() == "in use"
        assert (await live.execute("open('mine.txt').read()")).tool_text() == "'in use'"
    finally:
        await live.close()
