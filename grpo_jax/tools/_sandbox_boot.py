"""Run by ``grpo_jax.tools.sandbox.run_python`` as the sandboxed interpreter's program.

    python -I -c "<this file's text>" <workdir> <code file> <limits json>

In the child, before the user's code: lowers its own resource limits, drops root to the
run's user id, removes ``os.mkfifo`` and ``os.mknod``, installs an audit hook (PEP 578) whose
policy the code it judges cannot change, then runs the code as a fresh ``__main__``. Only the
standard library is imported here. docs/multiturn.md, "The sandbox", has what the hook
refuses and how it guards its own state.
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


def _drop_root(uid: int, read_roots, private_mounts: bool) -> None:
    """Root ignores RLIMIT_NPROC and file permissions: run the code as ``uid``, a user of
    this run alone (so the parent can find and end every process it started by its user).
    The parent made the working directory that user's."""
    if not _is_real_root(os.geteuid(), _uid_map()):
        return
    if private_mounts:
        _expose(read_roots)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _mount(*args: str) -> bool:
    # Before the hook: nothing else runs in this process yet, so a plain spawn is safe.
    try:
        pid = os.posix_spawnp("mount", ["mount", *args], os.environ)
        return os.waitpid(pid, 0)[1] == 0
    except OSError:
        return False


def _expose(roots) -> None:
    """Makes each of ``roots`` reachable by any user, in this process's own mount namespace.

    A Python installed under ``/root`` (mode 0700) is unreadable to the run's user, so it
    could import only what was loaded before the switch. Here an ancestor that others may
    not pass is covered by an empty, passable tmpfs, and each root below it is bound back
    at its own path: the code reads the installation where it is, and nothing else of that
    directory (the host's files and modes are untouched; the mounts end with the run).
    """
    blocked: dict[str, list[str]] = {}
    for root in sorted(roots):
        parts = root.split("/")
        for i in range(2, len(parts)):
            above = "/".join(parts[:i])
            try:
                passable = os.stat(above).st_mode & stat.S_IXOTH
            except OSError:
                break
            if not passable:
                kept = blocked.setdefault(above, [])
                if not any(root.startswith(k + "/") for k in kept):
                    kept.append(root)
                break
    for above, below in blocked.items():
        fds = [os.open(r, os.O_PATH) for r in below]  # still reachable once covered
        try:
            if not _mount("-t", "tmpfs", "-o", "mode=755,size=64k", "tmpfs", above):
                continue
            for root, fd in zip(below, fds, strict=True):
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    os.makedirs(root, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(root), exist_ok=True)
                    open(root, "a").close()
                os.set_inheritable(fd, True)
                _mount("--no-canonicalize", "--bind", f"/proc/self/fd/{fd}", root)
        finally:
            for fd in fds:
                os.close(fd)


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
    # The ways to the hook's own function and to its frame's cells, which hold its policy.
    "gc.get_objects",
    "gc.get_referrers",
    "gc.get_referents",
    "sys.settrace",
    "sys.setprofile",
}
# Refused when not imported yet; posix and _imp are, so only a fresh copy is refused
# (one with the os functions this script removes).
_DENIED_IMPORTS = {"_posixsubprocess", "_ctypes", "ctypes", "posix", "_imp"}
# Make files (FIFOs, device nodes, regular files) anywhere the user may write, and raise
# no audit event that the hook could check: removed from os and posix altogether.
_UNAUDITED_MAKERS = ("mkfifo", "mknod")
_PATH_WRITE_EVENTS = {
    "os.remove",
    "os.rmdir",
    "os.mkdir",
    "os.rename",
    "os.truncate",
    "os.chmod",
    "os.utime",
    "shutil.rmtree",
}
_PATH_READ_EVENTS = {"os.listdir", "os.scandir", "os.chdir", "glob.glob"}
# Devices a read-only os.open may name (the runtime's own fallback for random bytes).
_READABLE_DEVICES = {"/dev/null", "/dev/urandom", "/dev/random", "/dev/zero"}


def _writes(mode, flags) -> bool:
    """Whether an ``open`` event (``mode``: io's mode string, None for os.open) may write.

    O_TRUNC empties a file even when opened read-only, so it counts as writing.
    """
    if mode is not None:
        return any(c in str(mode) for c in "wax+")
    return isinstance(flags, int) and bool(
        flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    )


def _install_hook(workdir: str, read_roots) -> None:
    # Everything the hook uses is bound here, immutable or implemented in C: the code runs
    # in this interpreter and may replace any module attribute afterwards.
    denied_events, denied_imports = frozenset(_DENIED_EVENTS), frozenset(_DENIED_IMPORTS)
    write_events, read_events = frozenset(_PATH_WRITE_EVENTS), frozenset(_PATH_READ_EVENTS)
    devices, writes = frozenset(_READABLE_DEVICES), _writes
    write_roots, read_roots = (workdir.rstrip("/"),), tuple(r.rstrip("/") for r in read_roots)
    lstat, readlink, getcwd, fspath = os.lstat, os.readlink, os.getcwd, os.fspath
    is_link, as_str, decode = stat.S_ISLNK, str.__str__, bytes.decode
    o_path, path_types = getattr(os, "O_PATH", 0), (str, bytes, os.PathLike)

    def text(path):
        path = fspath(path)
        return decode(path, "utf-8", "surrogateescape") if isinstance(path, bytes) else as_str(path)

    def resolve(path: str):
        """The absolute path with every symbolic link followed (os.path.realpath, non-strict:
        a part that does not exist or cannot be examined is taken as written)."""
        todo = path.split("/")[::-1]
        if not path.startswith("/"):
            todo += getcwd().split("/")[::-1]
        done, links = [], 0
        while todo:
            name = todo.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if done:
                    done.pop()
                continue
            here = "/" + "/".join([*done, name])
            try:
                link = is_link(lstat(here).st_mode)
            except (OSError, ValueError):
                link = False
            if not link:
                done.append(name)
                continue
            links += 1
            if links > 40:
                return None
            target = readlink(here)
            if target.startswith("/"):
                done = []
            todo += target.split("/")[::-1]
        return "/" + "/".join(done)

    def inside(path, roots) -> bool:
        try:
            p = resolve(text(path))
        except Exception:
            return False
        return p is not None and any(p == r or p.startswith(r + "/") for r in roots)

    def refuse(what):
        raise PermissionError(f"sandbox: {what} is not allowed")

    def hook(event, args):
        if event in denied_events or event.startswith("ctypes."):
            refuse(event)  # all of ctypes: no foreign call, however _ctypes got loaded
        if event == "import" and args and isinstance(args[0], str):
            if as_str(args[0]) in denied_imports:
                refuse(f"import {args[0]}")
        if event == "open":
            path, mode, flags = (list(args) + [None, None, None])[:3]
            if isinstance(path, int) or path is None:
                return
            writing = writes(mode, flags)
            if writing and not inside(path, write_roots):
                refuse(f"writing {text(path)!r} (outside the sandbox directory)")
            if not writing and not inside(path, read_roots):
                refuse(f"reading {text(path)!r} (outside the sandbox directory)")
            # The open event does not carry dir_fd, so a path relative to a directory's
            # descriptor would be checked against the wrong directory: no directory
            # descriptor may be handed out. A check of the path before the open cannot
            # know (a second thread may swap a directory in), so the kernel decides:
            # os.open must ask for writing, which a directory refuses (EISDIR), and io's
            # open examines what it opened and refuses a directory itself. O_PATH opens a
            # directory whatever else it asks for.
            if mode is None and isinstance(flags, int):
                if flags & o_path:
                    refuse(f"os.open with O_PATH ({text(path)!r})")
                if not writing and resolve(text(path)) not in devices:
                    refuse(f"os.open for reading ({text(path)!r}; open() it instead)")
        elif event in write_events:
            for path in args:
                if isinstance(path, path_types) and not inside(path, write_roots):
                    refuse(f"{event} on {text(path)!r} (outside the sandbox directory)")
            # fchmod, futimens, ftruncate: the event names a descriptor, not a path; a
            # file opened for reading outside must not be changed through it.
            if args and isinstance(args[0], int) and not isinstance(args[0], bool):
                if not inside(f"/proc/self/fd/{args[0]}", write_roots):
                    refuse(f"{event} on descriptor {args[0]} (not a file in the sandbox directory)")
        elif event in read_events:
            path = args[0] if args else None
            if isinstance(path, path_types) and not inside(path, read_roots):
                refuse(f"{event} on {text(path)!r} (outside the sandbox directory)")

    sys.addaudithook(hook)


def _read_roots(workdir: str) -> set[str]:
    """Where the code may read: its directory and the Python installation (the standard
    library must import), by real path."""
    roots = {workdir, "/dev/null", "/dev/urandom"}
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        roots.add(os.path.realpath(p))
    for p in sys.path:
        if p and os.path.isdir(p):
            roots.add(os.path.realpath(p))
    return roots


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
    import shutil

    shutil._use_fd_functions = False
    shutil.rmtree.avoids_symlink_attacks = False


# Imported before the drop to nobody under the hooks sandbox: the interpreter's own files
# may be unreadable to nobody (a Python installed under /root), so the code gets these
# ready-made. (Under bwrap the run's user can read the whole installation.)
PRELOAD = (
    "abc array base64 bisect cmath collections copy dataclasses datetime decimal "
    "encodings.idna enum fractions functools glob hashlib heapq io itertools json math "
    "operator pathlib random re shutil socket statistics string struct textwrap time "
    "traceback typing unicodedata"
).split()


def _supervise(status_fd: int) -> None:
    """Forks; the child returns and runs the code, this process waits for it and reports.

    This process is the first of the run's pid namespace (when it has one): the kernel ends
    every process of the namespace when it exits, and it never changes user, so unshare's
    --kill-child still ends it with unshare. The code does not run as that first process,
    whose default signal dispositions do not apply (it would outlive SIGXCPU, for one).
    How the child ended goes to the parent on ``status_fd`` as an exit code (negative: the
    signal that killed it), since this process exits normally whatever happened.
    """
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        return
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1):  # the output pipes end when the code's processes end
        os.dup2(null, fd)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    os.write(status_fd, b"%d" % code)
    os._exit(code if code >= 0 else 1)


def main() -> None:
    workdir, code_path, limits = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    workdir = os.path.realpath(workdir)
    for name in PRELOAD if limits.get("preload", True) else ():
        try:
            __import__(name)
        except ImportError:
            pass
    read_roots = _read_roots(workdir)
    if limits.get("status_fd") is not None:
        _supervise(limits["status_fd"])  # returns in the child that runs the code
    _drop_root(limits.get("uid", 65534), read_roots, limits.get("private_mounts", False))
    # The directory is the run's user's, mode 0700: a root without capabilities (under
    # bwrap) may not enter it, the run's user may.
    os.chdir(workdir)
    with open(code_path, encoding="utf-8") as f:
        source = f.read()
    _limits(limits)
    sys.argv = ["main.py"]
    sys.path[:] = [p for p in sys.path if p]  # no script directory on the path
    code = compile(source, "main.py", "exec")
    _remove_unaudited_makers()
    _directory_fds_unused()
    _install_hook(workdir, read_roots)
    # The code's own __main__: `import __main__` must not lead to this script's globals.
    module = type(sys)("__main__")
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # the user's traceback, without this script's frame
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        for stream in (sys.stdout, sys.__stdout__, sys.stderr, sys.__stderr__):
            try:  # what the code printed before it failed is part of its output
                stream.flush()
            except Exception:
                pass
        os._exit(1)


if __name__ == "__main__":
    main()
