"""A control group per Python session: one memory cap over all its processes, and a way to
find and kill every one of them, however it detached itself.

Used where the kernel lets this server make groups: cgroup v2 where the memory controller is
enabled (or can be) below the server's own group; otherwise the v1 memory hierarchy (hybrid
hosts) where it is mounted and writable. Elsewhere `create` returns None and the sandbox
watches the session's memory itself.

Layout, below the server's group: `oss-agent-python-<server tag>/<session tag>`; the server
tag is its scratch folder's, so groups left by a server that is gone are found and removed
with its files (`remove_stale`).
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import signal
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

GROUP_PREFIX = "oss-agent-python-"


@dataclass(frozen=True)
class _Hierarchy:
    version: int  # 2 or 1
    path: str  # the server's own group, as a folder


def _mount_points() -> list[tuple[str, str, str, set[str]]]:
    """(root inside the hierarchy, mount point, fs type, super options) of each cgroup mount."""
    mounts = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                dash = fields.index("-")
                fstype = fields[dash + 1]
                if fstype in ("cgroup", "cgroup2"):
                    options = set(fields[dash + 3].split(",")) if len(fields) > dash + 3 else set()
                    mounts.append((fields[3], fields[4], fstype, options))
    except (OSError, ValueError):
        pass
    return mounts


def _own_group_path(mount_root: str, group: str, mount_point: str) -> str:
    if mount_root != "/" and (group == mount_root or group.startswith(mount_root + "/")):
        group = group[len(mount_root) :]  # (a container sees its own group as the root)
    return os.path.join(mount_point, group.lstrip("/"))


def _hierarchies() -> list[_Hierarchy]:
    """Usable hierarchies, best first: v2 with memory, then v1 memory."""
    try:
        with open("/proc/self/cgroup") as f:
            own = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return []
    found = []
    mounts = _mount_points()
    for hid, controllers, group in own:
        if hid == "0" and controllers == "":
            for root, point, fstype, _ in mounts:
                if fstype == "cgroup2":
                    path = _own_group_path(root, group, point)
                    if os.path.exists(os.path.join(path, "cgroup.controllers")):
                        found.append(_Hierarchy(2, path))
                        break
    for hid, controllers, group in own:
        if "memory" in controllers.split(","):
            for root, point, fstype, options in mounts:
                if fstype == "cgroup" and "memory" in options:
                    found.append(_Hierarchy(1, _own_group_path(root, group, point)))
                    break
    return found


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _enable_v2_controllers(group: str) -> bool:
    """Memory (and pids) for the children of `group`; False if memory cannot be had."""
    try:
        available = _read(os.path.join(group, "cgroup.controllers")).split()
        if "memory" not in available:
            return False
        enabled = _read(os.path.join(group, "cgroup.subtree_control")).split()
        wanted = [c for c in ("memory", "pids") if c in available and c not in enabled]
        if wanted:
            _write(os.path.join(group, "cgroup.subtree_control"), " ".join(f"+{c}" for c in wanted))
        return "memory" in _read(os.path.join(group, "cgroup.subtree_control")).split()
    except OSError:
        return False


@dataclass
class SessionCgroup:
    path: str
    version: int

    @property
    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    def pids(self) -> list[int]:
        try:
            return [int(line) for line in _read(self.procs_file).split()]
        except (OSError, ValueError):
            return []

    def kill(self) -> None:
        """SIGKILL every process in the group (one pass; `remove` waits for them)."""
        if self.version == 2 and os.path.exists(os.path.join(self.path, "cgroup.kill")):
            try:
                _write(os.path.join(self.path, "cgroup.kill"), "1")
                return
            except OSError:
                pass
        for pid in self.pids():
            # A pidfd taken while the pid is still listed names that process, not a later one
            # that reused the number.
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if pid in self.pids():
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)

    def oom_kills(self) -> int:
        """How many processes the kernel killed for the group's memory cap."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in _read(os.path.join(self.path, name)).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, timeout: float = 5.0) -> bool:
        """Kill what is left and delete the group. False if it could not be deleted in time."""
        deadline = time.monotonic() + timeout
        while True:
            self.kill()
            try:
                os.rmdir(self.path)
                return True
            except FileNotFoundError:
                return True
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    logger.warning("could not remove cgroup %s: %s", self.path, e)
                    return False
            time.sleep(0.02)


def create(server_tag: str, session_tag: str, memory_bytes: int, max_processes: int) -> SessionCgroup | None:
    """A group capping memory (swap included) and, on v2, the number of processes; None where
    this server cannot make one."""
    for hierarchy in _hierarchies():
        server_group = os.path.join(hierarchy.path, GROUP_PREFIX + server_tag)
        path = os.path.join(server_group, session_tag)
        try:
            if not os.path.isdir(server_group):
                os.mkdir(server_group)
                atexit.register(_remove_empty, server_group)
            if hierarchy.version == 2 and not _enable_v2_controllers(server_group):
                try:
                    os.rmdir(server_group)
                except OSError:
                    pass
                continue
            os.mkdir(path)
        except OSError:
            continue
        group = SessionCgroup(path, hierarchy.version)
        try:
            if hierarchy.version == 2:
                _write(os.path.join(path, "memory.max"), str(memory_bytes))
                for name, value in (("memory.swap.max", "0"), ("pids.max", str(max_processes))):
                    if os.path.exists(os.path.join(path, name)):
                        _write(os.path.join(path, name), value)
            else:
                _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_bytes))
                memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):  # (swap accounting on: cap memory + swap alike)
                    _write(memsw, str(memory_bytes))
        except OSError as e:
            logger.warning("cgroup %s refused its limits (%s); not using it", path, e)
            group.remove()
            continue
        return group
    return None


def remove_stale(server_tags: list[str]) -> int:
    """Kill the processes of, and delete, the groups of servers that are gone."""
    removed = 0
    for hierarchy in _hierarchies():
        for tag in server_tags:
            server_group = os.path.join(hierarchy.path, GROUP_PREFIX + tag)
            if not os.path.isdir(server_group):
                continue
            for entry in os.scandir(server_group):
                if entry.is_dir(follow_symlinks=False):
                    removed += SessionCgroup(entry.path, hierarchy.version).remove()
            try:
                os.rmdir(server_group)
            except OSError:
                pass
    return removed


def _remove_empty(group: str) -> None:
    try:
        os.rmdir(group)  # (fails, harmlessly, while a session's group is left in it)
    except OSError:
        pass
