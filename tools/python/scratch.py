"""Where the Python tool's sessions keep their files, and how much they keep.

Layout: `<root>/oss-agent-python-<uid>/server-<pid>-<token>/session-<token>/`, with `<root>` the
system's temporary directory unless given. The two upper folders are 0711 (others may pass
through to their own session folder, not list them); a session folder belongs to the session's
uid, 0700.

A server holds an exclusive lock (flock) on `.lock` in its folder for as long as it runs, so a
server folder whose lock is free was left by a server that is gone (a crash, a kill -9) and the
next server to start deletes it with everything in it (`clean_stale`).

`usage` measures a session folder against its quota; the sandbox checks it while the session
runs (there is no per-folder quota in the kernel to rely on).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import secrets
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass

LOCK_NAME = ".lock"
SERVER_PREFIX = "server-"
NEW_PREFIX = ".new-"  # a server folder before its lock is taken


class ScratchError(RuntimeError):
    pass


@dataclass
class Usage:
    bytes: int  # disk blocks in use, in bytes
    entries: int  # files, folders and links


class ScratchArea:
    """The session folders of this server process under one root."""

    def __init__(self, root: str | None = None):
        self.root = os.path.realpath(root or tempfile.gettempdir())
        self.area = os.path.join(self.root, f"oss-agent-python-{os.getuid()}")
        self._server_dir: str | None = None
        self._lock_fd: int | None = None
        self._mutex = threading.Lock()

    @property
    def server_tag(self) -> str:
        return os.path.basename(self.server_dir())

    def server_dir(self) -> str:
        """This server's folder, created and locked on first use."""
        with self._mutex:
            if self._server_dir is None:
                self._ensure_area()
                fresh = tempfile.mkdtemp(prefix=NEW_PREFIX, dir=self.area)
                os.chmod(fresh, 0o711)
                fd = os.open(os.path.join(fresh, LOCK_NAME), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # Renamed only once locked: `clean_stale` never sees it unlocked.
                final = os.path.join(self.area, f"{SERVER_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
                os.rename(fresh, final)
                self._server_dir, self._lock_fd = final, fd
                atexit.register(self.close)
            return self._server_dir

    def close(self) -> None:
        """At exit: delete this server's folder if no session folder is left in it (a left one
        goes when the next server starts)."""
        with self._mutex:
            if self._server_dir is None:
                return
            try:
                if os.listdir(self._server_dir) == [LOCK_NAME]:
                    os.unlink(os.path.join(self._server_dir, LOCK_NAME))
                    os.rmdir(self._server_dir)
            except OSError:
                pass
            os.close(self._lock_fd)
            self._server_dir = self._lock_fd = None

    def new_session_dir(self) -> str:
        return tempfile.mkdtemp(prefix="session-", dir=self.server_dir())

    def _ensure_area(self) -> None:
        try:
            os.mkdir(self.area, 0o711)
        except FileExistsError:
            pass
        info = os.lstat(self.area)
        # Someone else's folder (or a link) in a shared /tmp would let them reach ours.
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise ScratchError(
                f"{self.area} is not a folder of this user; remove it or give the Python tool another scratch root"
            )
        os.chmod(self.area, 0o711)

    def stale_server_tags(self) -> list[str]:
        """Server folders whose server is gone (their lock is free)."""
        try:
            names = os.listdir(self.area)
        except FileNotFoundError:
            return []
        stale = []
        for name in names:
            if not name.startswith(SERVER_PREFIX) or name == os.path.basename(self._server_dir or ""):
                continue
            try:
                fd = os.open(os.path.join(self.area, name, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                stale.append(name)  # (a folder that lost its lock file is nobody's)
                continue
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its server is alive
            finally:
                os.close(fd)
            stale.append(name)
        return stale

    def clean_stale(self) -> list[str]:
        """Delete the folders of servers that are gone; returns the tags deleted."""
        removed = []
        for tag in self.stale_server_tags():
            shutil.rmtree(os.path.join(self.area, tag), ignore_errors=True)
            removed.append(tag)
        return removed


_areas: dict[str, ScratchArea] = {}
_areas_lock = threading.Lock()


def scratch_area(root: str | None = None) -> ScratchArea:
    """The process's one `ScratchArea` for `root` (the temporary directory by default)."""
    key = os.path.realpath(root or tempfile.gettempdir())
    with _areas_lock:
        if key not in _areas:
            _areas[key] = ScratchArea(key)
        return _areas[key]


def usage(path: str, max_bytes: int, max_entries: int) -> Usage:
    """Disk use of the tree at `path`, counting until one limit is passed (the walk stays short
    however many files a cell made). Symlinks are not followed, and a folder swapped for a link
    mid-walk is not entered (os.fwalk works on folder descriptors)."""
    total = Usage(0, 0)
    try:
        walk = os.fwalk(path, follow_symlinks=False)
        for _, dirs, files, dir_fd in walk:
            for name in dirs + files:
                try:
                    info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except OSError:
                    continue
                total.bytes += info.st_blocks * 512
                total.entries += 1
            if total.bytes > max_bytes or total.entries > max_entries:
                walk.close()
                break
    except OSError:
        pass
    return total


def empty_folder(path: str) -> None:
    """Delete everything inside `path`, keeping the folder."""
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            try:
                os.unlink(entry.path)
            except OSError:
                pass
