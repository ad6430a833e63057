"""Runs model-written Python in a separate, confined, resource-limited process.

One `PythonSandbox` is one notebook-like session: a long-lived worker process
(`sandbox_worker.py`) that keeps its variables between cells, as the gpt-oss `python`
tool ("a stateful Jupyter notebook environment") promises. The worker never shares memory with
the server, gets no environment variable of the server's, works in a scratch directory of its
own (`tools/python/scratch.py`) and confines itself before it runs anything (namespaces, another uid,
Landlock, rlimits, a seccomp filter that leaves no way to open a socket: see the worker's
docstring). What a session may use:

- wall time per cell (`wall_seconds`): past it the cell gets a KeyboardInterrupt and the session
  keeps its state; if the cell does not stop within `interrupt_grace_seconds`, the process is
  killed and the next cell starts a fresh session;
- CPU seconds (`cpu_seconds`, for the whole session), address space per process
  (`memory_bytes`), processes (`max_processes`), file size (`max_file_bytes`), open files
  (`max_open_files`);
- memory of all its processes together (`session_memory_bytes`): capped by a cgroup where the
  server can make one (`tools/python/cgroup.py`), else measured every `WATCH_SECONDS` and the session
  stopped once over;
- its scratch directory (`scratch_bytes`, `scratch_entries`), measured while it runs and after
  each cell: over either, the session is stopped and the files deleted;
- output: each stream keeps its first and last characters up to `max_output_chars` in all.

The server reads the cells' output from plain pipes, bounded as above, and learns that a cell
ended from a third pipe only the worker's keeper holds, so nothing a cell prints is taken for
the sandbox's own messages. Ending a session kills every process it started, detached ones
included (the PID namespace, the cgroup, or the session's own uid), and never waits for a pipe
that a stray process may hold open.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import signal
import site
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tools.python import cgroup as python_cgroup
from tools.python.scratch import empty_folder, scratch_area, usage
from tools.python.watch import tree_memory

logger = logging.getLogger(__name__)

WORKER_SCRIPT = Path(__file__).with_name("sandbox_worker.py")
# Where the worker mounts the scratch directory when it has a mount namespace.
DATA_MOUNT_HINT = "/mnt/data"
# The throwaway uids a root server runs sessions under, one per session.
SANDBOX_UID_RANGE = (1_900_000_000, 2_000_000_000)
READ_CHUNK = 65536
MAX_CONTROL_LINE = 65536  # the worker's report is the longest message
MAX_DRAIN_BYTES = 4 << 20  # read after a cell ended: what it left in a pipe (64 KiB, or 1 MiB enlarged)
WATCH_SECONDS = 0.25  # memory, where no cgroup caps it
DISK_WATCH_EVERY = 4  # the scratch directory every this many memory checks
UTF8_CONTINUATION_BYTES = bytes(range(0x80, 0xC0))
# Kills every process of the session's uid but itself, run as that uid: one pass reaches all,
# a few more any forked meanwhile (`--`: dash's kill would read -1 as an option).
KILL_ALL_OF_UID = "for i in 1 2 3 4 5; do kill -s KILL -- -1 2>/dev/null || break; done"


@dataclass
class SandboxLimits:
    wall_seconds: float = 60.0  # per cell
    interrupt_grace_seconds: float = 2.0  # after the interrupt, before the kill
    cpu_seconds: int = 300  # per session (RLIMIT_CPU)
    memory_bytes: int = 2 << 30  # per process (RLIMIT_AS)
    session_memory_bytes: int = 2 << 30  # all of a session's processes together
    max_processes: int = 32  # RLIMIT_NPROC
    max_file_bytes: int = 64 << 20  # RLIMIT_FSIZE
    scratch_bytes: int = 1 << 30  # the scratch directory's disk use
    scratch_entries: int = 20_000  # files and folders in it
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
    seccomp: bool = False  # no socket(); socketpair() for connected AF_UNIX pairs only
    user: str = ""
    workdir: str = ""
    cgroup: str = ""  # "v2" | "v1" | "" (memory then watched, not capped)
    notes: list[str] = field(default_factory=list)

    @property
    def network_blocked(self) -> bool:
        return self.namespaces or self.seccomp or self.landlock_abi >= 4

    def gaps(self) -> list[str]:
        """Protections missing on this machine, in words for a warning."""
        gaps = []
        if not self.namespaces:
            gaps.append("no Linux namespaces (it can see the server's other processes)")
            if self.user == "the server's user" and not self.cgroup and self.landlock_abi < 6:
                gaps.append(
                    "it runs as the server's user with no cgroup: a process it detaches can outlive its session"
                )
        if not self.network_blocked:
            gaps.append("network access is not blocked")
        elif not self.namespaces and not self.seccomp:
            gaps.append("only TCP is blocked (Landlock), not UDP")
        if not self.seccomp:
            gaps.append("no seccomp filter: it can connect to the host's UNIX sockets its uid may write to")
        if not self.landlock_abi:
            gaps.append(
                "no Landlock: it can read the files its uid may read"
                + ("" if self.namespaces else " and write outside its scratch directory")
            )
        if not self.cgroup:
            gaps.append(
                f"no cgroup: the memory of a session's processes together is checked "
                f"every {WATCH_SECONDS:g} s, not capped"
            )
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


class _OutputCapture:
    """One output stream of the current cell: its first and last `limit // 2` bytes, and a
    count of the characters dropped in between. Between cells, output is dropped."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.start()

    def start(self) -> None:
        self.active = True
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def stop(self) -> None:
        self.active = False

    def feed(self, data: bytes) -> None:
        if not self.active:
            return  # output between cells (a background process of the model's) is dropped
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
        tail = self.tail.decode("utf-8", "replace")
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

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        scratch_root: str | None = None,
        use_namespaces: bool = True,
        use_landlock: bool = True,
        use_seccomp: bool = True,
        use_cgroup: bool = True,
    ):
        self.limits = limits or SandboxLimits()
        self.area = scratch_area(scratch_root)
        self.use_namespaces = use_namespaces
        self.use_landlock = use_landlock
        self.use_seccomp = use_seccomp
        self.use_cgroup = use_cgroup
        self.scratch_dir: str | None = None
        self.cgroup: python_cgroup.SessionCgroup | None = None
        # A root server runs the session under this uid, the same after a restart: the files the
        # last worker left in the scratch directory are the next one's.
        self.sandbox_uid = random.randrange(*SANDBOX_UID_RANGE)
        self.report: IsolationReport | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._fds: dict[str, int] = {}  # our ends of the worker's pipes
        self._killed = False  # killed mid-cell by a cancelled call: the next call starts anew
        self._stdout = _OutputCapture(self._capture_bytes)
        self._stderr = _OutputCapture(self._capture_bytes)
        self._control = bytearray()
        self._ready: asyncio.Future | None = None
        self._done: asyncio.Future | None = None
        self._exit_code: int | None = None  # the notebook's, as the keeper reported it
        self._stopped_because = ""  # a limit the session passed, for the result's note
        self._wipe_scratch = False
        self._watch: asyncio.Task | None = None
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
        self._stopped_because, self._wipe_scratch, self._exit_code = "", False, None
        if self.scratch_dir is None:
            self.scratch_dir = await asyncio.to_thread(self.area.new_session_dir)
        if self.use_cgroup and self.cgroup is None:
            self.cgroup = await asyncio.to_thread(
                python_cgroup.create,
                self.area.server_tag,
                os.path.basename(self.scratch_dir),
                self.limits.session_memory_bytes,
                self.limits.max_processes,
            )
            self.use_cgroup = self.cgroup is not None  # (no second try for every restart)
        limits = self.limits
        config = {
            "scratch": os.path.realpath(self.scratch_dir),
            "python_paths": python_paths(),
            "sandbox_uid": self.sandbox_uid,
            "use_namespaces": self.use_namespaces,
            "use_landlock": self.use_landlock,
            "use_seccomp": self.use_seccomp,
            "cgroup_procs": self.cgroup.procs_file if self.cgroup else None,
            "limits": {
                "cpu_seconds": limits.cpu_seconds,
                "memory_bytes": limits.memory_bytes,
                "max_processes": limits.max_processes,
                "max_file_bytes": min(limits.max_file_bytes, limits.scratch_bytes),
                "max_open_files": limits.max_open_files,
            },
        }
        requests_r, requests_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        control_r, control_w = os.pipe()
        config["control_fd"] = control_w
        self._fds = {"requests": requests_w, "stdout": out_r, "stderr": err_r, "control": control_r}
        self._control.clear()
        self._stdout.start()  # (what the worker says if it fails to start)
        self._stderr.start()
        self._ready = asyncio.get_running_loop().create_future()
        try:
            # -u: unbuffered stdout, so what a cell printed is in the pipe even if the worker is
            # then killed or crashes, and in order with what its child processes write.
            self._process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-u",
                str(WORKER_SCRIPT),
                json.dumps(config),
                stdin=requests_r,
                stdout=out_w,
                stderr=err_w,
                pass_fds=(control_w,),
                env=sandbox_environment(self.scratch_dir),
                cwd=self.scratch_dir,
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            self._close_fds()
            raise
        finally:
            for fd in (requests_r, out_w, err_w, control_w):
                os.close(fd)
        self._sessions_started += 1
        loop = asyncio.get_running_loop()
        for name in ("requests", "stdout", "stderr", "control"):
            os.set_blocking(self._fds[name], False)
        loop.add_reader(out_r, self._on_output, out_r, self._stdout)
        loop.add_reader(err_r, self._on_output, err_r, self._stderr)
        loop.add_reader(control_r, self._on_control)
        if await self._wait_for(self._ready, limits.startup_seconds) != "done":
            self._drain()
            detail = self._stderr.text(2000).strip()
            await self._stop_process()
            raise SandboxError(f"the Python sandbox did not start: {detail or 'no output'}")
        self.report = IsolationReport(**self._ready.result(), cgroup=f"v{self.cgroup.version}" if self.cgroup else "")
        self._stdout.stop()
        self._stderr.stop()
        self._watch = asyncio.create_task(self._watch_limits(self._process))

    # -- reading the worker's pipes (callbacks of the event loop, each read bounded)

    def _on_output(self, fd: int, capture: _OutputCapture) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # every writer closed it
            asyncio.get_running_loop().remove_reader(fd)
            return
        capture.feed(data)

    def _drain(self) -> None:
        """Read what the output pipes hold now: all a finished cell printed is there."""
        for name, capture in (("stdout", self._stdout), ("stderr", self._stderr)):
            fd, taken = self._fds.get(name), 0
            while fd is not None and taken < MAX_DRAIN_BYTES:
                try:
                    data = os.read(fd, READ_CHUNK)
                except OSError:  # (BlockingIOError: empty)
                    break
                if not data:
                    break
                capture.feed(data)
                taken += len(data)

    def _on_control(self) -> None:
        fd = self._fds["control"]
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(fd)
            return
        self._control += data
        while (end := self._control.find(b"\n")) >= 0:
            line = bytes(self._control[:end])
            del self._control[: end + 1]
            try:
                message = json.loads(line)
                self._on_message(message["event"], message)
            except (ValueError, KeyError, TypeError):
                self._broken_control(f"an unreadable message: {line[:100]!r}")
                return
        if len(self._control) > MAX_CONTROL_LINE:
            self._broken_control("a message over its size limit")

    def _on_message(self, event: str, message: dict) -> None:
        if event == "ready" and self._ready is not None and not self._ready.done():
            self._ready.set_result(message["report"])
        elif event == "done" and self._done is not None and not self._done.done():
            self._done.set_result(str(message["status"]))
        elif event == "exit":
            self._exit_code = int(message["code"])

    def _broken_control(self, what: str) -> None:
        # Only the keeper writes there; should it ever not make sense, end the session.
        logger.error("python sandbox: %s on the control pipe; stopping the session", what)
        self._control.clear()
        asyncio.get_running_loop().remove_reader(self._fds["control"])
        self._stopped_because = "The sandbox's control channel failed, so the session was stopped."
        self._kill_now()

    async def _send(self, data: bytes) -> None:
        """Write a request to the worker without blocking the loop (a big cell fills the pipe)."""
        loop = asyncio.get_running_loop()
        fd, view = self._fds["requests"], memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                writable = loop.create_future()
                loop.add_writer(fd, _resolve, writable)
                try:
                    await writable
                finally:
                    loop.remove_writer(fd)
            except OSError:
                return  # the worker is gone; the wait that follows reports how it ended

    async def _wait_for(self, future: asyncio.Future, timeout: float) -> str:
        """ "done" when `future` resolves, "exited" if the worker ends first, else "timeout"."""
        assert self._process is not None
        exited = asyncio.ensure_future(self._process.wait())
        await asyncio.wait({future, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        exited.cancel()
        if future.done():
            return "done"
        return "exited" if self._process.returncode is not None else "timeout"

    # -- running cells

    async def execute(self, code: str) -> ExecutionResult:
        async with self._lock:
            restarted = ""
            if not self.running:
                if self._sessions_started:
                    restarted = " ".join(
                        filter(
                            None,
                            [
                                self._stopped_because,
                                (
                                    "The previous Python session ended; this ran in a new one, so earlier "
                                    "variables and imports are gone."
                                ),
                            ],
                        )
                    )
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
        assert self._process is not None
        self._stdout.start()
        self._stderr.start()
        self._done = asyncio.get_running_loop().create_future()
        body = json.dumps({"code": code}).encode()
        await self._send(len(body).to_bytes(4, "big") + body)

        outcome = await self._wait_for(self._done, self.limits.wall_seconds)
        if outcome == "done":
            return await self._finished(self._done.result())
        if outcome == "timeout":
            # Over time: interrupt the cell (KeyboardInterrupt), keep the session if it stops.
            # The keeper passes SIGINT on to the notebook process only, not to its children.
            self._process.send_signal(signal.SIGINT)
            if await self._wait_for(self._done, self.limits.interrupt_grace_seconds) == "done":
                return await self._finished(
                    "timeout",
                    note=f"Execution timed out after {self.limits.wall_seconds:g} "
                    f"seconds and was interrupted; the session state was kept.",
                )
            self._drain()
            await self._stop_process()
            return self._result(
                "timeout",
                note=f"Execution timed out after "
                f"{self.limits.wall_seconds:g} seconds and did not stop when "
                f"interrupted; the Python session was restarted and its state "
                f"is lost.",
            )
        self._drain()
        code = self._exit_code if self._exit_code is not None else self._process.returncode
        note = self._stopped_because or self._death_note(code)
        await self._stop_process()
        return self._result("crashed", note=note, exit_code=code)

    async def _finished(self, status: str, note: str = "") -> ExecutionResult:
        """The result of a cell that ended; its files are checked against the quota first."""
        self._drain()
        over = await asyncio.to_thread(self._scratch_over_quota)
        if over:
            self._stopped_because = over
            await self._stop_process()
            return self._result("crashed", note=over)
        if status not in ("ok", "timeout"):
            status = "error"
        return self._result(status, note=note)

    def _result(self, status: str, note: str = "", exit_code: int | None = None) -> ExecutionResult:
        chars = self.limits.max_output_chars
        self._stdout.stop()
        self._stderr.stop()
        return ExecutionResult(
            stdout=self._stdout.text(chars),
            stderr=self._stderr.text(chars),
            status=status,
            note=note,
            exit_code=exit_code,
        )

    def _death_note(self, returncode: int) -> str:
        # The worker passes on a signal death as 128 + signal number (or asyncio's negative).
        sig = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
        if sig == signal.SIGKILL and self.cgroup is not None and self.cgroup.oom_kills():
            return (
                f"The Python process stopped: it ran out of memory (a session's processes "
                f"may use {_size(self.limits.session_memory_bytes)} together). Its state is "
                f"lost; the next call starts a new session."
            )
        reason = {
            signal.SIGXCPU: f"it used up its CPU time ({self.limits.cpu_seconds} s per session)",
            signal.SIGKILL: "it was killed (often: out of memory)",
            signal.SIGSEGV: "it crashed (segmentation fault)",
        }.get(sig, f"it exited with status {returncode}")
        return f"The Python process stopped: {reason}. Its state is lost; the next call starts a new session."

    # -- limits on the session as a whole

    async def _watch_limits(self, process: asyncio.subprocess.Process) -> None:
        """While `process` runs: its processes' memory (without a cgroup) and its files."""
        checks = 0
        while process.returncode is None:
            await asyncio.sleep(WATCH_SECONDS)
            checks += 1
            over = await asyncio.to_thread(self._over_limits, process.pid, checks % DISK_WATCH_EVERY == 0)
            if over and process is self._process and process.returncode is None:
                self._stopped_because = over
                self._kill_now()
                return

    def _over_limits(self, pid: int, check_disk: bool) -> str:
        if self.cgroup is None:
            used = tree_memory(pid)
            if used > self.limits.session_memory_bytes:
                return (
                    f"The Python session used {_size(used)} of memory in all its processes "
                    f"together, over its limit of {_size(self.limits.session_memory_bytes)}; "
                    f"it was stopped and its state is lost."
                )
        return self._scratch_over_quota() if check_disk else ""

    def _scratch_over_quota(self) -> str:
        if self.scratch_dir is None:
            return ""
        limits = self.limits
        used = usage(self.scratch_dir, limits.scratch_bytes, limits.scratch_entries)
        if used.bytes <= limits.scratch_bytes and used.entries <= limits.scratch_entries:
            return ""
        self._wipe_scratch = True
        return (
            f"The session's files passed the limit of its folder ({_size(limits.scratch_bytes)}, "
            f"{limits.scratch_entries} files and folders): the session was stopped, and its "
            f"files deleted."
        )

    # -- stopping

    def _kill_now(self) -> None:
        """SIGKILL the worker, its process group and its cgroup. Killing the launcher kills the
        namespace's init (parent-death signal) and so every process in the namespace; without
        namespaces `_sweep` gets the processes that left the group."""
        process = self._process
        if process is not None and process.returncode is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                process.kill()
            except ProcessLookupError:
                pass
        if self.cgroup is not None:
            self.cgroup.kill()

    async def _sweep(self) -> None:
        """After the worker died: kill what the session left (a detached process), and delete
        its files if they were over their quota."""
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill)
        elif os.geteuid() == 0 and not (self.report is not None and self.report.namespaces):
            # Every process of the session's own uid, wherever it went (a PID namespace needs
            # none of this: its processes died with its init).
            sweep = await asyncio.create_subprocess_exec(
                "/bin/sh",
                "-c",
                KILL_ALL_OF_UID,
                user=self.sandbox_uid,
                group=self.sandbox_uid,
                extra_groups=[],
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                env={"PATH": "/usr/bin:/bin"},
                cwd="/",
            )
            await sweep.wait()
        if self._wipe_scratch and self.scratch_dir is not None:
            await asyncio.to_thread(empty_folder, self.scratch_dir)
            self._wipe_scratch = False

    async def _stop_process(self) -> None:
        self._kill_now()
        process, self._process = self._process, None
        watch, self._watch = self._watch, None
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()
        if process is not None:
            try:
                await asyncio.wait_for(process.wait(), 10)
            except asyncio.TimeoutError:
                logger.error("python sandbox: worker %d did not die", process.pid)
            await self._sweep()
        self._close_fds()

    def _close_fds(self) -> None:
        loop = asyncio.get_running_loop()
        for name, fd in self._fds.items():
            if name == "requests":
                loop.remove_writer(fd)
            else:
                loop.remove_reader(fd)
            os.close(fd)
        self._fds = {}

    async def close(self) -> None:
        """Stop the worker and delete its cgroup and scratch directory."""
        async with self._lock:
            await self._stop_process()
            if self.cgroup is not None:
                await asyncio.to_thread(self.cgroup.remove)
                self.cgroup = None
            if self.scratch_dir is not None:
                await asyncio.to_thread(shutil.rmtree, self.scratch_dir, True)
                self.scratch_dir = None


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _size(n: int) -> str:
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


async def probe_isolation(limits: SandboxLimits | None = None, **options) -> IsolationReport:
    """Start one sandbox and report what confinement this machine allows."""
    sandbox = PythonSandbox(limits, **options)
    try:
        return await sandbox.start()
    finally:
        await sandbox.close()


async def clean_stale_sessions(scratch_root: str | None = None) -> list[str]:
    """Delete what servers that are gone left behind: their scratch folders and cgroups (and
    any process still in those). Returns the servers' tags."""
    area = scratch_area(scratch_root)

    def clean() -> list[str]:
        tags = area.stale_server_tags()
        python_cgroup.remove_stale(tags)
        area.clean_stale()
        return tags

    return await asyncio.to_thread(clean)
