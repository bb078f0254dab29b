"""The seccomp filter of the kernel sandbox: a classic-BPF program that bubblewrap loads.

    program = filter_program()          # bytes: struct sock_filter[], this machine's arch
    bwrap --seccomp FD ...              # FD reads ``program``

The system calls a sandboxed program has no business with fail with EPERM, ``clone3`` with
ENOSYS, and a call of another ABI kills the process; everything else is allowed. The list:
docs/multiturn.md, "The sandbox".
"""

from __future__ import annotations

import errno
import platform
import struct

# Denied with EPERM. Numbers of the two ABIs this filter knows: x86_64
# (arch/x86/entry/syscalls/syscall_64.tbl) and aarch64 (the generic table,
# include/uapi/asm-generic/unistd.h); None where the call does not exist there.
_DENIED: dict[str, tuple[int | None, int | None]] = {
    # Mounts and namespaces: the sandbox's view of the file system is fixed.
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "unshare": (272, 97),
    "setns": (308, 268),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    # Other processes' memory and descriptors.
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "process_madvise": (440, 440),
    "pidfd_getfd": (438, 438),
    "kcmp": (312, 272),
    # The kernel itself: modules, kexec, BPF, perf, keyrings, io_uring, userfaultfd.
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "create_module": (174, None),
    "get_kernel_syms": (177, None),
    "query_module": (178, None),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "lookup_dcookie": (212, 18),
    "fanotify_init": (300, 262),
    "syslog": (103, 116),
    "uselib": (134, None),
    "nfsservctl": (180, 42),
    "_sysctl": (156, None),
    # Files by handle (past the mount's root), and device nodes and FIFOs: no file the
    # sandbox's program needs is made with mknod, and a FIFO would outlive nothing.
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "mknod": (133, None),
    "mknodat": (259, 33),
    # The machine: swap, reboot, accounting, the clock, the host name, quotas, I/O ports.
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "reboot": (169, 142),
    "acct": (163, 89),
    "settimeofday": (164, 170),
    "clock_settime": (227, 112),
    "clock_adjtime": (305, 266),
    "adjtimex": (159, 171),
    "sethostname": (170, 161),
    "setdomainname": (171, 162),
    "vhangup": (153, 58),
    "quotactl": (179, 60),
    "quotactl_fd": (443, 443),
    "iopl": (172, None),
    "ioperm": (173, None),
    "modify_ldt": (154, None),
}
DENIED = tuple(sorted(_DENIED))
_CLONE = (56, 220)
_CLONE3 = (435, 435)
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (CLONE_NEWTIME cannot be
# given to clone: its bit is the exit signal's there).
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
CLONE_NEW_FLAGS |= 0x40000000

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_ABI = {"x86_64": 0, "aarch64": 1}  # column of _DENIED
_X32_BIT = 0x40000000  # x86_64's x32 ABI: the same arch, numbers with this bit

# Classic BPF (linux/filter.h, linux/seccomp.h).
_LD_W_ABS = 0x20
_JEQ_K, _JGE_K, _JSET_K = 0x15, 0x35, 0x45
_RET_K = 0x06
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
RET_KILL_PROCESS = 0x80000000
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # args[0]'s low half on a little-endian machine


def machine_arch() -> str | None:
    """This machine's ABI as the filter names it ("x86_64", "aarch64"), or None."""
    m = platform.machine().lower()
    return {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(m)


def syscall_numbers(arch: str) -> dict[str, int]:
    """The denied calls that exist on ``arch`` and their numbers."""
    col = _ABI[arch]
    return {name: nrs[col] for name, nrs in _DENIED.items() if nrs[col] is not None}


def filter_program(arch: str | None = None) -> bytes:
    """The filter for ``arch`` (default: this machine's) as ``struct sock_filter[]`` bytes.

    Raises ValueError for an arch the filter does not know.
    """
    arch = arch or machine_arch()
    if arch not in AUDIT_ARCH:
        raise ValueError(
            f"the seccomp filter knows x86_64 and aarch64, not {arch or platform.machine()!r}"
        )
    col = _ABI[arch]
    denied = sorted(syscall_numbers(arch).values())
    # Each instruction: (code, jump if true, jump if false, k); jumps are to labels,
    # resolved below into offsets from the next instruction.
    prog: list[tuple[int, object, object, int]] = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 0, "kill", AUDIT_ARCH[arch]),
        (_LD_W_ABS, 0, 0, _NR),
    ]
    if arch == "x86_64":
        prog.append((_JGE_K, "kill", 0, _X32_BIT))
    prog += [(_JEQ_K, "deny", 0, nr) for nr in denied]
    prog += [
        (_JEQ_K, "enosys", 0, _CLONE3[col]),
        (_JEQ_K, 0, "allow", _CLONE[col]),
        (_LD_W_ABS, 0, 0, _ARG0_LOW),
        (_JSET_K, "deny", 0, CLONE_NEW_FLAGS),
    ]
    labels = {}
    for label, ret in (
        ("allow", RET_ALLOW),
        ("deny", RET_ERRNO | errno.EPERM),
        ("enosys", RET_ERRNO | errno.ENOSYS),
        ("kill", RET_KILL_PROCESS),
    ):
        labels[label] = len(prog)
        prog.append((_RET_K, 0, 0, ret))
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(prog):
        jt, jf = (labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))
        if not (0 <= jt <= 255 and 0 <= jf <= 255):
            raise AssertionError(f"jump out of range at instruction {i}")
        out += struct.pack("=HBBI", code, jt, jf, k)
    return bytes(out)
