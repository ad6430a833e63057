"""The memory of a Python session's processes, for hosts where no cgroup caps it.

A session's processes are its worker and every descendant: the worker's keeper is a
subreaper (or a PID namespace's init), so processes that detach from their parents are
reparented to it and stay in the tree. Each counts with its proportional set size (shared
pages split between the processes sharing them), so forked children are not counted twice for
the memory they share with their parent.
"""

from __future__ import annotations

import os


def descendants(root_pid: int) -> list[int]:
    """`root_pid` and every process below it, from one pass over /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, queue = [], [root_pid]
    while queue:
        pid = queue.pop()
        found.append(pid)
        queue.extend(children.get(pid, ()))
    return found


def process_memory(pid: int) -> int:
    """Proportional set size in bytes (resident size where smaps_rollup is missing)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def tree_memory(root_pid: int) -> int:
    return sum(process_memory(pid) for pid in descendants(root_pid))
