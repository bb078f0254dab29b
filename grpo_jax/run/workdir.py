"""A run's directory: one run at a time, and fresh starts that never mix logs.

``WorkdirLock`` holds an exclusive ``flock`` on ``<workdir>/.lock`` and one on the workdir
itself for the life of a run (process 0 only), so a second run fails at once naming the
holder; ``set_aside`` moves an earlier attempt's logs to ``<name>.old-<k>`` when a run starts
fresh. docs/architecture.md, "Checkpoints" (what protects a run's directory).
"""

from __future__ import annotations

import errno
import fcntl
import os
import pathlib
import time

from grpo_jax.core.errors import WorkdirBusyError, WorkdirWriteError


class WorkdirLock:
    """Exclusive locks on ``<workdir>/.lock`` and on the workdir; released by
    :meth:`release` or at exit."""

    def __init__(self, workdir: str | os.PathLike):
        self.path = pathlib.Path(workdir) / ".lock"
        self._fd = self._dir_fd = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise WorkdirWriteError(
                f"workdir {self.path.parent} cannot be written ({e.strerror}: {e.filename}); "
                "choose another --workdir, or make this one writable"
            ) from None
        try:
            self._dir_fd = _lock_directory(self.path.parent)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip()
            os.close(fd)
            self.release()
            raise WorkdirBusyError(
                f"workdir {self.path.parent} is in use by another run "
                f"({holder or 'its .lock file was deleted, so it is not named'}); wait for it "
                "to finish or stop it, or choose another --workdir"
            ) from None
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}, since {started}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        for name in ("_fd", "_dir_fd"):
            fd = getattr(self, name)
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                setattr(self, name, None)


def _lock_directory(directory: pathlib.Path) -> int | None:
    """An exclusive ``flock`` on the directory itself (its fd), or None where the file system
    cannot lock a directory; BlockingIOError when another process holds it."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError as e:  # NFS emulates flock with byte-range locks: not on a directory
        os.close(fd)
        if e.errno in (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise
    return fd


def set_aside(path: str | os.PathLike) -> pathlib.Path | None:
    """Renames an existing, non-empty ``path`` (file or folder) to ``<path>.old-<k>``.

    Returns the new path, or None when there was nothing to keep.
    """
    p = pathlib.Path(path)
    if not p.exists() or (p.is_file() and p.stat().st_size == 0):
        return None
    if p.is_dir() and not any(p.iterdir()):
        return None
    k = 1
    while p.with_name(f"{p.name}.old-{k}").exists():
        k += 1
    target = p.with_name(f"{p.name}.old-{k}")
    os.replace(p, target)
    return target
