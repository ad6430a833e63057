"""The Python sandbox's fallback mode (no namespaces) on a machine whose Python only root can
read, such as a pyenv under /root, run as root.

There the sandbox refuses to run model code at all (it would have to stay root). To test what
the fallback mode does where it can run, a container with Python under /usr/local for
instance, `host_command` runs a Python process in a private mount namespace in which the
installation is readable by every user (a tmpfs over the blocking folders with the installation
bound back, as the sandbox's own namespace mode does); the sandbox inside it makes no namespace
of its own. `HostedSandbox` drives a `PythonSandbox` in such a process, with the same methods.
Where Python is readable by every user anyway, or the tests do not run as root, both run things
as they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from pathlib import Path

from tools.python.sandbox import ExecutionResult, IsolationReport, SandboxError, SandboxLimits, python_paths
from tools.python.sandbox_worker import _reachable

REPO = Path(__file__).resolve().parents[1]

# argv: repo, python paths, then the python arguments to run in the new mount namespace.
HOST_BOOTSTRAP = """
import ctypes, importlib.util, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x00020000) != 0:
    sys.exit("no mount namespace for the test host: " + os.strerror(ctypes.get_errno()))
spec = importlib.util.spec_from_file_location("worker", sys.argv[1] + "/tools/python/sandbox_worker.py")
worker = sys.modules["worker"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)
worker._mount(None, "/", None, worker.MS_REC | worker.MS_PRIVATE)
worker.expose_paths(sys.argv[2].split(os.pathsep))
os.execv(sys.executable, [sys.executable] + sys.argv[3:])
"""

DRIVER = """
import asyncio, dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from tools.python.sandbox import PythonSandbox, SandboxLimits

async def main():
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    box = None
    while line := await reader.readline():
        command = json.loads(line)
        reply = {}
        try:
            if command["op"] == "open":
                box = PythonSandbox(SandboxLimits(**command["limits"]), **command["options"])
            elif command["op"] == "start":
                await box.start()
            elif command["op"] == "execute":
                reply["result"] = dataclasses.asdict(await box.execute(command["code"]))
            elif command["op"] == "close":
                await box.close()
            if box is not None:
                reply["scratch_dir"] = box.scratch_dir
                reply["report"] = dataclasses.asdict(box.report) if box.report else None
        except Exception as e:
            reply["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(reply), flush=True)

asyncio.run(main())
"""


def python_private_to_root() -> bool:
    """Running as root with a Python installation other uids cannot read."""
    return os.geteuid() == 0 and not all(_reachable(path) for path in python_paths())


def host_command(python_args: list[str]) -> list[str]:
    """The command running `python <python_args>` on a host whose Python every user can read."""
    if not python_private_to_root():
        return [sys.executable, *python_args]
    return [sys.executable, "-c", HOST_BOOTSTRAP, str(REPO), os.pathsep.join(python_paths()), *python_args]


class HostedSandbox:
    """A `PythonSandbox(limits, **options)` in a process started by `host_command`."""

    def __init__(self, limits: SandboxLimits, **options):
        self.limits = limits
        self.options = options
        self.scratch_dir: str | None = None
        self.report: IsolationReport | None = None
        self.process: asyncio.subprocess.Process | None = None

    async def _call(self, **command) -> dict:
        if self.process is None:
            self.process = await asyncio.create_subprocess_exec(
                *host_command(["-c", DRIVER, str(REPO)]),
                cwd=REPO,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            await self._call(op="open", limits=dataclasses.asdict(self.limits), options=self.options)
        self.process.stdin.write(json.dumps(command).encode() + b"\n")
        await self.process.stdin.drain()
        line = await self.process.stdout.readline()
        if not line:
            raise SandboxError(f"the test host exited with {await self.process.wait()}")
        reply = json.loads(line)
        self.scratch_dir = reply.get("scratch_dir", self.scratch_dir)
        if reply.get("report"):
            self.report = IsolationReport(**reply["report"])
        if "error" in reply:
            raise SandboxError(reply["error"])
        return reply

    async def start(self) -> IsolationReport:
        await self._call(op="start")
        return self.report

    async def execute(self, code: str) -> ExecutionResult:
        return ExecutionResult(**(await self._call(op="execute", code=code))["result"])

    async def close(self) -> None:
        if self.process is None:
            return
        try:
            await self._call(op="close")
        finally:
            self.process.stdin.close()
            await self.process.wait()
            self.process = None


def make_sandbox(limits: SandboxLimits, namespaces: bool, **options):
    """A sandbox in the namespace mode, or in the fallback mode on a host where it can run."""
    from tools.python.sandbox import PythonSandbox

    if namespaces or not python_private_to_root():
        return PythonSandbox(limits, use_namespaces=namespaces, **options)
    return HostedSandbox(limits, use_namespaces=False, **options)
