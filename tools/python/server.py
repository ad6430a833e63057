"""The built-in `python` tool: a sandboxed, stateful notebook per response.

State: gpt-oss was trained with a Python tool described as "a stateful Jupyter notebook
environment", so it writes later cells that use earlier variables. Each `ToolSession` (one
response, however many calls it makes) therefore owns one long-lived sandbox process whose
variables persist across calls; a new response starts a clean one, and closing the session
deletes its process and files. Only sandbox failures (a timeout, a crash, a sandbox that would
not start) set `is_error`; an exception in the model's code is ordinary output (a traceback),
as in a notebook.
"""

from __future__ import annotations

import json
import logging
import weakref

from openai_harmony import ToolNamespaceConfig

from tools.protocol import ToolResult
from tools.python.sandbox import (
    DATA_MOUNT_HINT,
    IsolationReport,
    PythonSandbox,
    SandboxError,
    SandboxLimits,
    clean_stale_sessions,
    probe_isolation,
)

logger = logging.getLogger(__name__)

DESCRIPTION = (
    "Use this tool to execute Python code in your chain of thought. The code will not be shown "
    "to the user. This tool should be used for internal reasoning, but not for code that is "
    "intended to be visible to the user (e.g. when creating plots, tables, or files).\n\n"
    "When you send a message containing Python code to python, it will be executed in a "
    "stateful Jupyter notebook environment. python will respond with the output of the "
    "execution or time out after {timeout:.1f} seconds. {drive} Internet access for this "
    "session is {internet}."
)


def code_from_arguments(arguments: str) -> str:
    """The model sends raw code; some clients wrap it as {"code": "..."}."""
    text = arguments.strip()
    if text.startswith("{") and text.endswith("}"):
        try:
            wrapped = json.loads(text)
        except json.JSONDecodeError:
            return arguments
        if isinstance(wrapped, dict) and set(wrapped) == {"code"} and isinstance(wrapped["code"], str):
            return wrapped["code"]
    return arguments


class PythonToolSession:
    def __init__(self, sandbox: PythonSandbox):
        self.sandbox = sandbox

    async def call(self, recipient: str, arguments: str) -> ToolResult:
        if recipient != "python" and not recipient.startswith("python."):
            return ToolResult(f"Unknown tool `{recipient}`.", is_error=True)
        code = code_from_arguments(arguments)
        details = {"code": code}
        try:
            result = await self.sandbox.execute(code)
        except SandboxError as e:
            return ToolResult(
                f"The Python tool is unavailable: {e}", is_error=True, details={**details, "status": "crashed"}
            )
        except Exception as e:  # noqa: BLE001 - a tool bug must not end the response
            logger.exception("python tool failed")
            return ToolResult(
                f"The Python tool failed: {type(e).__name__}: {e}",
                is_error=True,
                details={**details, "status": "crashed"},
            )
        exit_code = result.exit_code if result.exit_code is not None else int(result.status != "ok")
        details.update(stdout=result.stdout, stderr=result.stderr, status=result.status, exit=exit_code)
        return ToolResult(result.tool_text(), is_error=result.status in ("timeout", "crashed"), details=details)

    def resolve_citations(self, text: str) -> tuple[str, list[dict]]:
        return text, []

    async def close(self) -> None:
        await self.sandbox.close()


class PythonToolServer:
    name = "python"
    kind = "python"

    def __init__(
        self, limits: SandboxLimits | None = None, *, report: IsolationReport | None = None, **sandbox_options
    ):
        self.limits = limits or SandboxLimits()
        self.sandbox_options = sandbox_options
        self.report = report or IsolationReport()
        self._sessions: weakref.WeakSet[PythonToolSession] = weakref.WeakSet()

    @classmethod
    async def start(cls, limits: SandboxLimits | None = None, **sandbox_options) -> PythonToolServer:
        """Delete what a server that crashed left behind, check that sandboxes start here, and
        warn once about protections this OS lacks."""
        stale = await clean_stale_sessions(sandbox_options.get("scratch_root"))
        if stale:
            logger.info("python tool: removed the sessions of %d server(s) gone: %s", len(stale), ", ".join(stale))
        report = await probe_isolation(limits, **sandbox_options)
        if not report.namespaces:  # don't try (and fail) again for every session
            sandbox_options["use_namespaces"] = False
        gaps = report.gaps()
        if gaps:
            logger.warning("python tool: weaker sandbox on this machine: %s", "; ".join(gaps))
        else:
            logger.info(
                "python tool: sandbox with namespaces, Landlock ABI %d, seccomp socket filter, running as %s",
                report.landlock_abi,
                report.user,
            )
        return cls(limits, report=report, **sandbox_options)

    def harmony_namespace(self) -> ToolNamespaceConfig:
        if self.report.workdir == DATA_MOUNT_HINT:
            drive = "The drive at '/mnt/data' can be used to save and persist user files."
        else:
            drive = "The current working directory can be used to save and persist user files."
        internet = "disabled" if self.report.network_blocked else "UNKNOWN. Depends on the cluster"
        description = DESCRIPTION.format(timeout=self.limits.wall_seconds, drive=drive, internet=internet)
        return ToolNamespaceConfig(name=self.name, description=description, tools=[])

    def open_session(self) -> PythonToolSession:
        session = PythonToolSession(PythonSandbox(self.limits, **self.sandbox_options))
        self._sessions.add(session)
        return session

    async def aclose(self) -> None:
        for session in list(self._sessions):
            await session.close()
