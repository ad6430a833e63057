"""Runs model-written Python in a separate, confined, resource-limited process.

One `PythonSandbox` is one notebook-like session: a long-lived worker process
(`python_sandbox_worker.py`) that keeps its variables between cells, as the gpt-oss `python`
tool ("a stateful Jupyter notebook environment") promises. The worker never shares memory with
the server, gets no environment variable of the server's, works in a fresh scratch directory
and confines itself before it runs anything (namespaces, Landlock, rlimits, a seccomp filter
that leaves only AF_UNIX sockets: see the worker's docstring). What each cell may use:

- wall time per cell (`wall_seconds`): past it the cell gets a KeyboardInterrupt and the session
  keeps its state; if the cell does not stop within `interrupt_grace_seconds`, the process is
  killed and the next cell starts a fresh session;
- CPU seconds (`cpu_seconds`, for the whole session), address space (`memory_bytes`),
  processes (`max_processes`), file size (`max_file_bytes`), open files (`max_open_files`);
- output: each stream keeps its first and last characters up to `max_output_chars` in all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import secrets
import shutil
import signal
import site
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

WORKER_SCRIPT = Path(__file__).with_name("python_sandbox_worker.py")
# Where the worker mounts the scratch directory when it has a mount namespace.
DATA_MOUNT_HINT = "/mnt/data"
# The throwaway uids a root server runs sessions under, one per session.
SANDBOX_UID_RANGE = (1_900_000_000, 2_000_000_000)
READ_CHUNK = 65536
UTF8_CONTINUATION_BYTES = bytes(range(0x80, 0xC0))


@dataclass
class SandboxLimits:
    wall_seconds: float = 60.0  # per cell
    interrupt_grace_seconds: float = 2.0  # after the interrupt, before the kill
    cpu_seconds: int = 300  # per session (RLIMIT_CPU)
    memory_bytes: int = 2 << 30  # RLIMIT_AS
    max_processes: int = 32  # RLIMIT_NPROC
    max_file_bytes: int = 64 << 20  # RLIMIT_FSIZE
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_output_chars: int = 16_000  # per stream, what the model sees
    startup_seconds: float = 20.0


@dataclass
class IsolationReport:
    """What the worker managed to set up (see the worker's docstring for each layer)."""

    namespaces: bool = False
    user_namespace: bool = False
    private_proc: bool = False
    landlock_abi: int = 0
    seccomp: bool = False  # socket() limited to AF_UNIX
    user: str = ""
    workdir: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def network_blocked(self) -> bool:
        return self.namespaces or self.seccomp or self.landlock_abi >= 4

    def gaps(self) -> list[str]:
        """Protections missing on this machine, in words for a warning."""
        gaps = []
        if not self.namespaces:
            gaps.append("no Linux namespaces (processes it starts can outlive a kill, and it can "
                        "see the server's other processes)")
        if not self.network_blocked:
            gaps.append("network access is not blocked")
        elif not self.namespaces and not self.seccomp:
            gaps.append("only TCP is blocked (Landlock), not UDP")
        if not self.landlock_abi:
            gaps.append("no Landlock: it can read the server user's files"
                        + ("" if self.namespaces else " and write outside its scratch directory"))
        return gaps + self.notes


@dataclass
class ExecutionResult:
    stdout: str
    stderr: str
    status: str  # "ok" | "error" | "timeout" | "crashed"
    note: str = ""  # what the sandbox adds, e.g. why the cell stopped
    exit_code: int | None = None  # of the worker, when it died

    def tool_text(self) -> str:
        """The tool message the model sees: output, errors, then the sandbox's note."""
        parts = [self.stdout, self.stderr]
        if self.note:
            parts.append(f"[{self.note}]")
        return "\n".join(p.rstrip("\n") for p in parts if p.strip())


class _StreamCapture:
    """Collects one output stream of the worker up to its end-of-cell marker, keeping the first
    and last `limit // 2` bytes and counting the characters it drops in between."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.start(None)

    def start(self, nonce: str | None) -> None:
        # The marker is b"\0<nonce>\0" or, on stdout, b"\0<nonce>:<status>\0".
        self.prefix = b"\0" + nonce.encode() if nonce else None
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.window = bytearray()
        self.payload: bytes | None = None
        self.done = asyncio.Event()

    def feed(self, data: bytes) -> None:
        if self.done.is_set() or self.prefix is None:
            return  # output between cells (a background process of the model's) is dropped
        self.window += data
        at = self.window.find(self.prefix)
        if at >= 0:
            end = self.window.find(b"\0", at + len(self.prefix))
            if end >= 0:
                self._keep(self.window[:at])
                self.payload = bytes(self.window[at + len(self.prefix) : end]).lstrip(b":")
                self.window.clear()
                self.done.set()
                return
            safe = at
        else:
            safe = max(0, len(self.window) - len(self.prefix))
        self._keep(self.window[:safe])
        del self.window[:safe]

    def _keep(self, data: bytes) -> None:
        half = self.limit // 2
        room = max(0, half - len(self.head))
        self.head += data[:room]
        self.tail += data[room:]
        if len(self.tail) > half:
            cut = len(self.tail) - half
            # Count characters, not bytes: UTF-8 continuation bytes start no character.
            self.dropped += len(self.tail[:cut].translate(None, UTF8_CONTINUATION_BYTES))
            del self.tail[:cut]

    def text(self, max_chars: int) -> str:
        head = self.head.decode("utf-8", "replace")
        tail = (self.tail + self.window).decode("utf-8", "replace")
        if not self.dropped:
            return _clip(head + tail, max_chars)
        half = max_chars // 2
        omitted = self.dropped + max(0, len(head) - half) + max(0, len(tail) - half)
        return f"{head[:half]}\n[... about {omitted} characters omitted ...]\n{tail[-half:]}"


def _clip(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters omitted ...]\n{text[-half:]}"


def python_paths() -> list[str]:
    """Directories the sandboxed interpreter must read: its installation and site-packages."""
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)}
    candidates.update(site.getsitepackages())
    real = sorted({os.path.realpath(p) for p in candidates if os.path.isdir(p)})
    # Keep only the outermost ones: binding a directory covers everything under it.
    return [p for p in real if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in real)]


def sandbox_environment(workdir: str) -> dict[str, str]:
    """The worker's whole environment: nothing of the server's (its API keys stay out)."""
    bin_dir = os.path.dirname(os.path.realpath(sys.executable))
    return {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "MPLBACKEND": "Agg",
        # One thread each: fewer processes against RLIMIT_NPROC, less address space reserved.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


class SandboxError(RuntimeError):
    """The sandbox process could not be started."""


class PythonSandbox:
    """One stateful Python session in a confined worker process.

    `execute(code)` never raises for anything the code does; it starts the worker on first use
    and again after the worker died (the result's note then says the state was lost).
    """

    def __init__(self, limits: SandboxLimits | None = None, *, scratch_root: str | None = None,
                 use_namespaces: bool = True, use_landlock: bool = True, use_seccomp: bool = True):
        self.limits = limits or SandboxLimits()
        self.scratch_root = scratch_root
        self.use_namespaces = use_namespaces
        self.use_landlock = use_landlock
        self.use_seccomp = use_seccomp
        self.scratch_dir: str | None = None
        # A root server runs the session under this uid, the same after a restart: the files the
        # last worker left in the scratch directory are the next one's.
        self.sandbox_uid = random.randrange(*SANDBOX_UID_RANGE)
        self.report: IsolationReport | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._killed = False  # killed mid-cell by a cancelled call: the next call starts anew
        self._stdout = _StreamCapture(self._capture_bytes)
        self._stderr = _StreamCapture(self._capture_bytes)
        self._pumps: list[asyncio.Task] = []
        self._lock = asyncio.Lock()
        self._sessions_started = 0

    @property
    def _capture_bytes(self) -> int:
        return 4 * self.limits.max_output_chars  # UTF-8 is at most 4 bytes a character

    @property
    def running(self) -> bool:
        # (a worker killed mid-cell may not be reaped yet: its returncode can still be None)
        return self._process is not None and self._process.returncode is None and not self._killed

    async def start(self) -> IsolationReport:
        """Start the worker (if not running) and return what confinement it achieved."""
        if not self.running:
            await self._spawn()
        assert self.report is not None
        return self.report

    async def _spawn(self) -> None:
        try:
            await self._spawn_once()
        except SandboxError as e:
            if not self.use_namespaces:
                raise
            # Some kernels let us create namespaces but not use them (e.g. AppArmor-restricted
            # user namespaces): fall back to Landlock and rlimits alone.
            logger.warning("Python sandbox: namespaces unusable here (%s); continuing without", e)
            self.use_namespaces = False
            await self._spawn_once()

    async def _spawn_once(self) -> None:
        await self._stop_process()
        self._killed = False
        if self.scratch_dir is None:
            self.scratch_dir = tempfile.mkdtemp(prefix="oss-agent-python-", dir=self.scratch_root)
        hello = secrets.token_hex(16)
        config = {
            "nonce": hello,
            "scratch": os.path.realpath(self.scratch_dir),
            "python_paths": python_paths(),
            "sandbox_uid": self.sandbox_uid,
            "use_namespaces": self.use_namespaces,
            "use_landlock": self.use_landlock,
            "use_seccomp": self.use_seccomp,
            "limits": {
                "cpu_seconds": self.limits.cpu_seconds,
                "memory_bytes": self.limits.memory_bytes,
                "max_processes": self.limits.max_processes,
                "max_file_bytes": self.limits.max_file_bytes,
                "max_open_files": self.limits.max_open_files,
            },
        }
        # -u: unbuffered stdout, so what a cell printed is in the pipe even if the worker is then
        # killed or crashes, and in order with what its child processes write.
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-u", str(WORKER_SCRIPT), json.dumps(config),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=sandbox_environment(self.scratch_dir),
            cwd=self.scratch_dir, start_new_session=True, close_fds=True,
        )
        self._sessions_started += 1
        self._stdout.start(hello)
        self._stderr.start(hello)
        self._pumps = [asyncio.create_task(self._pump(self._process.stdout, self._stdout)),
                       asyncio.create_task(self._pump(self._process.stderr, self._stderr))]
        finished = await self._wait_for_markers(self.limits.startup_seconds)
        if not finished:
            detail = self._stderr.text(2000).strip()
            await self._stop_process()
            raise SandboxError(f"the Python sandbox did not start: {detail or 'no output'}")
        fields = json.loads(self._stdout.payload or b"{}")
        self.report = IsolationReport(**fields)

    @staticmethod
    async def _pump(stream: asyncio.StreamReader, capture: _StreamCapture) -> None:
        while chunk := await stream.read(READ_CHUNK):
            capture.feed(chunk)

    async def _wait_for_markers(self, timeout: float) -> bool:
        """Wait until both streams delivered their marker, or the worker died, or timeout."""
        assert self._process is not None

        async def both_markers() -> None:
            await self._stdout.done.wait()
            await self._stderr.done.wait()

        markers = asyncio.create_task(both_markers())
        exited = asyncio.create_task(self._process.wait())
        _, pending = await asyncio.wait({markers, exited}, timeout=timeout,
                                        return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if self._stdout.done.is_set() and self._stderr.done.is_set():
            return True
        if self._process.returncode is not None:
            # Let the pumps drain what the worker wrote before it died.
            await asyncio.wait(self._pumps, timeout=1.0)
        return False

    async def execute(self, code: str) -> ExecutionResult:
        async with self._lock:
            restarted = ""
            if not self.running:
                if self._sessions_started:
                    restarted = "The previous Python session ended; this ran in a new one, " \
                                "so earlier variables and imports are gone."
                await self._spawn()
            try:
                result = await self._run_cell(code)
            except asyncio.CancelledError:
                # The caller gave up mid-cell: don't leave a cell running into the next call,
                # which starts a new session (the kill is reaped there).
                self._kill_now()
                self._killed = True
                raise
            if restarted:
                result.note = " ".join(filter(None, [restarted, result.note]))
            return result

    async def _run_cell(self, code: str) -> ExecutionResult:
        assert self._process is not None and self._process.stdin is not None
        nonce = secrets.token_hex(16)
        self._stdout.start(nonce)
        self._stderr.start(nonce)
        body = json.dumps({"code": code, "nonce": nonce}).encode()
        try:
            self._process.stdin.write(len(body).to_bytes(4, "big") + body)
            await self._process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the worker is gone; the wait below reports how it ended

        if await self._wait_for_markers(self.limits.wall_seconds):
            status = self._stdout.payload.decode()
            return self._result("ok" if status == "ok" else "error")
        if self._process.returncode is None:
            # Over time: interrupt the cell (KeyboardInterrupt), keep the session if it stops.
            # The launcher passes SIGINT on to the notebook process only, not to its children.
            self._process.send_signal(signal.SIGINT)
            if await self._wait_for_markers(self.limits.interrupt_grace_seconds):
                return self._result("timeout", note=f"Execution timed out after "
                                    f"{self.limits.wall_seconds:g} seconds and was interrupted; "
                                    f"the session state was kept.")
            await self._stop_process()
            return self._result("timeout", note=f"Execution timed out after "
                                f"{self.limits.wall_seconds:g} seconds and did not stop when "
                                f"interrupted; the Python session was restarted and its state "
                                f"is lost.")
        return self._result("crashed", note=self._death_note(self._process.returncode),
                            exit_code=self._process.returncode)

    def _result(self, status: str, note: str = "", exit_code: int | None = None) -> ExecutionResult:
        chars = self.limits.max_output_chars
        return ExecutionResult(stdout=self._stdout.text(chars), stderr=self._stderr.text(chars),
                               status=status, note=note, exit_code=exit_code)

    def _death_note(self, returncode: int) -> str:
        # The worker passes on a signal death as 128 + signal number (or asyncio's negative).
        sig = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
        reason = {
            signal.SIGXCPU: f"it used up its CPU time ({self.limits.cpu_seconds} s per session)",
            signal.SIGKILL: "it was killed (often: out of memory)",
            signal.SIGSEGV: "it crashed (segmentation fault)",
        }.get(sig, f"it exited with status {returncode}")
        return f"The Python process stopped: {reason}. Its state is lost; the next call starts " \
               f"a new session."

    def _kill_now(self) -> None:
        """SIGKILL the worker. Killing the launcher kills the namespace's init (parent-death
        signal) and so every process in the namespace; the group kill covers the no-namespace
        case."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            process.kill()
        except ProcessLookupError:
            pass

    async def _stop_process(self) -> None:
        self._kill_now()
        process, self._process = self._process, None
        if process is None:
            return
        await process.wait()
        for task in self._pumps:
            task.cancel()
        self._pumps = []
        if process.stdin is not None:
            process.stdin.close()

    async def close(self) -> None:
        """Stop the worker and delete the scratch directory."""
        async with self._lock:
            await self._stop_process()
            if self.scratch_dir is not None:
                shutil.rmtree(self.scratch_dir, ignore_errors=True)
                self.scratch_dir = None


async def probe_isolation(limits: SandboxLimits | None = None, **options) -> IsolationReport:
    """Start one sandbox and report what confinement this machine allows."""
    sandbox = PythonSandbox(limits, **options)
    try:
        return await sandbox.start()
    finally:
        await sandbox.close()
