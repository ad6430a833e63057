"""The process side of the Python tool's sandbox: confines itself, then runs cells like a notebook.

Started by `tools.python.sandbox` as `python -I -u <this file> <config json>` with a scrubbed
environment, in its own session: stdin carries requests, stdout/stderr are plain pipes that
take the cells' output, and one more pipe (`control_fd`) carries the sandbox's own messages. It
imports only the standard library (`-I` keeps the package, the working directory and PYTHON*
variables out of `sys.path`).

Confinement, each step best effort and reported back, strongest first:
  0. cgroup: when the server made one for the session, this process joins it before anything
     else, so every process the session ever starts is in it (one memory cap for them all,
     and the server can kill them all).
  1. Namespaces. As root: new mount, network, PID, IPC and UTS namespaces. Otherwise the same
     inside a new user namespace, if the kernel lets unprivileged users create one. The network
     namespace has no interfaces up, so nothing (not even the host's loopback) is reachable.
     In a PID namespace this process forks the namespace's init, whose death (it has
     PR_SET_PDEATHSIG on us) kills every process the model started.
  2. Mounts (with a mount namespace): a fresh /proc showing only the sandbox's processes, a
     tmpfs over /mnt with the scratch directory bound at /mnt/data (the path gpt-oss's Python
     tool description promises), and, when dropping root, a tmpfs over any directory the
     unprivileged uid could not traverse on the way to the Python installation (so e.g. a
     pyenv under /root works while the rest of /root stays hidden).
  3. Privileges. Root switches to a throwaway uid chosen by the parent (in every mode: model
     code never runs as root; where the Python installation is out of that uid's reach and
     there is no mount namespace to fix that, the sandbox refuses to start); a user-namespace
     process drops its capabilities.
  4. Landlock (Linux >= 5.13): reads only from system directories, the Python installation,
     the scratch directory and (if private) /proc; writes only inside the scratch directory;
     no TCP bind/connect (ABI >= 4); no signals to or abstract sockets of outside processes
     (ABI >= 6). PR_SET_NO_NEW_PRIVS first, so setuid binaries cannot undo any of it.
  5. rlimits: CPU seconds, address space, processes, file size, open files, no core dumps.
  6. seccomp: no socket() at all, so no connection to anything, the host's UNIX sockets
     (pathname or abstract) included; socketpair() only for AF_UNIX stream or seqpacket pairs
     (already connected: asyncio and multiprocessing pipes work, and a pair cannot be pointed
     elsewhere, as a datagram one could with sendto); io_uring (which can create sockets
     without socket()) is refused, and so is any syscall of another ABI (x32, i386 compat)
     whose numbers the filter does not check. Applied in both modes.

Processes. After confining itself, the process (the namespace's init, or itself without
namespaces, then a child subreaper) becomes the session's keeper and forks the notebook. The
keeper alone holds the control pipe: the notebook closes it before any cell runs, and the
keeper is not dumpable, so no cell can read or write the sandbox's messages (it can write
only to its own output pipes, which the server reads as plain, bounded text). The keeper reaps
orphans, passes interrupts on to the notebook, and when the notebook ends, kills what is left
of the session (a PID namespace dies with its init; without one, every process of the session's
uid or Landlock domain) before it exits.

Wire protocol. Requests arrive on the original stdin: a 4-byte big-endian length, then a JSON
object {"code": str}. After a cell the notebook tells the keeper its status (a line on a pipe
between them), and the keeper sends a JSON line on the control pipe: {"event": "ready",
"report": {...}} once confined, {"event": "done", "status": "ok"|"error"|"interrupted"} after
each cell, {"event": "exit", "code": n} when the notebook ended.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import ctypes
import errno
import fcntl
import inspect
import json
import linecache
import os
import resource
import select
import signal
import stat
import sys
import traceback
from dataclasses import dataclass

# Linux constants (stable ABI, same on x86_64 and arm64).
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
PR_SET_CHILD_SUBREAPER = 36
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_TRUNCATE = 1 << 14
FS_REFER = 1 << 13
FS_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
AF_UNIX = 1
SOCK_STREAM, SOCK_SEQPACKET, SOCK_TYPE_MASK = 1, 5, 0xF
CELL_STATUSES = (b"ok", b"error", b"interrupted")
MAX_REQUEST_BYTES = 64 << 20
ROOT_REFUSAL = (
    "refusing to run model code as root: this machine gives the sandbox no Linux "
    "namespaces, and without a mount namespace another uid cannot reach the Python "
    "installation ({paths}). Run the server as a non-root user, allow namespaces "
    "(e.g. a container with CAP_SYS_ADMIN or user namespaces), or install Python where "
    "every user can read it"
)

SYSTEM_READ_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys/devices/system/cpu")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
DATA_MOUNT = "/mnt/data"

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class SetupError(RuntimeError):
    pass


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")
    return result


def _prctl(option: int, arg2: int = 0, arg3: int = 0) -> None:
    _check(
        libc.prctl(option, ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), ctypes.c_ulong(0), ctypes.c_ulong(0)),
        f"prctl({option})",
    )


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None):
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _write_file(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _high_fd(fd: int) -> int:
    """A close-on-exec copy of fd numbered >= 100, out of the way of the code under test."""
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100)


# ---------------------------------------------------------------- 1. namespaces


def enter_namespaces(report: dict) -> bool:
    """Unshare what the kernel allows. True when in new PID/mount/network namespaces."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if uid != 0:
        flags |= CLONE_NEWUSER
    if libc.unshare(flags) != 0:
        report["notes"].append(f"namespaces unavailable: {os.strerror(ctypes.get_errno())}")
        return False
    if uid != 0:
        # Map only ourselves; stay unprivileged inside (uid != 0 keeps exec from granting caps).
        _write_file("/proc/self/setgroups", "deny")
        _write_file("/proc/self/uid_map", f"{uid} {uid} 1")
        _write_file("/proc/self/gid_map", f"{gid} {gid} 1")
        report["user_namespace"] = True
    report["namespaces"] = True
    return True


def run_as_launcher(child: int) -> None:
    """The original process after the fork into the PID namespace: pass interrupts on to the
    namespace's init, wait for it, pass on its exit status. (Its death kills the init, by
    PR_SET_PDEATHSIG, and so the namespace.)"""
    signal.signal(signal.SIGINT, lambda signum, frame: os.kill(child, signal.SIGINT))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


# ---------------------------------------------------------------- 2. mounts


def _other_can_search(path: str) -> bool:
    return bool(os.stat(path).st_mode & stat.S_IXOTH)


def _other_can_list(path: str) -> bool:
    mode = os.stat(path).st_mode
    return mode & (stat.S_IROTH | stat.S_IXOTH) == stat.S_IROTH | stat.S_IXOTH


def _blocked_ancestor(path: str) -> str | None:
    """The top-most directory on the way to `path` that a uid with no groups cannot search."""
    current = ""
    for part in path.strip("/").split("/"):
        current += "/" + part
        if not _other_can_search(current):
            return current
    return None


def expose_paths(paths: list[str]) -> None:
    """Make `paths` reachable for an unprivileged uid: tmpfs over each blocked ancestor, with
    just the needed directories bound back in."""
    by_ancestor: dict[str, list[str]] = {}
    for path in paths:
        ancestor = _blocked_ancestor(path)
        if ancestor is not None and ancestor != path:
            by_ancestor.setdefault(ancestor, []).append(path)
    for ancestor, inside in by_ancestor.items():
        # O_PATH handles first: once the tmpfs is over `ancestor`, the originals are out of reach.
        handles = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p in inside]
        _mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
        for path, fd in handles:
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            os.close(fd)


def _reachable(path: str) -> bool:
    return _blocked_ancestor(path) is None and _other_can_list(path)


def set_up_mounts(config: dict, report: dict, dropping_root: bool) -> str:
    """Private mounts for the sandbox. Returns the working directory to use."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        report["private_proc"] = True
    except SetupError as e:
        report["notes"].append(f"no private /proc: {e}")
    if dropping_root:
        expose_paths(config["python_paths"] + [config["scratch"]])
        unreachable = [p for p in config["python_paths"] if not _reachable(p)]
        if unreachable:
            report["notes"].append(f"not reachable by an unprivileged uid: {unreachable}")
    workdir = config["scratch"]
    try:
        if os.path.isdir("/mnt"):
            scratch_fd = os.open(config["scratch"], os.O_PATH | os.O_CLOEXEC)
            _mount("tmpfs", "/mnt", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
            os.mkdir(DATA_MOUNT, 0o755)
            _mount(f"/proc/self/fd/{scratch_fd}", DATA_MOUNT, None, MS_BIND)
            os.close(scratch_fd)
            workdir = DATA_MOUNT
    except (SetupError, OSError) as e:
        report["notes"].append(f"scratch directory not mounted at {DATA_MOUNT}: {e}")
    return workdir


# ---------------------------------------------------------------- 3. privileges


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> None:
    """Empty the bounding, ambient, permitted and effective sets."""
    try:
        last_cap = int(open("/proc/sys/kernel/cap_last_cap").read())
    except OSError:
        last_cap = 63
    for cap in range(last_cap + 1):
        if libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) != 0:
            if ctypes.get_errno() != errno.EINVAL:
                raise SetupError(f"dropping capability {cap}: {os.strerror(ctypes.get_errno())}")
    libc.prctl(PR_CAP_AMBIENT, ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), 0, 0, 0)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    _check(libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")


def switch_user(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


# ---------------------------------------------------------------- 4. Landlock


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    abi = libc.syscall(
        SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION)
    )
    return max(int(abi), 0)


def apply_landlock(abi: int, read_paths: list[str], write_paths: list[str]) -> None:
    """Allow reads (and exec) beneath read_paths, everything beneath write_paths, nothing else."""
    all_fs = (1 << 13) - 1  # ABI 1: execute .. make_sym
    if abi >= 2:
        all_fs |= FS_REFER
    if abi >= 3:
        all_fs |= FS_TRUNCATE
    attr = _RulesetAttr(all_fs, 0, 0)
    size = 8
    if abi >= 4:
        attr.handled_access_net = NET_BIND_TCP | NET_CONNECT_TCP  # and no rule allows any port
        size = 16
    if abi >= 6:
        attr.scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
        size = 24
    ruleset = _check(
        libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)),
        "landlock ruleset",
    )
    file_rights = FS_EXECUTE | FS_READ_FILE | FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0)

    def allow(path: str, access: int) -> None:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                access &= file_rights
            rule = _PathBeneathAttr(access, fd)
            _check(
                libc.syscall(
                    SYS_LANDLOCK_ADD_RULE,
                    ctypes.c_int(ruleset),
                    ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                    ctypes.byref(rule),
                    ctypes.c_uint32(0),
                ),
                f"landlock rule for {path}",
            )
        finally:
            os.close(fd)

    for path in read_paths:
        allow(path, FS_READ)
    for path in DEVICES:
        allow(path, FS_READ_FILE | FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0))
    for path in write_paths:
        allow(path, all_fs)
    _check(
        libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)), "landlock restrict_self"
    )
    os.close(ruleset)


# ---------------------------------------------------------------- 5. rlimits


def _tasks_of_uid(uid: int) -> int:
    """Threads currently running under `uid` (RLIMIT_NPROC counts all of them)."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    count += int(fields["Threads"])
            except (OSError, KeyError, ValueError):
                pass
    return count


def set_limits(limits: dict, shared_uid: bool) -> None:
    def cap(kind: int, value: int, hard_extra: int = 0) -> None:
        _, hard = resource.getrlimit(kind)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value + hard_extra))

    # A second of slack, so the soft limit's SIGXCPU (not the hard one's SIGKILL) ends it.
    cap(resource.RLIMIT_CPU, int(limits["cpu_seconds"]), hard_extra=1)
    cap(resource.RLIMIT_AS, int(limits["memory_bytes"]))
    cap(resource.RLIMIT_FSIZE, int(limits["max_file_bytes"]))
    cap(resource.RLIMIT_NOFILE, int(limits["max_open_files"]))
    cap(resource.RLIMIT_CORE, 0)
    processes = int(limits["max_processes"])
    if shared_uid:  # the count includes every process of the server's user
        processes += _tasks_of_uid(os.getuid())
    cap(resource.RLIMIT_NPROC, processes)


# ---------------------------------------------------------------- 6. seccomp


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


@dataclass(frozen=True)
class _SyscallTable:
    audit_arch: int  # AUDIT_ARCH_* as seccomp_data.arch reports it
    socket: int
    socketpair: int
    io_uring_setup: int
    foreign_from: int | None  # numbers from here on belong to another ABI (x32)


SYSCALLS = {
    "x86_64": _SyscallTable(0xC000003E, 41, 53, 425, 0x40000000),
    "aarch64": _SyscallTable(0xC00000B7, 198, 199, 425, None),
}
# Classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K, BPF_AND_K = 0x20, 0x15, 0x35, 0x06, 0x54
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
# Offsets into struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6];}.
DATA_NR, DATA_ARCH = 0, 4
LOW_WORD = 0 if sys.byteorder == "little" else 4
DATA_ARG0_LOW, DATA_ARG1_LOW = 16 + LOW_WORD, 24 + LOW_WORD  # socketpair()'s domain and type


def socket_filter(table: _SyscallTable) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions: see step 6 of the module docstring."""
    # Each entry: (code, k, jump-if-true label, jump-if-false label); None falls through.
    program: list[tuple[int, int, str | None, str | None]] = [
        (BPF_LD_W_ABS, DATA_ARCH, None, None),
        (BPF_JEQ_K, table.audit_arch, None, "deny"),
        (BPF_LD_W_ABS, DATA_NR, None, None),
    ]
    if table.foreign_from is not None:
        program.append((BPF_JGE_K, table.foreign_from, "deny", None))
    program += [
        (BPF_JEQ_K, table.socket, "deny", None),
        (BPF_JEQ_K, table.socketpair, "check_pair", None),
        (BPF_JEQ_K, table.io_uring_setup, "deny", None),
        (BPF_RET_K, SECCOMP_RET_ALLOW, None, None),
    ]
    labels = {"check_pair": len(program)}
    program += [
        (BPF_LD_W_ABS, DATA_ARG0_LOW, None, None),
        (BPF_JEQ_K, AF_UNIX, None, "deny"),
        (BPF_LD_W_ABS, DATA_ARG1_LOW, None, None),
        (BPF_AND_K, SOCK_TYPE_MASK, None, None),  # (SOCK_NONBLOCK, SOCK_CLOEXEC are fine)
        (BPF_JEQ_K, SOCK_STREAM, "allow", None),
        (BPF_JEQ_K, SOCK_SEQPACKET, "allow", "deny"),
    ]
    labels["allow"] = len(program)
    program.append((BPF_RET_K, SECCOMP_RET_ALLOW, None, None))
    labels["deny"] = len(program)
    program.append((BPF_RET_K, SECCOMP_RET_ERRNO | errno.EPERM, None, None))

    def offset(at: int, label: str | None) -> int:
        return 0 if label is None else labels[label] - at - 1

    return [(code, offset(i, jt), offset(i, jf), k) for i, (code, k, jt, jf) in enumerate(program)]


def apply_socket_filter() -> None:
    """Install `socket_filter` for this process and its children (needs PR_SET_NO_NEW_PRIVS)."""
    table = SYSCALLS.get(os.uname().machine)
    if table is None:
        raise SetupError(f"no syscall table for {os.uname().machine}")
    instructions = socket_filter(table)
    filters = (_SockFilter * len(instructions))(*[_SockFilter(*i) for i in instructions])
    program = _SockFprog(len(instructions), filters)
    _check(
        libc.prctl(
            PR_SET_SECCOMP,
            ctypes.c_ulong(SECCOMP_MODE_FILTER),
            ctypes.byref(program),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        ),
        "seccomp filter",
    )


# ---------------------------------------------------------------- confinement


def confine(config: dict, report: dict, in_namespaces: bool) -> str:
    """Steps 2-5 for this process (and so its children). Returns the working directory."""
    root = os.getuid() == 0
    sandbox_uid = int(config["sandbox_uid"])
    python_paths = config["python_paths"]
    workdir = config["scratch"]
    if in_namespaces:
        workdir = set_up_mounts(config, report, dropping_root=root)
    if root:
        unreachable = [p for p in python_paths if not _reachable(p)]
        if _blocked_ancestor(os.path.dirname(config["scratch"])) is not None:
            unreachable.append(os.path.dirname(config["scratch"]))
        if unreachable:
            raise SetupError(ROOT_REFUSAL.format(paths=", ".join(unreachable)))
        os.chown(config["scratch"], sandbox_uid, sandbox_uid)
        switch_user(sandbox_uid)
        report["user"] = f"uid {sandbox_uid}"
    else:
        if in_namespaces:
            drop_capabilities()
        report["user"] = "the server's user"
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid switch, which clears it

    set_limits(config["limits"], shared_uid=not in_namespaces and not root)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if config.get("use_seccomp", True):
        try:
            apply_socket_filter()
            report["seccomp"] = True
        except SetupError as e:
            report["notes"].append(f"no seccomp socket filter: {e}")
    abi = landlock_abi() if config["use_landlock"] else 0
    if abi:
        read_paths = list(SYSTEM_READ_DIRS) + python_paths
        if report["private_proc"]:
            read_paths.append("/proc")
        try:
            apply_landlock(abi, read_paths, [config["scratch"]])
            report["landlock_abi"] = abi
        except SetupError as e:
            report["notes"].append(f"Landlock failed: {e}")
    os.chdir(workdir)
    os.environ.update(HOME=workdir, TMPDIR=workdir)
    report["workdir"] = workdir
    return workdir


# ---------------------------------------------------------------- the notebook


class Notebook:
    """Runs cells in one persistent namespace, like a Jupyter kernel: the value of a final
    expression is shown, tracebacks point into the cell, top-level `await` works."""

    def __init__(self, status_fd: int):
        self.namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
        self.status_fd = status_fd  # to the keeper
        self.cell_count = 0
        self.in_cell = False
        self.pid = os.getpid()

    def on_sigint(self, signum, frame) -> None:
        # The parent interrupts a cell that ran past its time. Outside a cell, ignore it.
        if self.in_cell:
            raise KeyboardInterrupt

    def _run(self, code_object):
        result = eval(code_object, self.namespace)
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
        return result

    def run_cell(self, code: str) -> str:
        self.cell_count += 1
        filename = f"<cell {self.cell_count}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        try:
            self.in_cell = True
            tree = ast.parse(code, filename, "exec")
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            self._run(compile(tree, filename, "exec", flags=flags))
            if last is not None:
                expression = ast.Expression(last.value)
                value = self._run(compile(expression, filename, "eval", flags=flags))
                if value is not None:
                    self.namespace["_"] = value
                    print(repr(value))
            return "ok"
        except BaseException as exc:  # noqa: BLE001 - everything the cell raises is its output
            self.in_cell = False
            if os.getpid() != self.pid:
                os._exit(1)  # a process the cell forked ended in an error; only the notebook reports
            self._print_exception(exc)
            return "interrupted" if isinstance(exc, KeyboardInterrupt) else "error"
        finally:
            self.in_cell = False

    def _print_exception(self, exc: BaseException) -> None:
        """Print like Python would, without the notebook's own frames."""
        report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        for part in [report, *self._chain(report)]:
            frames = [f for f in part.stack if f.filename != __file__]
            part.stack = traceback.StackSummary.from_list(frames)
        sys.stderr.write("".join(report.format()))

    @staticmethod
    def _chain(report: traceback.TracebackException):
        seen = report
        while seen is not None:
            seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
            if seen is not None:
                yield seen

    def serve(self, requests) -> None:
        signal.signal(signal.SIGINT, self.on_sigint)
        while True:
            header = _read_exact(requests, 4)
            if header is None:
                return
            length = int.from_bytes(header, "big")
            if length > MAX_REQUEST_BYTES:
                return  # not from our server: end the session
            body = _read_exact(requests, length)
            if body is None:
                return
            status = self.run_cell(json.loads(body)["code"])
            if os.getpid() != self.pid:
                os._exit(0)  # a child the cell forked fell through to here; it has no say
            self.finish(status)

    def finish(self, status: str) -> None:
        """Tell the keeper the cell ended, once all it printed is in the output pipes."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - the cell may have closed or replaced it
                pass
        libc.fflush(None)  # what C code printed through stdio
        try:  # (the first newline ends whatever the cell itself wrote to this pipe)
            _write_all(self.status_fd, b"\n" + status.encode() + b"\n")
        except OSError:
            os._exit(71)  # the cell closed the pipe to the keeper: this session cannot go on


def _read_exact(stream, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


# ---------------------------------------------------------------- the keeper


class Keeper:
    """The session's first process once confined: forks the notebook, relays its cell
    statuses as control messages, reaps orphans, passes interrupts on, and when the notebook
    ends kills what is left of the session."""

    def __init__(self, control_fd: int, report: dict, in_namespaces: bool):
        self.control_fd = control_fd
        self.report = report
        self.in_namespaces = in_namespaces
        self.notebook = 0

    def send(self, message: dict) -> None:
        try:
            _write_all(self.control_fd, json.dumps(message).encode() + b"\n")
        except OSError:
            pass  # the server is gone; PR_SET_PDEATHSIG ends us

    def run(self, requests, workdir: str):
        status_r, status_w = os.pipe()  # (close-on-exec: a program the cell runs gets neither)
        if not self.in_namespaces:
            _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the session stay ours to reap and kill
        keeper = os.getpid()
        self.notebook = os.fork()
        if self.notebook == 0:
            os.close(self.control_fd)
            os.close(status_r)
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != keeper:
                os._exit(70)
            run_notebook(requests, status_w, workdir)
            os._exit(0)
        os.close(status_w)
        requests.close()
        # Not dumpable: a cell (same uid, same Landlock domain) can neither ptrace us nor open
        # our file descriptors through /proc, so the control pipe stays out of its reach.
        _prctl(PR_SET_DUMPABLE, 0)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.signal(signal.SIGINT, lambda signum, frame: os.kill(self.notebook, signal.SIGINT))
        self.send({"event": "ready", "report": self.report})
        self.serve(status_r, wake_r)

    def serve(self, status_r: int, wake_r: int):
        pending = b""
        watched = [status_r, wake_r]
        while True:
            for fd in select.select(watched, [], [], 1.0)[0]:
                data = os.read(fd, 256)
                if fd == status_r:
                    if not data:
                        watched.remove(status_r)
                    pending = self.relay(pending + data)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    pid = 0
                if pid == 0:
                    break
                if pid == self.notebook:
                    self.end(os.waitstatus_to_exitcode(status))

    def relay(self, pending: bytes) -> bytes:
        """Pass on each complete status line; anything else a cell wrote to the pipe is dropped
        (a cell can end its own call early this way, and do nothing more)."""
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line in CELL_STATUSES:
                self.send({"event": "done", "status": line.decode()})
        return pending[-64:]

    def end(self, code: int):
        self.send({"event": "exit", "code": code})
        if not self.in_namespaces:  # (a PID namespace ends with its init: nothing to do)
            self.kill_session()
        os._exit(128 - code if code < 0 else min(code, 255))

    def kill_session(self) -> None:
        """SIGKILL every process of the session but this one, detached ones included, where
        "every process we may signal" is exactly that: our own uid when it is the session's,
        or a Landlock domain that scopes signals. Else the process group, and the server's
        cgroup, if any, does the rest."""
        if self.report["user"].startswith("uid ") or self.report["landlock_abi"] >= 6:
            # One pass reaches every process there is; a few more, any forked meanwhile. (It
            # keeps reporting success while processes it may not signal exist.)
            for _ in range(10):
                try:
                    os.kill(-1, signal.SIGKILL)
                except OSError:
                    break  # none left
        else:
            os.killpg(0, signal.SIGKILL)  # (this process too, its message sent)


def run_notebook(requests, status_fd: int, workdir: str) -> None:
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)
    sys.path.insert(0, workdir)  # modules the model writes to its directory can be imported
    Notebook(status_fd).serve(requests)


def main() -> None:
    config = json.loads(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the notebook process takes interrupts
    if config.get("cgroup_procs"):
        _write_file(config["cgroup_procs"], "0")  # before any fork: the session's every process
    requests = os.fdopen(_high_fd(0), "rb", buffering=0)
    control_fd = _high_fd(int(config["control_fd"]))
    os.close(int(config["control_fd"]))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    report = {
        "namespaces": False,
        "user_namespace": False,
        "private_proc": False,
        "landlock_abi": 0,
        "seccomp": False,
        "user": "",
        "workdir": "",
        "notes": [],
    }
    in_namespaces = bool(config["use_namespaces"]) and enter_namespaces(report)
    if in_namespaces:
        child = os.fork()
        if child:
            run_as_launcher(child)
    workdir = confine(config, report, in_namespaces)
    Keeper(control_fd, report, in_namespaces).run(requests, workdir)


if __name__ == "__main__":
    try:
        main()
    except (SetupError, OSError) as e:  # the parent reports it, then tries fewer protections
        sys.stderr.write(f"sandbox worker failed: {e}\n")
        sys.exit(70)
