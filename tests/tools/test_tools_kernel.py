"""The kernel sandbox: its seccomp filter, and refusing to run code where it cannot run."""

import errno
import os
import pathlib
import platform
import re
import struct
import subprocess
import sys

import pytest

from grpo_jax import rewards
from grpo_jax.core.errors import ConfigError
from grpo_jax.envs import base as envs
from grpo_jax.rewards.section import parse_rewards
from grpo_jax.tools import bubblewrap, sandbox, seccomp

_ARCHES = sorted(seccomp.AUDIT_ARCH)
_EPERM = seccomp.RET_ERRNO | errno.EPERM
_ENOSYS = seccomp.RET_ERRNO | errno.ENOSYS
# Calls every Python program makes: read, write, openat, mmap, exit_group, and clone for a
# fork (flags SIGCHLD | CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID).
_ORDINARY = {"x86_64": (0, 1, 257, 9, 231, 56), "aarch64": (63, 64, 56, 222, 94, 220)}
_FORK_FLAGS = 0x01200011


def _verdict(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """What the kernel's seccomp would decide: ``program`` run on one system call."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    insns = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    pc = acc = 0
    for _ in range(len(insns)):  # forward jumps only: at most one pass
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld [k]
            acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code in (0x15, 0x35, 0x45):  # jeq, jge, jset
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if taken else jf)
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")
    raise AssertionError("ran off the program")


@pytest.mark.parametrize("arch", _ARCHES)
def test_the_filter_denies_the_listed_calls_and_allows_the_rest(arch):
    program = seccomp.filter_program(arch)
    audit = seccomp.AUDIT_ARCH[arch]
    numbers = seccomp.syscall_numbers(arch)
    assert {"mount", "unshare", "ptrace", "bpf", "mknodat", "io_uring_setup"} <= set(numbers)
    for name, nr in numbers.items():
        assert _verdict(program, nr, audit) == _EPERM, name
    for nr in _ORDINARY[arch]:
        assert _verdict(program, nr, audit, arg0=_FORK_FLAGS) == seccomp.RET_ALLOW, nr
    clone = _ORDINARY[arch][-1]
    assert _verdict(program, clone, audit, arg0=_FORK_FLAGS | 0x10000000) == _EPERM  # NEWUSER
    assert _verdict(program, clone, audit, arg0=0x00020000 | 17) == _EPERM  # NEWNS
    assert _verdict(program, 435, audit) == _ENOSYS  # clone3: the C library falls back
    # Another ABI on the same machine: the process dies.
    assert _verdict(program, _ORDINARY[arch][0], 0x40000003) == seccomp.RET_KILL_PROCESS
    if arch == "x86_64":  # x32: the same arch, numbers with bit 30 set
        assert _verdict(program, 0x40000000 | 1, audit) == seccomp.RET_KILL_PROCESS


def _header_numbers(path: str) -> dict[str, int]:
    text = pathlib.Path(path).read_text()
    return {m[0]: int(m[1]) for m in re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b", text)}


@pytest.mark.parametrize(
    "arch, header",
    [
        ("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
        ("aarch64", "/usr/include/asm-generic/unistd.h"),
    ],
)
def test_the_syscall_numbers_are_the_kernel_headers(arch, header):
    if not os.path.exists(header):
        pytest.skip(f"no {header} (linux-libc-dev)")
    known = _header_numbers(header)
    for name, nr in seccomp.syscall_numbers(arch).items():
        assert known.get(name) == nr, name
    # A call the table leaves out on this arch does not exist there.
    for name in set(seccomp.DENIED) - set(seccomp.syscall_numbers(arch)):
        assert name not in known, name


def test_an_unknown_arch_is_named():
    with pytest.raises(ValueError, match="x86_64 and aarch64, not 'riscv64'"):
        seccomp.filter_program("riscv64")


_LIVE = """
import ctypes, errno, os, sys, threading
program = bytes.fromhex(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
buf = ctypes.create_string_buffer(program, len(program))
prog = Prog(len(program) // 8, ctypes.cast(buf, ctypes.c_char_p))
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.syscall(int(sys.argv[2]), 1, 0, ctypes.byref(prog)) == 0, ctypes.get_errno()
def call(nr, *args):
    ctypes.set_errno(0)
    libc.syscall(nr, *args)
    return errno.errorcode.get(ctypes.get_errno(), "ok")
numbers = dict(arg.split("=") for arg in sys.argv[3:])
print("unshare", call(int(numbers["unshare"]), 0x10000000))
print("mknodat", call(int(numbers["mknodat"]), -100, b"fifo", 0o10600, 0))
print("ptrace", call(int(numbers["ptrace"]), 0, 0, 0, 0))
print("clone3", call(435, 0, 0))
seen = []
t = threading.Thread(target=seen.append, args=("thread",))
t.start(); t.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
print(seen[0], "fork", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), os.listdir("."))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or seccomp.machine_arch() is None,
    reason="needs Linux on x86_64 or aarch64",
)
def test_the_filter_installed_here_gives_eperm_and_programs_still_run(tmp_path):
    arch = seccomp.machine_arch()
    numbers = seccomp.syscall_numbers(arch)
    seccomp_nr = {"x86_64": 317, "aarch64": 277}[arch]
    args = [seccomp.filter_program().hex(), str(seccomp_nr)]
    args += [f"{n}={numbers[n]}" for n in ("unshare", "mknodat", "ptrace")]
    out = subprocess.run(
        [sys.executable, "-c", _LIVE, *args], capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "unshare EPERM",
        "mknodat EPERM",
        "ptrace EPERM",
        "clone3 ENOSYS",
        "thread fork 7 []",
    ]


needs_kernel_sandbox = pytest.mark.skipif(
    bubblewrap.problem() is not None, reason=str(bubblewrap.problem())
)


@needs_kernel_sandbox
def test_inside_the_kernel_sandbox_below_the_hook(monkeypatch, tmp_path):
    # The boot script without its audit hook: what code that got past the hook has.
    text = pathlib.Path(sandbox._BOOT).read_text()
    boot = tmp_path / "boot.py"
    boot.write_text(text.replace("\n    _install_hook(", "\n    (lambda *a: None)("))
    monkeypatch.setattr(sandbox, "_BOOT", boot)
    numbers = seccomp.syscall_numbers(seccomp.machine_arch())
    code = (
        "import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"for name, nr, args in (('unshare', {numbers['unshare']}, (0x10000000,)),\n"
        f"        ('mount', {numbers['mount']}, (b'none', b'/sandbox', b'tmpfs', 0, 0)),\n"
        f"        ('mknodat', {numbers['mknodat']}, (-100, b'fifo', 0o10600, 0))):\n"
        "    ctypes.set_errno(0)\n    libc.syscall(nr, *args)\n"
        "    print(name, errno.errorcode.get(ctypes.get_errno()))\n"
        "print(os.getcwd(), sorted(os.listdir('/')))\n"
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n"
        "except OSError as e:\n    print('network', errno.errorcode.get(e.errno))\n"
    )
    r = sandbox.run_python(code, timeout_s=10, sandbox="kernel")
    lines = r.stdout.splitlines()
    assert lines[:3] == ["unshare EPERM", "mount EPERM", "mknodat EPERM"], r
    assert lines[3].startswith(bubblewrap.WORKDIR + " ["), r
    assert "'sandbox'" in lines[3], r
    # /tmp and /home are there only when the interpreter's installation lives under them (a
    # checkout cloned into a temporary folder), bound read-only: the host's own are not.
    binds, links = bubblewrap._installation()
    needed = {pathlib.PurePath(path).parts[1] for path in (*binds, *(link for link, _ in links))}
    for name in ("tmp", "home"):
        assert f"'{name}'" not in lines[3] or name in needed, r
    assert lines[4] == "network ENETUNREACH", r


@pytest.fixture
def no_bwrap(monkeypatch, tmp_path):
    """A PATH without bubblewrap (a fake ``bwrap`` may be put in ``tmp_path``); the
    kernel sandbox's answer is looked up again, and again after the test."""
    sandbox._unshare_prefix()  # looked up once per process: with the usual PATH
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(sandbox.ENV_VAR, raising=False)
    bubblewrap.problem.cache_clear()
    yield tmp_path
    bubblewrap.problem.cache_clear()


def test_without_bubblewrap_code_is_refused_in_one_line(no_bwrap, monkeypatch):
    with pytest.raises(sandbox.SandboxUnavailable) as e:
        sandbox.run_python("print(1)")
    msg = str(e.value)
    assert "\n" not in msg and "bubblewrap (bwrap)" in msg and "not installed" in msg, msg
    assert "apt-get install bubblewrap" in msg and "sandbox='hooks'" in msg, msg
    assert "GRPO_JAX_SANDBOX=hooks" in msg, msg
    # Named, the weaker sandbox runs it; so does the environment variable.
    assert sandbox.run_python("print(1)", sandbox="hooks").stdout == "1\n"
    monkeypatch.setenv(sandbox.ENV_VAR, "hooks")
    assert sandbox.run_python("print(2)").stdout == "2\n"


def test_a_bwrap_that_cannot_start_is_named(no_bwrap):
    if seccomp.machine_arch() is None or not sys.platform.startswith("linux"):
        pytest.skip("the kernel sandbox is refused earlier here")
    fake = no_bwrap / "bwrap"
    fake.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to create a new namespace' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    with pytest.raises(sandbox.SandboxUnavailable, match="No permissions to create a new"):
        sandbox.sandbox_mode()


def test_bad_sandbox_names_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match="sandbox = 'strict' must be 'kernel'"):
        sandbox.run_python("print(1)", sandbox="strict")
    monkeypatch.setenv(sandbox.ENV_VAR, "off")
    with pytest.raises(ConfigError, match="GRPO_JAX_SANDBOX = 'off' must be 'kernel'"):
        sandbox.sandbox_mode()
    with pytest.raises(ConfigError, match=r"reward \"code_tests\(sandbox='x'\)\": sandbox = 'x'"):
        rewards.get("code_tests(sandbox='x')")


def test_code_rewards_and_tools_are_refused_when_the_sandbox_is_missing(no_bwrap):
    with pytest.raises(ConfigError) as e:
        parse_rewards("code_tests(workers=1):1.0")
    assert str(e.value).startswith("reward 'code_tests(workers=1)': running code needs"), e.value
    assert "\n" not in str(e.value)
    got = rewards.get("code_tests(workers=1, sandbox='hooks')")
    assert got([""], ["def f():\n    return 1"], tests=[["assert f() == 1"]]) == [1.0]
    # The environment that offers the python tool is refused when made; one that offers
    # only the calculator runs no code and needs no sandbox.
    env, error = envs.safe_make("tool_use(tools=('calculator', 'python'))", 10.0)
    assert env is None and "running code needs the kernel sandbox" in error, error
    assert envs.safe_make("tool_use(tools=('calculator',))", 10.0)[1] is None
    env, error = envs.safe_make("tool_use(tools=('python',), sandbox='hooks')", 10.0)
    assert error is None
    obs = env.step("<python>print(6 * 7)</python>")[0]
    assert obs == '<tool_result name="python">42</tool_result>', obs


@pytest.mark.skipif(platform.system() != "Linux", reason="Linux only")
def test_the_tool_call_cannot_choose_the_sandbox(no_bwrap):
    # A model's arguments go to the tool as arguments; the sandbox is the caller's.
    from grpo_jax import tools

    call = tools.ToolCall("python", {"code": "print(1)", "sandbox": "hooks"})
    result = tools.run_tool_calls([call])[0][1]
    assert result.exit_code == 1 and "SandboxUnavailable" in result.stderr, result
