"""A warm fork server that runs Python programs one at a time, each in a forked child.

Started by `tasks.sandbox.ForkServer`, normally inside bubblewrap (its own pid, mount,
network and user namespaces, read-only `/`, a private `/tmp`). Starting a fresh
interpreter per program costs 20-70 ms; forking this warm one costs 1-2 ms, and the
child gets the same limits a fresh process would: its own session and process group,
rlimits, a fresh working directory, a scrubbed environment, captured output with a cap.

After each program the server kills everything that program left behind (`setsid`
escapees included: the server is a child subreaper, so orphans come back to it, and in
its own pid namespace `kill(-1)` reaches every process but itself and init), and, in the
namespace, wipes its private `/tmp` and `/dev/shm` except the runtime bound in there.

The program proves it ran to the end by copying a per-run nonce from fd 4 to fd 3 after
the last statement returned; stdout cannot forge that.

A split program (`split` in the request: the candidate's code, and the oracle's tests)
runs in two processes: the forked child is the oracle (the tests, `check`, the nonce) and
forks the candidate, which closes the nonce's fds before any of its code runs. The oracle
calls the candidate's functions across a pipe that carries plain values only (numbers,
strings, bytes, None, lists, tuples, dicts, sets), decoded by the oracle into objects of
its own: no candidate object (an `__eq__` that is always true), patched `builtins` or
written nonce can reach the check. Both are not dumpable, so neither can read the other's
memory or fds.

Standard library only: it runs as a script (`python -I forkserver.py`) and `capture` is
also imported by `tasks.sandbox`. Protocol on fds 0/1: frames of an 8-byte big-endian
length and a JSON object (bytes as base64).
"""

from __future__ import annotations

import base64
import ctypes
import functools
import json
import math
import os
import re
import resource
import selectors
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping

NONCE_FD = 4  # the child reads the nonce here after the program returned ...
RESULT_FD = 3  # ... and writes it back here
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
# Looked up on import: a child forked from a process with threads must not take the dynamic
# loader's lock, which another thread may have held at the fork.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl
# Imported once in the server so that forked programs find them warm.
_PRELOAD = (
    "math", "re", "collections", "itertools", "functools", "typing", "string", "hashlib",
    "heapq", "bisect", "random", "statistics", "fractions", "decimal", "json", "copy",
    "operator", "datetime", "traceback",
    "ast",  # inspect and dataclasses import it: ~2 ms a program that imports either
)  # fmt: skip


def capture(
    streams: Mapping[str, tuple[int, int]],
    deadline: float,
    exited_fd: int,
    on_exit: Callable[[], None],
) -> tuple[dict[str, bytes], dict[str, bool], bool]:
    """Read each `name: (fd, cap)` until EOF, keeping the first `cap` bytes of each.

    `exited_fd` (a pidfd) becomes readable when the main process exits; `on_exit` is then
    called once to kill what it left behind, which closes any pipe a leftover still
    holds. Returns (data, truncated, timed_out); on timeout the caller kills and reaps.
    """
    data = {name: bytearray() for name in streams}
    truncated = dict.fromkeys(streams, False)
    sel = selectors.DefaultSelector()
    for name, (fd, _cap) in streams.items():
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ, name)
    sel.register(exited_fd, selectors.EVENT_READ, None)
    timed_out = False
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left):
                if key.data is None:
                    sel.unregister(exited_fd)
                    on_exit()
                    continue
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf, cap = data[key.data], streams[key.data][1]
                room = cap - len(buf)
                if room > 0:
                    buf += chunk[:room]
                if len(chunk) > room:
                    truncated[key.data] = True
    finally:
        sel.close()
    return {k: bytes(v) for k, v in data.items()}, truncated, timed_out


def _prctl(option: int, value: int) -> None:
    _PRCTL(option, value, 0, 0, 0)


def die_with(parent: int) -> None:
    """In a child, between its fork and its exec: killed when the thread that forked it
    ends, and gone at once if process `parent` already has (a SIGKILL to it can land
    before this runs; bubblewrap's own --die-with-parent only takes hold after its exec)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _children() -> list[int]:
    me = str(os.getpid())
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    stat = fh.read().decode(errors="replace")
            except OSError:
                continue
            if stat.rsplit(")", 1)[-1].split()[1] == me:
                kids.append(int(entry))
    return kids


def _reap_all() -> None:
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def kill_leftovers(pidns: bool) -> None:
    """Kill and reap every process the last program left, however it detached itself."""
    if pidns:
        # In our own pid namespace kill(-1) reaches all but us and init; ESRCH = none left.
        while True:
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                return
            _reap_all()
    # Without a pid namespace: as subreaper, every descendant is or becomes our child.
    while kids := _children():
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap_all()
    _reap_all()


def set_limits(memory_mb: int, cpu_s: float | None, file_size_mb: int) -> None:
    """Hard rlimits for the calling process: address space, CPU seconds (unless None),
    file size, no core."""
    mb = 1 << 20
    limits = [
        (resource.RLIMIT_AS, memory_mb * mb),
        (resource.RLIMIT_FSIZE, file_size_mb * mb),
        (resource.RLIMIT_CORE, 0),
    ]
    if cpu_s is not None:
        limits.append((resource.RLIMIT_CPU, max(1, math.ceil(cpu_s))))
    for which, value in limits:
        resource.setrlimit(which, (value, value))


def std_streams() -> tuple:
    """sys.stdin, stdout and stderr for the programs: on fds 0-2, whatever those are in the
    child that uses them. Made once in the server and inherited unused (a fork copies them
    with empty buffers), not made again in every child: that costs a program ~0.3 ms."""
    return (open(0, encoding="utf-8", closefd=False),  # noqa: SIM115
            open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False),  # noqa: SIM115
            open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False))  # noqa: SIM115


def program_environment(env: Mapping[str, str]) -> None:
    """This process's environment made `env`, if it is not already: in the server before
    it forks, so that a child inherits it instead of rebuilding it (the same for every
    program of a run)."""
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)


def _child(req: Mapping, workdir: str, fds: Mapping[int, int], streams: tuple) -> None:
    """Runs in the forked child; never returns."""
    code = 1
    try:
        os.setsid()
        for target, fd in fds.items():
            os.dup2(fd, target)
        os.closerange(NONCE_FD + 1, os.sysconf("SC_OPEN_MAX"))
        os.chdir(workdir)
        sys.stdin, sys.stdout, sys.stderr = streams  # and the environment: the server's
        import random

        random.seed()
        set_limits(req["memory_mb"], req["cpu_s"], req["file_size_mb"])
        if req.get("split"):
            _run_oracle(req["split"])
        else:
            program = compile(req["program"], "<program>", "exec")
            exec(program, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102
        os.write(RESULT_FD, os.read(NONCE_FD, 256))
        code = 0
    except BaseException as exc:  # the program's own failure, reported on its stderr
        try:
            import traceback

            # The last frames only: a 10^6-deep recursion would take seconds to print.
            traceback.print_exception(type(exc), exc, exc.__traceback__, limit=-8)
        except BaseException:  # noqa: S110 - nothing left to report with
            pass
    _exit_flushed(code)


# --- a split program: the oracle and the candidate in two processes -------------------------

_MAX_DEPTH = 200


def encode_plain(value: object, depth: int = 0) -> object:
    """`value` as JSON data, if it is made of plain values only (subclasses of them are
    taken as their base type); `TypeError` otherwise."""
    if depth > _MAX_DEPTH:
        raise TypeError("a value nested too deeply to pass between the tests and the candidate")
    if value is None or isinstance(value, bool):
        return value
    for base in (int, float, str):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, bytes):
        return {"b": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, complex):
        return {"c": [value.real, value.imag]}
    if isinstance(value, list):
        return [encode_plain(v, depth + 1) for v in list(value)]
    if isinstance(value, dict):
        return {"d": [[encode_plain(k, depth + 1), encode_plain(v, depth + 1)] for k, v in dict(value).items()]}
    for tag, base in (("t", tuple), ("s", set), ("f", frozenset)):
        if isinstance(value, base):
            return {tag: [encode_plain(v, depth + 1) for v in base(value)]}
    raise TypeError(f"{type(value).__name__} is not a plain value (numbers, strings, bytes, None, "
                    "lists, tuples, dicts, sets)")


def decode_plain(doc: object) -> object:
    """The value `encode_plain` made, built of this process's own plain objects."""
    if isinstance(doc, list):
        return [decode_plain(v) for v in doc]
    if not isinstance(doc, dict):
        return doc  # JSON scalars are plain already
    (tag, body), = doc.items()
    if tag == "b":
        return base64.b64decode(body)
    if tag == "c":
        return complex(float(body[0]), float(body[1]))
    if tag == "d":
        return {decode_plain(k): decode_plain(v) for k, v in body}
    return {"t": tuple, "s": set, "f": frozenset}[tag](decode_plain(v) for v in body)


_ENDS_ITERATION = (StopIteration, StopAsyncIteration)


def _raised(kind: str, message: str) -> BaseException:
    """The candidate's exception as the oracle raises it: a built-in exception of the same
    name (tests may expect a `ValueError`), else a RuntimeError naming it. The ones the
    interpreter itself catches to end a loop (`StopIteration` ends the `map` or generator that
    called the candidate, so `all(...)` over it is true) become RuntimeError, as PEP 479 does
    for generators."""
    import builtins

    cls = getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, _ENDS_ITERATION):
        try:
            return cls(message)
        except Exception:  # noqa: S110 - an exception class with other arguments
            pass
    return RuntimeError(f"{kind}: {message}")


def _run_oracle(split: Mapping) -> None:
    """Runs in the program's process: fork the candidate, then run the tests with its
    functions as proxies. Returns when the tests passed; raises otherwise."""
    calls_r, calls_w = os.pipe()
    replies_r, replies_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        for fd in (calls_w, replies_r, RESULT_FD, NONCE_FD):
            os.close(fd)
        _serve_candidate(split["candidate"], calls_r, replies_w)
    os.close(calls_r)
    os.close(replies_w)

    def proxy(name: str) -> Callable:
        def call(*args: object, **kwargs: object) -> object:
            write_frame(calls_w, {"call": name, "args": encode_plain(list(args)),
                                  "kwargs": encode_plain(dict(kwargs))})
            reply = read_frame(replies_r)
            if reply is None:  # its code did not load (the error is above), or it exited
                raise RuntimeError(f"the candidate's process ended before {name}() returned")
            if "raise" in reply:
                raise _raised(str(reply["raise"][0]), str(reply["raise"][1]))
            return decode_plain(reply["value"])

        call.__name__ = call.__qualname__ = name
        return call

    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:  # what the prompt defines (HumanEval/38's encode_cyclic) is the oracle's own
        prelude = compile(split["prelude"], "<prompt>", "exec")
    except SyntaxError:  # a prompt that is not code on its own
        prelude = None
    if prelude is not None:
        exec(prelude, namespace)  # noqa: S102 - the suite's own text, as trusted as its tests
    tests = compile(split["oracle"], "<tests>", "exec")  # while the candidate's code loads
    for name in _candidate_names(read_frame(replies_r), split["entry_point"]):
        if name == split["entry_point"] or name not in namespace:
            namespace[name] = proxy(name)
    exec(tests, namespace)  # noqa: S102


def _candidate_names(first: object, entry_point: str) -> set[str]:
    """The names to proxy, from the first frame the candidate's process sends once its code
    has loaded (its globals; None if it did not load): the entry point, and any other
    identifier but a builtin's. In one process the candidate's `def range` would be the
    tests' `range` too (a forged pass); here the tests keep the oracle's builtins."""
    import builtins

    names = {entry_point}
    listed = first.get("names") if isinstance(first, dict) else None
    if isinstance(listed, list):
        names.update(n for n in listed if isinstance(n, str) and n.isidentifier() and not n.startswith("__")
                     and not hasattr(builtins, n))
    return names


def _serve_candidate(source: str, calls: int, replies: int) -> None:
    """Runs in the candidate's process; never returns. Loads the candidate's code, then
    answers calls until the oracle is done (or exits, its error on stderr, if it does
    not load)."""
    code = 1
    try:
        namespace = {"__name__": "__main__", "__builtins__": __builtins__}
        try:
            exec(compile(source, "<program>", "exec"), namespace)  # noqa: S102
        except BaseException as exc:
            import traceback

            traceback.print_exception(type(exc), exc, exc.__traceback__, limit=-8)
            raise
        # Its names, for the oracle to proxy (`_candidate_names`).
        write_frame(replies, {"names": [name for name in namespace if isinstance(name, str)]})
        while (request := read_frame(calls)) is not None:
            try:
                value = namespace[request["call"]](*decode_plain(request["args"]), **decode_plain(request["kwargs"]))
                reply = {"value": encode_plain(value)}
            except BaseException as exc:  # the candidate's failure is the call's, not ours
                reply = {"raise": [type(exc).__name__, _message(exc)]}
            write_frame(replies, reply)
        code = 0
    except BaseException:  # noqa: S110 - reported above, or the oracle is gone
        pass
    _exit_flushed(code)


def _message(exc: BaseException) -> str:
    try:
        return str(exc)[:1000]
    except BaseException:
        return "(unprintable)"


def _exit_flushed(code: int) -> None:
    """Flush what the program printed and end its process, skipping interpreter teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: S110 - the program may have closed its own output
            pass
    os._exit(code)


def run_one(req: Mapping, pidns: bool, streams: tuple) -> dict:
    # In the private /tmp of the namespace; outside bubblewrap, the machine's /tmp.
    workdir = tempfile.mkdtemp(prefix="run-", dir="/tmp")
    program_environment(req["env"])
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    res_r, res_w = os.pipe()
    non_r, non_w = os.pipe()
    os.write(non_w, req["nonce"].encode())
    os.close(non_w)
    null = os.open(os.devnull, os.O_RDONLY)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(req, workdir, {0: null, 1: out_w, 2: err_w, RESULT_FD: res_w, NONCE_FD: non_r}, streams)
    for fd in (out_w, err_w, res_w, non_r, null):
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    status: int | None = None

    def on_exit() -> None:
        nonlocal status
        status = os.waitpid(pid, 0)[1]
        kill_leftovers(pidns)

    cap = req["output_cap_bytes"]
    try:
        data, truncated, timed_out = capture(
            {"stdout": (out_r, cap), "stderr": (err_r, cap), "result": (res_r, 256)},
            start + req["timeout_s"],
            pidfd,
            on_exit,
        )
    finally:
        if status is None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            status = os.waitpid(pid, 0)[1]
        kill_leftovers(pidns)
        for fd in (out_r, err_r, res_r, pidfd):
            os.close(fd)
        if pidns:
            wipe_private_dirs()
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    duration = time.monotonic() - start
    returncode = None if timed_out else os.waitstatus_to_exitcode(status)
    return {
        "returncode": returncode,
        "timed_out": timed_out,
        "duration_s": duration,
        "stdout": base64.b64encode(data["stdout"]).decode(),
        "stderr": base64.b64encode(data["stderr"]).decode(),
        "stdout_truncated": truncated["stdout"],
        "stderr_truncated": truncated["stderr"],
        "result": data["result"].decode(errors="replace"),
    }


# The namespace's writable places (HOME and the work dirs are under /tmp; `/dev` itself is
# read-only); SysV IPC, POSIX queues and keyrings are refused by the seccomp filter.
_PRIVATE_DIRS = ("/tmp", "/dev/shm")


@functools.cache
def _bound_in() -> frozenset[str]:
    """Mount points under the private dirs: runtime dirs bound in read-only (a clone or
    venv under /tmp). The wipe must not walk them: it would visit every file of a venv
    to fail on each, 150-250 ms per program. Programs cannot mount, so this is fixed."""
    found = set()
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4])
            if any(point.startswith(f"{root}/") for root in _PRIVATE_DIRS):
                found.add(point)
    return frozenset(found)


def wipe_private_dirs() -> None:
    """Remove everything a program left in the namespace's private dirs, whatever modes it
    set, so that nothing one program wrote is seen by the next."""
    kept = _bound_in()
    ancestors = {os.path.dirname(p) for p in kept}
    for path in list(ancestors):
        while (path := os.path.dirname(path)) not in ("/", ""):
            ancestors.add(path)
    for root in _PRIVATE_DIRS:
        if os.path.isdir(root):
            _wipe_dir(root, kept, ancestors)


def _wipe_dir(path: str, kept: frozenset[str], ancestors: set[str]) -> None:
    try:
        os.chmod(path, 0o1777 if path in _PRIVATE_DIRS else 0o700)  # a program may chmod 0
        entries = list(os.scandir(path))
    except OSError:
        return
    for entry in entries:
        if entry.path in kept:
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                _wipe_dir(entry.path, kept, ancestors)
                if entry.path not in ancestors:
                    os.rmdir(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass


def read_frame(fd: int) -> dict | None:
    head = _read_exact(fd, 8)
    if head is None:
        return None
    body = _read_exact(fd, int.from_bytes(head, "big"))
    return None if body is None else json.loads(body)


def write_frame(fd: int, obj: Mapping) -> None:
    body = json.dumps(obj).encode()
    view = memoryview(len(body).to_bytes(8, "big") + body)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def become_server() -> tuple[int, int]:
    """Common start of a sandboxed server: returns the protocol's (read, write) fds."""
    # Keep the protocol off fds 0/1 so nothing a child inherits can reach it.
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    # Not dumpable: a program running as the same uid cannot open /proc/<server>/fd or mem.
    _prctl(_PR_SET_DUMPABLE, 0)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    return rfd, wfd


def serve(pidns: bool) -> None:
    rfd, wfd = become_server()
    for name in _PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    streams = std_streams()
    write_frame(wfd, {"ready": True, "pid": os.getpid()})
    while (req := read_frame(rfd)) is not None:
        try:
            reply = run_one(req, pidns, streams)
        except Exception as exc:  # the server's own failure: reported, and it keeps serving
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        write_frame(wfd, reply)


if __name__ == "__main__":
    # --pidns is passed only under bubblewrap, and re-checked: kill(-1) outside a pid
    # namespace of our own would hit every process of this user.
    serve(pidns="--pidns" in sys.argv[1:] and os.getppid() == 1)
