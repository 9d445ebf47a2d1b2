"""A sandboxed program's own network: bubblewrap's network namespace joined to the outside
by pasta (user-mode networking, Debian's `passt` package), so that it reaches the internet
and nothing on this machine.

pasta copies the host's address and routes into the namespace and carries its connections
out through the host's stack, with `--no-map-gw` (the gateway is not the host's loopback)
and no port forwarded either way (`-t none -u none -U none`) but the TCP ports of `-T`:
the endpoints the run itself names on this machine's loopback (an `OPENAI_BASE_URL` of
`http://127.0.0.1:8000/v1`). So a service on the host's 127.0.0.1 (a Dask scheduler, a
Prefect server, a database) is refused, and the host's primary address is the namespace's
own (nothing listens on it there).

pasta has no destination filter: a packet to any other address of this host (a docker
bridge's, a second interface's, a secondary address) would go out through the host's
stack and reach it. So before the command runs, every destination this host delivers to
itself (the local routes of its routing tables: the addresses of all interfaces, IPv4 and
IPv6, link-local ones, any wider local route), read then, is made local in the namespace
too (`guard`): a connection to it stays inside the namespace, where nothing listens. Local
routes and not `unreachable` ones: a socket bound to the interface (`SO_BINDTODEVICE`) goes
out on it when the lookup fails, while a local route on that interface matches. The
command has no capability to change them. While it runs, `AddressWatch` keeps them whole:
subscribed to the host's route changes before they are read, it makes each destination the
host gains later (an address added to it) local in the namespace as soon as the kernel
announces it; where it cannot, the sandbox is killed. Where pasta is missing, a workspace run refuses
unless `EVALPIPE_AGENT_NETWORK=host` lets its agent share the host's network
(docs/sandbox.md).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import ipaddress
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from urllib.parse import urlsplit

from tasks.errors import InputError
from tasks.sandbox.forkserver import die_with
from tasks.sandbox.limits import SandboxError
from tasks.settings import ENV, current

PASTA = "pasta"
NETWORK_ENV = ENV["agent_network"]  # "own" (the default) or "host": `MachineSettings.agent_network`
_LOOPBACK_NAMES = ("localhost", "::1")
_SETUP_TIMEOUT_S = 30.0
_LIBC = ctypes.CDLL(None, use_errno=True)

# rtnetlink(7): the constants of <linux/netlink.h> and <linux/rtnetlink.h> used here.
_RTM_NEWROUTE, _RTM_GETROUTE = 24, 26
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_DUMP, _NLM_F_EXCL, _NLM_F_CREATE = 0x1, 0x4, 0x300, 0x200, 0x400
_RTMGRP_IPV4_ROUTE, _RTMGRP_IPV6_ROUTE = 0x40, 0x400
_RTN_LOCAL, _RTN_ANYCAST = 2, 4
_RT_TABLE_LOCAL, _RTPROT_STATIC, _RT_SCOPE_HOST = 255, 4, 254
_RTA_DST, _RTA_OIF = 1, 4
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, protocol, scope, type, flags
_NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence, port
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_CAP_SYS_ADMIN = 21
_NS_GET_USERNS = 0xB701  # ioctl_ns(2): the user namespace owning a namespace


@dataclass(frozen=True)
class OwnNetwork:
    """A network namespace of its own: the outside, and of the host only TCP `ports` on
    its loopback (the run's named endpoints)."""

    ports: tuple[int, ...] = ()


def agent_network(env: Mapping[str, str]) -> OwnNetwork | bool:
    """What network a workspace agent gets: its own (reaching the loopback endpoints named
    in `env`, the user's variables passed to it: never evalpipe's own, which carry the
    case's id and paths), or True, the host's, where `EVALPIPE_AGENT_NETWORK=host`
    asks for it (the run's machine settings). `InputError` for its own without pasta."""
    if current().agent_network == "host":
        return True
    if shutil.which(PASTA) is None:
        raise InputError(
            f"the workspace agent's own network needs {PASTA} (Debian/Ubuntu package passt), which is not"
            f" installed: install it, or set {NETWORK_ENV}=host to let the agent share this machine's"
            " network (it can then reach every service on this machine, its loopback included)")
    return OwnNetwork(loopback_ports(env))


def loopback_ports(env: Mapping[str, str]) -> tuple[int, ...]:
    """The ports of the URLs in `env` that name this machine's loopback."""
    ports = set()
    for value in env.values():
        if "://" not in value:
            continue
        try:
            url = urlsplit(value)
            port = url.port or {"http": 80, "https": 443}.get(url.scheme)
        except ValueError:
            continue
        host = url.hostname or ""
        if port and (host.startswith("127.") or host in _LOOPBACK_NAMES):
            ports.add(port)
    return tuple(sorted(ports))


def connect(pid: int, network: OwnNetwork) -> Connection:
    """Join the network namespace of process `pid` (bubblewrap's sandbox, waiting on its
    block fd) to the outside, with this host's own addresses kept out of reach (`guard`,
    then `AddressWatch`); returns pasta and the watch, to be ended by `disconnect`."""
    net, user = _namespaces(pid)
    pasta = watch = None
    try:
        pasta = _start_pasta(net, user, network.ports)
        watch = AddressWatch(net, user, pid)  # subscribed before the routes are read: none is missed
        guard(net, user, host_destinations())
        return Connection(pasta, watch.start())
    except BaseException:
        if watch is not None:
            watch.close()
        if pasta is not None:
            _end(pasta)
        raise
    finally:
        os.close(net)
        os.close(user)


def _namespaces(pid: int) -> tuple[int, int]:
    """Descriptors of the network namespace of process `pid` and of the user namespace
    owning it: the one to join for it, which is not the process's own where bubblewrap
    nests a second user namespace (as a non-root user it does, while the sandbox starts)."""
    try:
        net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise SandboxError(f"cannot reach the sandbox's network namespace: {exc}") from None
    try:
        return net, fcntl.ioctl(net, _NS_GET_USERNS)
    except OSError as exc:
        os.close(net)
        raise SandboxError(f"cannot reach the sandbox's network namespace: {exc}") from None


def _start_pasta(net: int, user: int, ports: tuple[int, ...]) -> subprocess.Popen:
    """pasta, configuring the namespace `net` (owned by `user`) and then serving it; it
    runs in the foreground as our child, killed with this thread if the harness dies (it
    would outlive the namespace otherwise)."""
    forwarded = ",".join(map(str, ports)) or "none"
    with tempfile.TemporaryDirectory(prefix="evalpipe-pasta-") as scratch:
        pidfile, log = Path(scratch, "pid"), Path(scratch, "log")
        argv = [PASTA, "--foreground", "--quiet", "--config-net", "--no-map-gw", "-t", "none", "-u", "none",
                "-T", forwarded, "-U", "none", "--userns", f"/proc/self/fd/{user}", "--netns", f"/proc/self/fd/{net}",
                "--pid", str(pidfile)]
        if os.geteuid() == 0:  # pasta would switch to nobody, who cannot enter the namespace
            argv[1:1] = ["--runas", f"{os.getuid()}:{os.getgid()}"]
        with log.open("wb") as err:
            try:
                pasta = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                         pass_fds=(net, user),
                                         preexec_fn=partial(die_with, os.getpid()))  # noqa: PLW1509 - the one way
            except OSError as exc:
                raise SandboxError(f"{PASTA} could not set up the sandbox's network: {exc}") from None
        # It writes its pid once the namespace is configured, before it starts serving.
        deadline = time.monotonic() + _SETUP_TIMEOUT_S
        while not _read(pidfile) and pasta.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if not _read(pidfile):
            _end(pasta)
            reason = " ".join(_read(log).split())[-300:] or f"no answer within {_SETUP_TIMEOUT_S:g} s"
            raise SandboxError(f"{PASTA} could not set up the sandbox's network: {reason}")
    return pasta


@dataclass(frozen=True)
class Connection:
    """A sandbox's network, as `connect` made it: pasta, and the watch of the host's addresses."""

    pasta: subprocess.Popen
    watch: AddressWatch


def disconnect(connection: Connection) -> None:
    """End the watch and pasta; `SandboxError` when the watch failed meanwhile (the sandbox
    was killed then)."""
    connection.watch.close()
    _end(connection.pasta)
    if connection.watch.failure:
        raise SandboxError(connection.watch.failure)


def _end(pasta: subprocess.Popen) -> None:
    pasta.kill()
    pasta.wait()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


Destinations = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]


def host_destinations() -> Destinations:
    """Every destination this host delivers to itself, but its loopback's: the local and
    anycast routes of its routing tables (each address of each interface, and any wider
    local route), as they are now."""
    found = set()
    request = _RTMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0, 0, 0, 0, 0)
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as nl:
            answers = _exchange(nl, [(_RTM_GETROUTE, _NLM_F_REQUEST | _NLM_F_DUMP, request)])
    except OSError as exc:
        raise SandboxError(f"cannot read this host's addresses: {exc}") from None
    for kind, body in answers:
        if kind == _NLMSG_ERROR and (error := -struct.unpack_from("=i", body)[0]):
            raise SandboxError(f"cannot read this host's addresses: {os.strerror(error)}")
        if kind == _RTM_NEWROUTE and (net := _local_destination(body)):  # a dump's routes come as RTM_NEWROUTE
            found.add(net)
    return tuple(sorted(found, key=lambda n: (n.version, n)))


def _local_destination(route: bytes) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """The destination a route (an rtmsg and its attributes) makes local to the host, if it
    is a local or anycast route to one, and not its loopback's."""
    family, dst_len, *_, route_type, _ = _RTMSG.unpack_from(route)
    dst = _attributes(route[_RTMSG.size:]).get(_RTA_DST)  # none: a default route (a TPROXY table's), no address
    if route_type in (_RTN_LOCAL, _RTN_ANYCAST) and dst and family in (socket.AF_INET, socket.AF_INET6):
        net = ipaddress.ip_network((ipaddress.ip_address(dst), dst_len), strict=False)
        if not net.is_loopback:
            return net
    return None


class AddressWatch:
    """While a sandbox with its own network runs, each destination the host gains (an
    address added to an interface, a local route) is made local in its namespace `net`
    too, as `guard` did with those of its start: a thread reads the host's route
    announcements (rtnetlink's IPv4 and IPv6 route groups, subscribed before the start's
    routes are read) and adds each new one at once; if the kernel dropped announcements
    (its socket's buffer full), all of the host's destinations are read again. Where a
    route cannot be added, the sandbox (process `pid`, its first) is killed, and `failure`
    says why."""

    def __init__(self, net: int, user: int, pid: int):
        self.failure = ""
        self._sandbox = self._net = self._user = self._stop = self._stopping = -1
        self._thread = threading.Thread(target=self._watch, name="evalpipe-address-watch", daemon=True)
        self._socket = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        try:
            self._socket.bind((0, _RTMGRP_IPV4_ROUTE | _RTMGRP_IPV6_ROUTE))
            self._sandbox = os.pidfd_open(pid)
            self._net, self._user = os.dup(net), os.dup(user)
            self._stop, self._stopping = os.pipe()
        except OSError as exc:
            self.close()
            raise SandboxError(f"cannot watch this host's addresses: {exc}") from None

    def start(self) -> AddressWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.ident is not None:  # started: told to stop, and waited for
            os.write(self._stopping, b"x")
            self._thread.join()
        self._socket.close()
        for fd in (self._sandbox, self._net, self._user, self._stop, self._stopping):
            if fd >= 0:
                os.close(fd)

    def _watch(self) -> None:
        poll = select.poll()  # not select(): the harness may hold over FD_SETSIZE descriptors
        poll.register(self._socket, select.POLLIN)
        poll.register(self._stop, select.POLLIN)
        try:
            while self._stop not in (fd for fd, _ in poll.poll()):
                try:
                    data = self._socket.recv(1 << 16)
                    fresh = tuple({net for kind, body in _messages(data)
                                   if kind == _RTM_NEWROUTE and (net := _local_destination(body))})
                except OSError as exc:
                    if exc.errno != errno.ENOBUFS:
                        raise SandboxError(f"cannot watch this host's addresses: {exc}") from None
                    fresh = host_destinations()  # announcements were dropped: all of them again
                if fresh:
                    guard(self._net, self._user, fresh)
        except Exception as exc:  # noqa: BLE001 - whatever stops the watch, the sandbox must not run on unwatched
            self._fail(str(exc) if isinstance(exc, SandboxError) else f"the address watch failed: {exc!r}")

    def _fail(self, reason: str) -> None:
        self.failure = f"{reason} (while the sandbox ran: it was killed)"
        try:
            signal.pidfd_send_signal(self._sandbox, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it had ended


def guard(net: int, user: int, destinations: Destinations) -> None:
    """Make `destinations` local in the network namespace `net` (owned by the user
    namespace `user`), on its interface to pasta, so that nothing sent to them leaves it;
    `SandboxError` naming why when it cannot. Done from inside the namespace: by a thread
    of ours where we hold CAP_SYS_ADMIN (root), else by a forked child, which joins the
    owning user namespace first for its capabilities (only a single-threaded process may);
    a fork of a big harness costs tens of ms, a thread next to nothing."""
    try:
        if _is_admin():
            _in_thread(net, destinations)
        else:
            _in_child(net, user, destinations)
    except OSError as exc:
        raise SandboxError(f"cannot filter the sandbox's network: {exc}") from None


def _in_thread(net: int, destinations: Destinations) -> None:
    failed: list[OSError] = []

    def work() -> None:  # the namespace joined is this thread's alone, and it ends here
        try:
            _join(net, _CLONE_NEWNET)
            _add_local_routes(destinations)
        except OSError as exc:
            failed.append(exc)

    thread = threading.Thread(target=work, name="evalpipe-network-filter")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def _in_child(net: int, user: int, destinations: Destinations) -> None:
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - a forked child, reporting on its pipe
        status = 1
        try:
            os.close(read)
            if os.fstat(user).st_ino != os.stat("/proc/self/ns/user").st_ino:
                _alone()
                _join(user, _CLONE_NEWUSER)
            _join(net, _CLONE_NEWNET)
            _add_local_routes(destinations)
            status = 0
        except BaseException as exc:  # noqa: BLE001 - whatever it is, the parent says it
            os.write(write, str(exc).encode(errors="replace")[:300])
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        reason = pipe.read().decode(errors="replace")
    _, status = os.waitpid(child, 0)
    if status != 0:
        raise OSError(reason or f"the child's wait status {status}")


def _alone(timeout_s: float = 2.0) -> None:
    """Wait until this forked child is its only thread: a user namespace takes no multithreaded
    caller (EINVAL), and a library's fork handler may start threads in every child (OpenTelemetry's
    tracer provider refreshes its resource on worker threads: in-process capture installs one)."""
    deadline = time.monotonic() + timeout_s
    while len(os.listdir("/proc/self/task")) > 1:
        if time.monotonic() > deadline:
            raise OSError("threads a fork handler started in the child did not end: it cannot join the"
                          " sandbox's user namespace")
        time.sleep(0.001)


def _join(fd: int, kind: int) -> None:
    if _LIBC.setns(fd, kind) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns: {os.strerror(error)}")


@lru_cache(maxsize=1)
def _is_admin() -> bool:
    """Whether this process holds CAP_SYS_ADMIN, with which a thread may join a network
    namespace without its user namespace."""
    status = Path("/proc/self/status").read_text()
    effective = next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:"))
    return bool(int(effective, 16) >> _CAP_SYS_ADMIN & 1)


def _add_local_routes(destinations: Destinations) -> None:
    """In this process's network namespace: a local route to each destination through its
    one interface other than the loopback (pasta's)."""
    if not destinations:
        return
    links = [index for index, name in socket.if_nameindex() if name != "lo"]
    if len(links) != 1:
        raise OSError(f"expected one interface beside the loopback, found {len(links)}")
    requests = []
    for net in destinations:
        family = socket.AF_INET if net.version == 4 else socket.AF_INET6
        body = _RTMSG.pack(family, net.prefixlen, 0, 0, _RT_TABLE_LOCAL, _RTPROT_STATIC, _RT_SCOPE_HOST,
                           _RTN_LOCAL, 0)
        body += _attribute(_RTA_DST, net.network_address.packed) + _attribute(_RTA_OIF, struct.pack("=i", links[0]))
        requests.append((_RTM_NEWROUTE, _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_CREATE | _NLM_F_EXCL, body))
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as nl:
        for (_, body), net in zip(_exchange(nl, requests), destinations, strict=True):  # acknowledgements
            error = -struct.unpack_from("=i", body)[0]
            if error not in (0, errno.EEXIST):  # EEXIST: the namespace's own address already
                raise OSError(error, f"a local route to {net}: {os.strerror(error)}")


def _exchange(nl: socket.socket, requests: list[tuple[int, int, bytes]]) -> list[tuple[int, bytes]]:
    """Send netlink `requests` (type, flags, body); the (type, body) of every message
    answering them, up to each one's last: its acknowledgement (NLMSG_ERROR, 0 for
    success), or a dump's messages and NLMSG_DONE (or an NLMSG_ERROR)."""
    nl.sendall(b"".join(_NLMSGHDR.pack(_NLMSGHDR.size + len(body), kind, flags, seq, 0) + body
                        for seq, (kind, flags, body) in enumerate(requests, 1)))
    answers, pending = [], len(requests)
    while pending:
        for kind, body in _messages(nl.recv(1 << 16)):
            if kind != _NLMSG_DONE:
                answers.append((kind, body))
            if kind in (_NLMSG_DONE, _NLMSG_ERROR):
                pending -= 1
    return answers


def _messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    """The (type, body) of each netlink message in `data`."""
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size:
            return
        yield kind, data[offset + _NLMSGHDR.size:offset + length]
        offset += (length + 3) & ~3


def _attribute(kind: int, value: bytes) -> bytes:
    length = 4 + len(value)
    return struct.pack("=HH", length, kind) + value + bytes(-length % 4)


def _attributes(data: bytes) -> dict[int, bytes]:
    found, offset = {}, 0
    while offset + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, offset)
        if length < 4:
            break
        found[kind] = data[offset + 4:offset + length]
        offset += (length + 3) & ~3
    return found
