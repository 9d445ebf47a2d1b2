"""The sandbox's seccomp filter: the system calls no sandboxed process may make.

Denied with EPERM, for the process and everything it starts:
- `socket(AF_UNIX, ...)`: a unix socket reaches whatever listens on the host's file
  system (docker.sock, a database) through any visible path, read-only or not;
  `socketpair` (asyncio, multiprocessing queues) stays allowed, it reaches nobody.
- `io_uring_*`: io_uring can create and connect sockets past this filter.
- SysV `shmget`/`semget`/`msgget`, POSIX `mq_open`, `add_key`/`request_key`/`keyctl`:
  state that outlives a program and is invisible in any file system, so a fork server
  could not wipe it between programs.
- any other architecture's system calls (the x32 ABI, `int 0x80`): the numbers above
  are only right for the native one.

Written as raw classic BPF (no libseccomp here) and installed with `prctl`; `None` where
the architecture is not one of those below, which the sandbox treats as unavailable.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct
from functools import lru_cache

_LD_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_ALLOW, _DENY = 0x7FFF0000, 0x00050000 | errno.EPERM
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (arg0's low half: little endian)
_AF_UNIX = 1
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2

# machine: (AUDIT_ARCH_*, first number of a foreign ABI or None, socket, always denied)
# denied: shmget, semget, msgget, mq_open, add_key, request_key, keyctl, io_uring x3.
_ARCHES = {
    "x86_64": (0xC000003E, 0x40000000, 41, (29, 64, 68, 240, 248, 249, 250, 425, 426, 427)),
    "aarch64": (0xC00000B7, None, 198, (194, 190, 186, 180, 217, 218, 219, 425, 426, 427)),
}


def _assemble(ins: list[tuple]) -> bytes:
    """("ld", offset), ("ret", value), (op, k, true_to, false_to) with labels or 0, ("label", name)."""
    labels, pos = {}, 0
    for op, *args in ins:
        if op == "label":
            labels[args[0]] = pos
        else:
            pos += 1
    out, pos = [], 0
    for op, *args in ins:
        if op == "label":
            continue
        pos += 1
        if op in ("ld", "ret"):
            out.append(struct.pack("=HBBI", _LD_ABS if op == "ld" else _RET, 0, 0, args[0]))
        else:
            k, *targets = args
            jt, jf = (labels[t] - pos if isinstance(t, str) else t for t in targets)
            out.append(struct.pack("=HBBI", _JEQ if op == "jeq" else _JGE, jt, jf, k))
    return b"".join(out)


@lru_cache(maxsize=1)
def filter_program() -> bytes | None:
    spec = _ARCHES.get(platform.machine())
    if spec is None:
        return None
    arch, foreign, socket_nr, denied = spec
    ins: list[tuple] = [("ld", _ARCH), ("jeq", arch, 0, "deny"), ("ld", _NR)]
    if foreign is not None:
        ins.append(("jge", foreign, "deny", 0))
    ins += [("jeq", nr, "deny", 0) for nr in denied]
    ins += [("jeq", socket_nr, 0, "allow"), ("ld", _ARG0), ("jeq", _AF_UNIX, "deny", 0)]
    ins += [("label", "allow"), ("ret", _ALLOW), ("label", "deny"), ("ret", _DENY)]
    return _assemble(ins)


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Installer:
    """Built in the parent, called in a `preexec_fn`: the child only makes two prctl calls
    (allocating after fork in a threaded parent could deadlock)."""

    def __init__(self, program: bytes):
        self._buf = ctypes.create_string_buffer(program, len(program))
        self._prog = _Fprog(len(program) // 8, ctypes.addressof(self._buf))
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl

    def __call__(self) -> None:
        if (
            self._prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
            or self._prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(self._prog), 0, 0) != 0
        ):
            raise OSError(ctypes.get_errno(), "cannot install the sandbox's seccomp filter")


@lru_cache(maxsize=1)
def installer() -> Installer | None:
    program = filter_program()
    return None if program is None else Installer(program)
