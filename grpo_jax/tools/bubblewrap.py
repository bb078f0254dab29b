"""The kernel sandbox: the bubblewrap (``bwrap``) command that runs the sandbox's interpreter.

    argv = command(host_dir, seccomp_fd)     # then the interpreter and its arguments
    problem()                                # None, or one line: why it cannot run here

The code sees a file system of its own: the Python installation and the directories of
the shared libraries the interpreter loads (read-only), a ``/dev`` of harmless nodes, the
``/proc`` of its own pid namespace, and its directory at :data:`WORKDIR`, the one place it
may write. See docs/multiturn.md ("The sandbox").
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile

import grpo_jax.tools.seccomp as seccomp

WORKDIR = "/sandbox"  # where the run's directory appears inside
INSTALL = "apt-get install bubblewrap (Debian, Ubuntu; dnf or apk install bubblewrap elsewhere)"
_WEAKER = (
    "or name the weaker sandbox of Python audit hooks explicitly: sandbox='hooks' "
    "(GRPO_JAX_SANDBOX=hooks; docs/multiturn.md)"
)


def _resolve(path: str, links: dict[str, str]) -> str:
    """The real path of ``path``; each symbolic link met on the way goes into ``links``
    (its path -> its target), so that the same path works inside."""
    done, todo, hops = "/", [p for p in path.split("/") if p], 0
    while todo:
        name = todo.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            done = os.path.dirname(done)
            continue
        here = os.path.join(done, name)
        if os.path.islink(here) and hops < 40:
            hops += 1
            target = os.readlink(here)
            links[here] = target
            todo = [p for p in target.split("/") if p] + todo
            if target.startswith("/"):
                done = "/"
            continue
        done = here
    return done


def _library_paths(exe: str) -> list[str]:
    """The shared libraries ``exe`` loads, as the dynamic loader names them (``ldd``)."""
    ldd = shutil.which("ldd")
    try:
        out = subprocess.run([ldd, exe], capture_output=True, text=True, timeout=30).stdout
    except (TypeError, OSError, subprocess.SubprocessError):
        out = ""
    found = []
    for line in out.splitlines():
        words = line.split("=>", 1)[-1].split()
        if words and words[0].startswith("/"):
            found.append(words[0])
    if not found:  # no ldd: the usual library directories
        found = [os.path.join(d, "-") for d in ("/lib", "/lib64", "/usr/lib", "/usr/lib64")]
    return found


@functools.lru_cache(maxsize=1)
def _installation() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(real paths bound read-only, symbolic links made inside): the interpreter, its
    standard library and site-packages, and its shared libraries' directories."""
    links: dict[str, str] = {}
    binds: set[str] = set()
    prefixes = {os.path.realpath(p) + "/" for p in (sys.prefix, sys.base_prefix)}
    prefixes |= {os.path.realpath(p) + "/" for p in (sys.exec_prefix, sys.base_exec_prefix)}
    for entry in sys.path:  # the standard library, lib-dynload, site-packages
        real = os.path.realpath(entry) if entry else ""
        if real and os.path.exists(real) and any((real + "/").startswith(p) for p in prefixes):
            binds.add(_resolve(entry, links))
    exe = _resolve(sys.executable, links)  # every link from the venv's python to the file
    binds.add(exe)
    if sys.prefix != sys.base_prefix:
        cfg = os.path.join(sys.prefix, "pyvenv.cfg")
        if os.path.exists(cfg):
            binds.add(_resolve(cfg, links))
    for lib in _library_paths(exe):
        binds.add(_resolve(os.path.dirname(lib), links))
        real = _resolve(lib, links)
        if os.path.exists(real):
            binds.add(os.path.dirname(real))
    if os.path.exists("/etc/ld.so.cache"):  # where the loader finds libraries, names only
        binds.add("/etc/ld.so.cache")
    kept: list[str] = []
    for path in sorted(p for p in binds if os.path.exists(p)):
        if not any(path.startswith(k + "/") for k in kept):
            kept.append(path)
    made = [
        (link, target)
        for link, target in sorted(links.items())
        if not any(link == k or link.startswith(k + "/") for k in kept)
    ]
    return tuple(kept), tuple(made)


def command(host_dir: str, seccomp_fd: int) -> list[str]:
    """bwrap and its options; the interpreter's command line follows.

    ``host_dir`` appears as :data:`WORKDIR` (read-write); ``seccomp_fd`` is a readable
    descriptor of :func:`seccomp.filter_program`'s bytes, read by bwrap.
    """
    root = os.geteuid() == 0
    argv = [
        shutil.which("bwrap") or "bwrap",
        *("--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"),
        "--unshare-cgroup-try",
        "--die-with-parent",  # the sandbox ends with the trainer
        "--new-session",  # no terminal to inject keystrokes into
        *("--cap-drop", "ALL"),
    ]
    if root:
        # bwrap keeps root in the host's user namespace, so that the boot script can become
        # the run's own user (setuid/setgid: the only capabilities kept, lost with root).
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:  # a user namespace mapping the trainer's user to itself, none further inside
        argv += ["--unshare-user", "--disable-userns"]
    binds, links = _installation()
    dirs: set[str] = set()
    for path in [*binds, *(link for link, _ in links), WORKDIR]:
        parent = os.path.dirname(path)
        while parent != "/":
            dirs.add(parent)
            parent = os.path.dirname(parent)
    for d in sorted(dirs):  # passable by the run's user (bwrap would make them 0700)
        argv += ["--perms", "0755", "--dir", d]
    for path in binds:
        argv += ["--ro-bind", path, path]
    for link, target in links:
        argv += ["--symlink", target, link]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    argv += ["--bind", host_dir, WORKDIR]  # the boot script enters it as the run's user
    argv += ["--remount-ro", "/"]  # the sandbox's own root: not a place to write either
    argv += ["--seccomp", str(seccomp_fd), "--"]
    return argv


def _probe() -> str | None:
    """Runs ``python -c pass`` in the sandbox once; bwrap's complaint when it cannot."""
    program = seccomp.filter_program()
    work = tempfile.mkdtemp(prefix="grpo_sandbox_")
    r, w = os.pipe()
    try:
        os.write(w, program)
        os.close(w)
        w = -1
        cmd = [*command(work, r), sys.executable, "-I", "-c", "pass"]
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=60, pass_fds=(r,), cwd=work
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        shutil.rmtree(work, ignore_errors=True)
    if out.returncode == 0:
        return None
    lines = [ln.strip() for ln in out.stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {out.returncode}"


@functools.lru_cache(maxsize=1)
def problem() -> str | None:
    """Why the kernel sandbox cannot run on this machine (one line), or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"the kernel sandbox needs Linux (bubblewrap), not {sys.platform}; {_WEAKER}"
    if seccomp.machine_arch() is None:
        return (
            f"the kernel sandbox's seccomp filter knows x86_64 and aarch64, not "
            f"{os.uname().machine}; {_WEAKER}"
        )
    if shutil.which("bwrap") is None:
        return (
            "running code needs the kernel sandbox, bubblewrap (bwrap), which is not "
            f"installed: {INSTALL}; {_WEAKER}"
        )
    why = _probe()
    if why is None:
        return None
    userns = "" if os.geteuid() == 0 else " (as a user other than root it needs user namespaces)"
    return (
        f"the kernel sandbox, bubblewrap (bwrap), cannot start here{userns}: {why}; "
        f"allow it (in a container: unprivileged user namespaces, or run as root), {_WEAKER}"
    )
