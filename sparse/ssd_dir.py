"""The SSD tier's directory: one live store per rank on it, and temporary ones that do not
outlive their process.

With `SparseConfig.ssd_dir` set, a store holds an exclusive `fcntl.flock` on
`<ssd_dir>/.genrec_ssd.rank<r>.lock` while it lives (the kernel drops it when the process
dies, kill -9 included), so a second live store of the same rank fails at once instead
of truncating the first one's slabs. Ranks of one job may share the directory: each has
its own lock and table folders.

Without it, a store makes `<tmp>/genrec_ssd_<pid>_<random>`, locked the same way, whose
slab files are unlinked as soon as they are mapped (their disk is freed with the process).
A killed process still leaves that folder (the lock file, empty table folders): the next
store to start removes every such folder whose pid is dead and whose lock is free.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile

_TEMP_PREFIX = "genrec_ssd_"
_TEMP_NAME = re.compile(_TEMP_PREFIX + r"(\d+)_.+")


def check_writable(path: str) -> None:
    if not os.path.isdir(path):
        raise ValueError(f"SparseConfig.ssd_dir {path!r} does not exist or is not a directory")
    probe = os.path.join(path, f".write_probe.{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"SparseConfig.ssd_dir {path!r} is not writable: {e}") from None


def _try_lock(lock_path: str) -> int | None:
    """fd holding an exclusive lock on lock_path (created if needed), or None if held."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def lock(path: str, rank: int) -> int:
    """Take rank `rank`'s lock on an SSD directory for this store's lifetime; returns its fd."""
    lock_path = os.path.join(path, f".genrec_ssd.rank{rank}.lock")
    fd = _try_lock(lock_path)
    if fd is None:
        raise ValueError(f"SparseConfig.ssd_dir {path!r} is in use by another live store of rank {rank} "
                         f"({lock_path} is locked): give each run its own directory")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())  # for whoever wonders who holds it
    return fd


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _abandoned(path: str) -> bool:
    """No live store uses this temporary folder: it has locks and each can be taken. (A
    folder without any is left alone: it may be another version's, or one an instant old.)"""
    try:
        names = [n for n in os.listdir(path) if n.endswith(".lock")]
    except OSError:
        return False
    if not names:
        return False
    for name in names:
        fd = _try_lock(os.path.join(path, name))
        if fd is None:
            return False
        os.close(fd)
    return True


def remove_dead_temp_dirs() -> None:
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        m = _TEMP_NAME.fullmatch(name)
        # The lock test too: a dead pid may be a live process of another pid namespace.
        if m and not _pid_alive(int(m.group(1))) and _abandoned(os.path.join(root, name)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def make_temp_dir(rank: int) -> tuple[str, int]:
    """A fresh, locked temporary SSD directory: (path, lock fd)."""
    remove_dead_temp_dirs()
    path = tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{os.getpid()}_")
    return path, lock(path, rank)


def release(lock_fd: int, temp_dir: str | None) -> None:
    """Drop a store's lock; delete its directory if it was a temporary one."""
    os.close(lock_fd)
    if temp_dir is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)
