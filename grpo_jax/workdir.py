"""A run's directory: one run at a time, and fresh starts that never mix logs.

``WorkdirLock`` holds an exclusive ``flock`` on ``<workdir>/.lock`` for the
life of a run (process 0 only: the other hosts of a multi-host run share its
workdir). A second run on the same workdir fails at once naming the process
that holds it; the kernel drops the lock when its process dies, so a killed
run never leaves it stuck.

``set_aside`` moves an earlier attempt's log (metrics.jsonl, TensorBoard
events, the warm start's metrics.jsonl) to ``<name>.old-<k>`` when a run
starts fresh in a workdir that holds one, so the new records never mix with
records of a run that no checkpoint continues.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import time

from grpo_jax.errors import WorkdirBusyError


class WorkdirLock:
    """An exclusive lock on ``<workdir>/.lock``; released by :meth:`release` or at exit."""

    def __init__(self, workdir: str | os.PathLike):
        self.path = pathlib.Path(workdir) / ".lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise WorkdirBusyError(
                f"workdir {self.path.parent} is in use by another run ({holder}); wait for it "
                "to finish or stop it, or choose another --workdir"
            ) from None
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}, since {started}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


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
