"""Started by ``grpo_jax.tools.sandbox.run_python`` as the sandboxed interpreter's script.

    python -I _sandbox_boot.py <workdir> <code file> <limits json>

Runs in the child before the user's code: lowers its own resource limits, drops root to
the ``nobody`` user, removes the os functions that make files without an audit event
(``mkfifo``, ``mknod``), installs an audit hook (PEP 578) that refuses processes,
sockets, native code, directory descriptors and file access outside the working
directory, then runs the code as ``__main__``. Only the standard library is imported here.
"""

import json
import os
import resource
import stat
import sys


def _limits(lim: dict) -> None:
    def cap(which, value, hard_extra=0):
        value = int(value)
        soft, hard = resource.getrlimit(which)
        new_hard = value + hard_extra
        if hard != resource.RLIM_INFINITY:
            value, new_hard = min(value, hard), min(new_hard, hard)
        resource.setrlimit(which, (value, new_hard))

    # CPU: a backstop behind the parent's wall clock (cpu_s is a second past it, and a
    # single-threaded child's CPU time cannot outrun the clock). SIGXCPU at the soft
    # limit kills; the kernel's SIGKILL at the hard limit a second later is the last word.
    cap(resource.RLIMIT_CPU, lim["cpu_s"], hard_extra=1)
    cap(resource.RLIMIT_AS, lim["memory_bytes"])
    cap(resource.RLIMIT_FSIZE, lim["file_bytes"])
    cap(resource.RLIMIT_NOFILE, 64)
    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_NPROC, lim["nproc"])


def _uid_map():
    try:
        with open("/proc/self/uid_map", encoding="ascii") as f:
            return f.read()
    except OSError:
        return None


def _is_real_root(euid: int, uid_map) -> bool:
    """Whether this process is root outside its user namespace too (``uid_map``: None if unknown).

    Under ``unshare -r`` (the fallback for a non-root trainer) the child sees euid 0, but
    that uid is the trainer's own outside: it has no more power than the trainer, and
    nobody is not mapped there, so switching to nobody would fail (``EINVAL``) and is
    not needed. Unknown maps count as root, so a real root is never left in place.
    """
    if euid != 0:
        return False
    for line in (uid_map or "").splitlines():
        fields = line.split()
        if len(fields) != 3 or not all(f.isdigit() for f in fields):
            continue
        inside, outside, count = (int(f) for f in fields)
        if inside <= 0 < inside + count:
            return outside - inside == 0
    return True


def _drop_root(workdir: str) -> None:
    # Root ignores RLIMIT_NPROC and file permissions: run the code as nobody.
    if not _is_real_root(os.geteuid(), _uid_map()):
        return
    nobody = 65534
    os.chown(workdir, nobody, nobody)
    for name in os.listdir(workdir):
        os.chown(os.path.join(workdir, name), nobody, nobody)
    os.setgroups([])
    os.setgid(nobody)
    os.setuid(nobody)


_DENIED_EVENTS = {
    "os.fork",
    "os.forkpty",
    "os.exec",
    "os.spawn",
    "os.posix_spawn",
    "os.system",
    "os.kill",
    "os.killpg",
    "subprocess.Popen",
    "socket.__new__",
    "socket.connect",
    "socket.bind",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    # A subinterpreter starts with no audit hooks and a fresh posix module.
    "cpython.PyInterpreterState_New",
    "os.symlink",
    "os.link",
    "os.chown",
    "os.setxattr",
    "os.removexattr",
}
# Refused when not imported yet; posix and _imp are, so only a fresh copy is refused
# (one with the os functions this script removes).
_DENIED_IMPORTS = {"_posixsubprocess", "_ctypes", "ctypes", "posix", "_imp"}
# Make files (FIFOs, device nodes, regular files) anywhere the user may write, and raise
# no audit event that the hook could check: removed from os and posix altogether.
_UNAUDITED_MAKERS = ("mkfifo", "mknod")
_PATH_WRITE_EVENTS = {
    "os.remove": 0,
    "os.rmdir": 0,
    "os.mkdir": 0,
    "os.rename": 0,
    "os.truncate": 0,
    "os.chmod": 0,
    "os.utime": 0,
    "shutil.rmtree": 0,
}
_PATH_READ_EVENTS = {"os.listdir": 0, "os.scandir": 0, "os.chdir": 0, "glob.glob": 0}


def _install_hook(workdir: str) -> None:
    workdir = os.path.realpath(workdir)
    # Reading is allowed in the working directory and in the Python installation
    # (the standard library must import); writing in the working directory only.
    read_roots = {workdir}
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        read_roots.add(os.path.realpath(p))
    for p in sys.path:
        if p and os.path.isdir(p):
            read_roots.add(os.path.realpath(p))
    read_roots.update({"/dev/null", "/dev/urandom"})
    real = os.path.realpath
    fspath = os.fspath

    def inside(path, roots) -> bool:
        try:
            p = real(fspath(path))
        except Exception:
            return False
        return any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)

    def refuse(what):
        raise PermissionError(f"sandbox: {what} is not allowed")

    stat_path, is_dir_mode = os.stat, stat.S_ISDIR

    def maybe_directory(path) -> bool:
        # A path it cannot stat (no permission) may be a directory too.
        try:
            return is_dir_mode(stat_path(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except (OSError, ValueError):
            return True

    def hook(event, args):
        if event in _DENIED_EVENTS or event.startswith("ctypes."):
            refuse(event)  # all of ctypes: no foreign call, however _ctypes got loaded
        if event == "import" and args and args[0] in _DENIED_IMPORTS:
            refuse(f"import {args[0]}")
        if event == "open":
            path, mode, flags = (list(args) + [None, None, None])[:3]
            if isinstance(path, int) or path is None:
                return
            writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            )
            if writing and not inside(path, {workdir}):
                refuse(f"writing {fspath(path)!r} (outside the sandbox directory)")
            if not writing and not inside(path, read_roots):
                refuse(f"reading {fspath(path)!r} (outside the sandbox directory)")
            # The open event does not carry dir_fd, so a path relative to a directory's
            # descriptor would be checked against the wrong directory: os.open (the event
            # with mode None) hands out no descriptor of a directory at all. io.open never
            # gives one (FileIO refuses directories), though tempfile passes it a directory
            # with an opener; os.scandir and os.listdir need none.
            if mode is None and maybe_directory(path):
                refuse(f"opening the directory {fspath(path)!r} (a dir_fd escapes the checks)")
        elif event in _PATH_WRITE_EVENTS:
            paths = [a for a in args if isinstance(a, (str, bytes, os.PathLike))]
            for path in paths:
                if not inside(path, {workdir}):
                    refuse(f"{event} on {fspath(path)!r} (outside the sandbox directory)")
            # fchmod, futimens, ftruncate: the event names a descriptor, not a path; a
            # file opened for reading outside must not be changed through it.
            if args and isinstance(args[0], int) and not isinstance(args[0], bool):
                if not inside(f"/proc/self/fd/{args[0]}", {workdir}):
                    refuse(f"{event} on descriptor {args[0]} (not a file in the sandbox directory)")
        elif event in _PATH_READ_EVENTS:
            path = args[0] if args else None
            if isinstance(path, (str, bytes, os.PathLike)) and not inside(path, read_roots):
                refuse(f"{event} on {fspath(path)!r} (outside the sandbox directory)")

    sys.addaudithook(hook)


def _remove_unaudited_makers() -> None:
    """Replaces os.mkfifo and os.mknod, wherever the interpreter keeps them, by refusals.

    The originals must leave every reference (os, posix, the os.supports_* sets, and the
    way to build a fresh posix module), or the code could still find them.
    """
    import _imp
    import posix

    for name in _UNAUDITED_MAKERS:
        original = getattr(posix, name, None)
        if original is None:
            continue

        def refused(*args, _name=name, **kwargs):
            raise PermissionError(
                f"sandbox: os.{_name} is not allowed (it makes files the sandbox cannot check)"
            )

        refused.__name__ = refused.__qualname__ = name
        for module in (os, posix):
            setattr(module, name, refused)
        for group in (
            os.supports_dir_fd,
            os.supports_fd,
            os.supports_follow_symlinks,
            os.supports_effective_ids,
        ):
            if original in group:
                group.discard(original)
                group.add(refused)
    create_builtin = _imp.create_builtin

    def create_builtin_checked(spec):
        if spec.name in _DENIED_IMPORTS:
            raise PermissionError(f"sandbox: a fresh {spec.name} module is not allowed")
        return create_builtin(spec)

    _imp.create_builtin = create_builtin_checked


def _directory_fds_unused() -> None:
    # shutil.rmtree would open directories (refused by the hook) to remove their contents
    # by descriptor; by path it works, each step checked by the hook.
    shutil = sys.modules.get("shutil")
    if shutil is not None:
        shutil._use_fd_functions = False
        shutil.rmtree.avoids_symlink_attacks = False


# Imported before the drop to nobody: the interpreter's own files may be unreadable to
# nobody (a Python installed under /root), so the code gets these ready-made.
PRELOAD = (
    "abc array base64 bisect cmath collections copy dataclasses datetime decimal "
    "encodings.idna enum fractions functools glob hashlib heapq io itertools json math "
    "operator pathlib random re shutil socket statistics string struct textwrap time "
    "traceback typing unicodedata"
).split()


def main() -> None:
    workdir, code_path, limits = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    with open(code_path, encoding="utf-8") as f:
        source = f.read()
    os.chdir(workdir)
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    _drop_root(workdir)
    _limits(limits)
    sys.argv = ["main.py"]
    sys.path[:] = [p for p in sys.path if p]  # no script directory on the path
    code = compile(source, "main.py", "exec")
    _remove_unaudited_makers()
    _directory_fds_unused()
    _install_hook(workdir)
    del sys.modules["__main__"].__dict__["main"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(code, namespace)
    except SystemExit:
        raise
    except BaseException as e:  # the user's traceback, without this script's frame
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
