"""Issue 33, item 1: a workspace (coding) agent's network. Its sandbox shared the host's
network, so the agent reached the run's own Dask scheduler on 127.0.0.1 and had a worker
run its code; any service on the host's loopback was reachable the same way. Now it has a
network namespace of its own, joined to the outside by pasta: the host's loopback is
refused (TCP and UDP), the endpoint the run names there still answers, and without pasta
the run says so and needs EVALPIPE_AGENT_NETWORK=host."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_workspaces import bwrap, calc_case, draw, script_agent  # noqa: F401 - bwrap: a fixture

from tasks.agents import AgentSettings, load_agent
from tasks.models import InputError, Status
from tasks.sandbox import SandboxError, network

pytestmark = pytest.mark.skipif(shutil.which("pasta") is None, reason="pasta (Debian package passt) is not installed")

PROBE = '''
import socket, sys
for what, port, kind in (("secret-tcp", {secret}, socket.SOCK_STREAM), ("named", {named}, socket.SOCK_STREAM),
                         ("secret-udp", {udp}, socket.SOCK_DGRAM)):
    try:
        s = socket.socket(socket.AF_INET, kind)
        s.settimeout(3)
        s.connect(("127.0.0.1", port))
        if kind == socket.SOCK_DGRAM:
            s.send(b"ping")
        print(what, s.recv(5).decode())
    except OSError as exc:
        print(what, "unreachable", type(exc).__name__)
'''


class Servers:
    """A TCP service and a UDP one on the host's 127.0.0.1 that answer "hello", and the
    endpoint the run names (TCP, also on the loopback)."""

    def __init__(self) -> None:
        self.sockets = []
        self.secret, self.named = self._tcp(), self._tcp()
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 0))
        self.sockets.append(udp)
        self.udp = udp.getsockname()[1]
        threading.Thread(target=self._echo_udp, args=(udp,), daemon=True).start()

    def _tcp(self) -> int:
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen()
        self.sockets.append(server)
        threading.Thread(target=self._answer, args=(server,), daemon=True).start()
        return server.getsockname()[1]

    @staticmethod
    def _answer(server: socket.socket) -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"hello")
            conn.close()

    @staticmethod
    def _echo_udp(udp: socket.socket) -> None:
        while True:
            try:
                _, peer = udp.recvfrom(16)
            except OSError:
                return
            udp.sendto(b"hello", peer)

    def close(self) -> None:
        for s in self.sockets:
            s.close()


@pytest.fixture
def servers():
    s = Servers()
    yield s
    s.close()


@pytest.mark.usefixtures("bwrap")
def test_the_host_loopback_is_out_of_reach_and_the_named_endpoint_is_not(home, calc_repo, tmp_path, monkeypatch,
                                                                         servers):
    repo, _ = calc_repo
    probe = tmp_path / "agents" / "probe.py"  # beside the agent's script: shown to it
    probe.parent.mkdir()
    probe.write_text(PROBE.format(secret=servers.secret, named=servers.named, udp=servers.udp))
    monkeypatch.setenv("ANTHROPIC_BASE_URL", f"http://127.0.0.1:{servers.named}/v1")  # OPENAI_*: the gateway's
    monkeypatch.delenv("EVALPIPE_AGENT_NETWORK", raising=False)
    sample = draw(script_agent(tmp_path, f'"{sys.executable}" "{probe}"\n'), calc_case(repo))
    lines = sample.trace.agent_run.stdout_tail.splitlines()
    assert lines, (sample.verdict.detail, sample.trace.agent_run)
    assert lines[0].startswith("secret-tcp unreachable"), lines
    assert lines[1] == "named hello", lines
    assert lines[2].startswith("secret-udp unreachable"), lines
    # The host's network, asked for by name: the same agent reaches the secret service.
    monkeypatch.setenv("EVALPIPE_AGENT_NETWORK", "host")
    shared = draw(script_agent(tmp_path, f'"{sys.executable}" "{probe}"\n'), calc_case(repo))
    assert shared.trace.agent_run.stdout_tail.splitlines()[0] == "secret-tcp hello"


@pytest.mark.usefixtures("bwrap")
def test_a_url_in_the_case_opens_no_host_port(home, calc_repo, tmp_path, monkeypatch, servers):
    """(#45 item 2) evalpipe put the case id in the agent's environment, then forwarded every
    loopback URL found there: an id `http://127.0.0.1:PORT/` opened that port of the host.
    Such an id is now refused at load; one that reaches the agent all the same (built past
    the check, as here) still opens nothing: only the user's variables name endpoints."""
    repo, _ = calc_repo
    probe = tmp_path / "agents" / "probe.py"
    probe.parent.mkdir()
    probe.write_text(PROBE.format(secret=servers.secret, named=servers.named, udp=servers.udp))
    monkeypatch.setenv("ANTHROPIC_BASE_URL", f"http://127.0.0.1:{servers.named}/v1")  # OPENAI_*: the gateway's
    monkeypatch.delenv("EVALPIPE_AGENT_NETWORK", raising=False)
    hostile = calc_case(repo).model_copy(update={"id": f"http://127.0.0.1:{servers.secret}/"})
    with pytest.raises(ValueError, match="://"):
        type(hostile).model_validate(hostile.model_dump())
    sample = draw(script_agent(tmp_path, f'"{sys.executable}" "{probe}"\n'), hostile)
    lines = sample.trace.agent_run.stdout_tail.splitlines()
    assert lines, (sample.verdict.detail, sample.trace.agent_run)
    assert lines[0].startswith("secret-tcp unreachable"), lines
    assert lines[1] == "named hello", lines


@pytest.mark.usefixtures("bwrap")
def test_without_pasta_a_workspace_run_needs_the_flag(home, tmp_path, monkeypatch):
    script = tmp_path / "agent.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("sh", "git", "bwrap"):  # what a workspace agent needs, without pasta
        (bare / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(bare))
    monkeypatch.delenv("EVALPIPE_AGENT_NETWORK", raising=False)
    with pytest.raises(InputError, match="passt.*EVALPIPE_AGENT_NETWORK=host"):
        load_agent(f"cmd:{script}", 60.0)
    monkeypatch.setenv("EVALPIPE_AGENT_NETWORK", "host")
    assert load_agent(f"cmd:{script}", 60.0) is not None
    monkeypatch.setenv("EVALPIPE_AGENT_NETWORK", "sometimes")
    with pytest.raises(InputError, match="own or host"):
        load_agent(f"cmd:{script}", 60.0)


@pytest.mark.usefixtures("bwrap")
def test_the_agent_sees_only_its_checkout_scratch_code_and_runtimes(home, calc_repo, tmp_path, monkeypatch):
    """Issue 33, item 3: the agent's sandbox showed the whole working directory: a
    project's `.evalpipe/` (the database, snapshots with references) when EVALPIPE_HOME
    points elsewhere, and gold patches in files beside the suite."""
    repo, _ = calc_repo
    project = tmp_path / "project"
    (project / ".evalpipe").mkdir(parents=True)
    (project / ".evalpipe" / "evalpipe.duckdb").write_text("the project's database\n")
    (project / "notes.txt").write_text("the working directory\n")
    suites = project / "evals"
    suites.mkdir()
    (suites / "suite.yaml").write_text("reference: gold\n")
    (suites / "gold.patch").write_text("the gold patch\n")
    agents = project / "agents"
    agents.mkdir()
    (agents / "helper.txt").write_text("beside the agent\n")
    body = f"""#!/bin/sh
for p in "{project}/.evalpipe/evalpipe.duckdb" "{project}/notes.txt" "{suites}/gold.patch" "{suites}/suite.yaml"; do
  if grep . "$p" 2>/dev/null; then echo "READ $p"; fi
done
grep -q . "{agents}/helper.txt" 2>/dev/null && echo "its own folder is shown"
echo "LS: $(ls -a "{project}" 2>&1 | tr '\\n' ' ')"
echo "SUITES: $(ls -a "{suites}" 2>&1 | tr '\\n' ' ')"
echo "ran $0"
"""
    monkeypatch.chdir(project)
    # An agent in a folder of its own (shown), and one in the working directory (itself alone).
    for script, own_folder in ((agents / "agent.sh", True), (project / "agent.sh", False)):
        script.write_text(body)
        script.chmod(0o755)
        agent = load_agent(f"cmd:./{script.relative_to(project)}", 60.0).concealing([suites / "suite.yaml"])
        sample = draw(agent, calc_case(repo))
        out = sample.trace.agent_run.stdout_tail
        assert f"ran {script}" in out, (sample.verdict.detail, sample.trace.agent_run)
        assert "READ" not in out, out
        assert ("its own folder is shown" in out) is own_folder, out
        listing = out.split("LS: ", 1)[1].split("\n", 1)[0]
        assert ".evalpipe" not in listing and "notes.txt" not in listing, listing
        # The suite's folder is empty but for the suite file, shown empty.
        assert out.split("SUITES: ", 1)[1].split("\n", 1)[0].split() == [".", "..", "suite.yaml"], out


@pytest.mark.usefixtures("bwrap")
@pytest.mark.parametrize(("setting", "value", "reason"), [
    ("workspace_tree_mb", 1, "over the 1,048,576-byte cap (--workspace-tree-mb)"),
    ("workspace_change_bytes", 100000, "the change is over the 100,000-byte cap (--workspace-change-bytes)"),
])
def test_a_tree_or_change_over_its_cap_is_an_agent_error_with_the_reason(home, calc_repo, tmp_path,
                                                                        setting, value, reason):
    """Issue 33, item 7: the change was built in memory and the tree had no total cap."""
    repo, _ = calc_repo
    body = f'"{sys.executable}" -c "open(\'big.txt\', \'w\').write(\'line\\\\n\' * 400_000)"\n'
    sample = draw(script_agent(tmp_path, body, settings=AgentSettings(**{setting: value})), calc_case(repo))
    assert sample.verdict.status is Status.agent_error and reason in sample.verdict.detail, sample.verdict.detail
    assert sample.output == ""


@pytest.mark.usefixtures("bwrap")
def test_a_300_mb_change_is_read_no_further_than_its_cap(home, calc_repo, tmp_path):
    """The red team's file: 300 MB took the harness from 0.3 to 1.0 GB resident. Drawn in a
    process of its own, whose peak resident size is read: the change is streamed and cut
    at its cap (4 MB), never held whole."""
    repo, _ = calc_repo
    script = tmp_path / "agent.sh"
    # Written 3 MB at a time: the agent holding all 300 MB at once cost it 1.7 s of CPU more.
    script.write_text(f'#!/bin/sh\n"{sys.executable}" -c "open(\'big.txt\', \'w\')'
                      f'.writelines([(\'x\' * 99 + \'\\\\n\') * 30_000] * 100)"\n')
    script.chmod(0o755)
    code = f"""
import resource, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_workspaces import calc_case, draw
from tasks.agents import load_agent
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sample = draw(load_agent("cmd:{script}", 600.0), calc_case(__import__("pathlib").Path({str(repo)!r})))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(sample.verdict.status.value, (after - before) // 1024, sample.verdict.detail)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    status, grown_mb, detail = proc.stdout.strip().split(" ", 2)
    assert status == "agent_error" and "the change is over the 4,194,304-byte cap" in detail, proc.stdout
    assert int(grown_mb) < 100, proc.stdout  # the file is 300 MB; the patch would be more


FILLER = '''
import os, sys
target = os.path.join(os.environ[sys.argv[1]], "fill")
os.makedirs(target, exist_ok=True)
block = b"x" * (1 << 20)
n = 0
while True:  # until it is stopped: 1 MB files, and as many empty ones
    with open(os.path.join(target, f"{n}.bin"), "wb") as fh:
        fh.write(block)
    open(os.path.join(target, f"{n}.empty"), "w").close()
    n += 1
'''


@pytest.mark.usefixtures("bwrap")
@pytest.mark.parametrize("where", ["EVALPIPE_WORKSPACE", "HOME"])
def test_an_agent_filling_the_disk_is_stopped_at_the_tree_cap_while_it_runs(home, calc_repo, tmp_path, where):
    """Issue 33, item 7: the tree's total was counted only after the agent exited, so while
    it ran only the 1 GB per file held, and an agent writing many files could fill the
    disk. Now the workspace and its scratch directory (HOME, its git directory) are
    measured as it runs: an agent writing without end, in either, is stopped at the cap
    (not at its timeout, nor by the disk), the sample one line naming the cap and the option."""
    repo, _ = calc_repo
    filler = tmp_path / "agents" / "filler.py"
    filler.parent.mkdir()
    filler.write_text(FILLER)
    agent = script_agent(tmp_path, f'"{sys.executable}" "{filler}" {where}\n', timeout=300.0,
                         settings=AgentSettings(workspace_tree_mb=8))
    sample = draw(agent, calc_case(repo))
    detail = sample.verdict.detail
    assert sample.verdict.status is Status.agent_error, (detail, sample.trace.agent_run)
    assert detail.startswith("agent failed: stopped: the workspace and its scratch directory held "), detail
    assert detail.endswith(" bytes, over the 8,388,608-byte cap (--workspace-tree-mb)"), detail
    assert "\n" not in detail and sample.output == ""
    assert sample.trace.agent_run.returncode == -9, sample.trace.agent_run  # killed, whole
    assert not list((home / "workspaces").iterdir())  # its scratch removed with the sample


WILDCARD_PROBE = '''
import socket
for what, host in (("loopback", "127.0.0.1"), ("host-address", {address!r})):
    try:
        s = socket.create_connection((host, {port}), timeout=3)
        print(what, s.recv(5).decode())
    except OSError as exc:
        print(what, "unreachable", type(exc).__name__)
'''


HIDER = '''
import os, sys, time
held = []
for n in range(8):  # 40 MB each, every one deleted while it is still open
    path = os.path.join(os.environ["EVALPIPE_WORKSPACE"], f"hidden{n}")
    fh = open(path, "wb")
    os.unlink(path)
    for _ in range(40):
        fh.write(b"x" * (1 << 20))
        fh.flush()
    held.append(fh)
time.sleep(2)  # holding 320 MB that no directory shows
'''


@pytest.mark.usefixtures("bwrap")
def test_files_deleted_while_open_count_against_the_tree_cap(home, calc_repo, tmp_path):
    """(#45 item 2) The cap walked the directories only: 8 unlinked files held open took
    320 MB against --workspace-tree-mb 16, and the agent was never stopped."""
    repo, _ = calc_repo
    hider = tmp_path / "agents" / "hider.py"
    hider.parent.mkdir()
    hider.write_text(HIDER)
    agent = script_agent(tmp_path, f'"{sys.executable}" "{hider}"\n', timeout=300.0,
                         settings=AgentSettings(workspace_tree_mb=16))
    sample = draw(agent, calc_case(repo))
    detail = sample.verdict.detail
    assert sample.verdict.status is Status.agent_error, (detail, sample.trace.agent_run)
    assert detail.endswith(" bytes, over the 16,777,216-byte cap (--workspace-tree-mb)"), detail
    held = int(detail.split(" held ")[1].split(" bytes")[0].replace(",", ""))
    assert held < 100 << 20, detail  # stopped near the cap, not after all 320 MB


def host_address() -> str | None:
    """The host's own address on its default route (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("203.0.113.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.usefixtures("bwrap")
def test_a_service_on_every_host_address_is_out_of_reach(home, calc_repo, tmp_path, monkeypatch):
    """A service bound to all of the host's addresses (0.0.0.0): neither its loopback nor its
    own network address reaches it from the agent's namespace."""
    address = host_address()
    if address is None:
        pytest.skip("the host has no address beside its loopback")
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen()
    threading.Thread(target=Servers._answer, args=(server,), daemon=True).start()
    try:
        repo, _ = calc_repo
        probe = tmp_path / "agents" / "wildcard.py"
        probe.parent.mkdir()
        probe.write_text(WILDCARD_PROBE.format(address=address, port=server.getsockname()[1]))
        monkeypatch.delenv("EVALPIPE_AGENT_NETWORK", raising=False)
        sample = draw(script_agent(tmp_path, f'"{sys.executable}" "{probe}"\n'), calc_case(repo))
        lines = sample.trace.agent_run.stdout_tail.splitlines()
        assert [line.split()[:2] for line in lines] == [["loopback", "unreachable"], ["host-address", "unreachable"]], lines
        monkeypatch.setenv("EVALPIPE_AGENT_NETWORK", "host")  # the control: on the host's network it answers
        shared = draw(script_agent(tmp_path, f'"{sys.executable}" "{probe}"\n'), calc_case(repo))
        assert shared.trace.agent_run.stdout_tail.splitlines() == ["loopback hello", "host-address hello"]
    finally:
        server.close()


# ------------------------------------------------- the host's other addresses (issue 33, item 1)

SECONDARY_PROBE = '''
import socket, subprocess
# First try to undo the filter: the agent has no capability in its namespace.
for undo in (["ip", "route", "flush", "table", "local"], ["ip", "route", "del", "local", {first!r}, "table", "local"]):
    try:
        done = subprocess.run(undo, capture_output=True, text=True)
        print("undo", done.returncode, done.stderr.strip().replace(" ", "_") or "-")
    except OSError as exc:
        print("undo", "missing", type(exc).__name__)
link = next(name for _, name in socket.if_nameindex() if name != "lo")
for address, tcp, udp in {targets!r}:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    for how in ("plain", "bound"):  # bound to pasta's interface: a failed route lookup sends it there
        for kind, port in ((socket.SOCK_STREAM, tcp), (socket.SOCK_DGRAM, udp)):
            try:
                s = socket.socket(family, kind)
                s.settimeout(1)  # a refused datagram is never answered: the wait is spent
                if how == "bound":
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, link.encode())
                s.connect((address, port))
                if kind == socket.SOCK_DGRAM:
                    s.send(b"ping")
                print(address, how, kind.name, s.recv(5).decode())
            except OSError as exc:
                print(address, how, kind.name, "unreachable", type(exc).__name__)
'''


class SecondaryServers:
    """A TCP and a UDP service answering "hello" on each of `addresses`; `udp_seen`
    counts the datagrams that reached them (a probe that times out never proves none did)."""

    def __init__(self, addresses: list[str]) -> None:
        self.sockets, self.targets, self.udp_seen = [], [], 0
        for address in addresses:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            tcp = socket.socket(family)
            tcp.bind((address, 0))
            tcp.listen()
            udp = socket.socket(family, socket.SOCK_DGRAM)
            udp.bind((address, 0))
            self.sockets += [tcp, udp]
            threading.Thread(target=Servers._answer, args=(tcp,), daemon=True).start()
            threading.Thread(target=self._echo_udp, args=(udp,), daemon=True).start()
            self.targets.append((address, tcp.getsockname()[1], udp.getsockname()[1]))

    def _echo_udp(self, udp: socket.socket) -> None:
        while True:
            try:
                _, peer = udp.recvfrom(16)
            except OSError:
                return
            self.udp_seen += 1
            try:
                udp.sendto(b"hello", peer)
            except OSError:
                return  # closed meanwhile

    def close(self) -> None:
        for s in self.sockets:
            s.close()


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def secondary_addresses():
    """Addresses this host gets for the test's duration, as a docker bridge or a second
    interface would give it: a private IPv4 one, and an IPv6 one where the host has a
    global IPv6 address (pasta then carries IPv6), both on the loopback device (this
    kernel may lack the dummy driver; IPv6 without duplicate detection, so that it can be
    bound at once). Removed whatever happens."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("adding an address to this host needs root and iproute2's ip")
    tag = os.getpid() % 60000
    wanted = [f"198.19.{tag // 250 + 1}.{tag % 250 + 1}/32"]
    if _ip("-6", "addr", "show", "scope", "global").stdout.strip():
        wanted.append(f"fd65:7661:6c70::{tag:x}/128")
    added = []
    try:
        for address in wanted:
            done = _ip("addr", "add", address, "dev", "lo", *(["nodad"] if ":" in address else []))
            if done.returncode != 0:
                pytest.skip(f"cannot add {address} to this host: {done.stderr.strip()}")
            added.append(address)
        yield [a.split("/")[0] for a in added]
    finally:
        for address in added:
            _ip("addr", "del", address, "dev", "lo")


@pytest.fixture(params=["thread", "child"])
def joined_by(request, monkeypatch):
    """How the filter is set: a thread of ours (we hold CAP_SYS_ADMIN) or a forked child
    joining the namespace's user namespace first (what a non-root harness does)."""
    if request.param == "thread" and not network._is_admin():
        pytest.skip("only a process holding CAP_SYS_ADMIN sets the filter from a thread")
    if request.param == "child":
        monkeypatch.setattr(network, "_is_admin", lambda: False)
    return request.param


@pytest.mark.usefixtures("bwrap", "joined_by")
def test_a_service_on_another_address_of_the_host_is_out_of_reach(home, calc_repo, tmp_path, monkeypatch,
                                                                  secondary_addresses):
    """The red team's class, on the host's other addresses: pasta carries a connection to
    any address out through the host's stack, so one the host itself holds (a docker
    bridge's, a second interface's) reached its services. Plainly or bound to pasta's
    interface (`SO_BINDTODEVICE`, which got past `unreachable` routes), TCP or UDP, IPv4
    and IPv6: nothing reaches them, and the agent cannot remove the filter."""
    servers = SecondaryServers(secondary_addresses)
    try:
        repo, _ = calc_repo
        probe = tmp_path / "agents" / "secondary.py"
        probe.parent.mkdir()
        probe.write_text(SECONDARY_PROBE.format(first=secondary_addresses[0], targets=servers.targets))
        monkeypatch.delenv("EVALPIPE_AGENT_NETWORK", raising=False)
        agent = script_agent(tmp_path, f'"{sys.executable}" "{probe}"\n')
        sample = draw(agent, calc_case(repo))
        lines = sample.trace.agent_run.stdout_tail.splitlines()
        undo, reached = lines[:2], lines[2:]
        assert len(reached) == 4 * len(secondary_addresses), (sample.verdict.detail, sample.trace.agent_run)
        assert all(line.split()[1] not in ("0", "missing") for line in undo), undo  # both refused
        assert [line.split()[3] for line in reached] == ["unreachable"] * len(reached), reached
        assert servers.udp_seen == 0
        # The control: without the filter, the same probe reaches both services on each.
        monkeypatch.setattr(network, "guard", lambda *args: None)
        control = draw(agent, calc_case(repo))
        open_lines = control.trace.agent_run.stdout_tail.splitlines()[2:]
        assert [line for line in open_lines if " plain " in line] == [
            f"{address} plain {kind} hello" for address in secondary_addresses
            for kind in ("SOCK_STREAM", "SOCK_DGRAM")], (control.verdict.detail, control.trace.agent_run)
    finally:
        servers.close()


@pytest.mark.usefixtures("bwrap", "joined_by")
def test_where_the_filter_cannot_be_set_the_agent_does_not_run(home, calc_repo, tmp_path, monkeypatch):
    """The filter is set by a child joining the namespace; where it fails, the sample fails
    with its one line and the agent never ran: never an open network."""
    def refuse(destinations):
        raise OSError("no route may be added here")

    monkeypatch.setattr(network, "_add_local_routes", refuse)
    monkeypatch.delenv("EVALPIPE_AGENT_NETWORK", raising=False)
    repo, _ = calc_repo
    marker = tmp_path / "ran"
    sample = draw(script_agent(tmp_path, f'touch "{marker}"\n'), calc_case(repo))
    assert sample.verdict.status is Status.agent_error, sample.verdict
    assert "cannot filter the sandbox's network: no route may be added here" in sample.verdict.detail
    assert "\n" not in sample.verdict.detail.strip()
    assert not marker.exists()
    assert subprocess.run(["pgrep", "-P", str(os.getpid()), "pasta"], capture_output=True).stdout == b""


LATE_PROBE = '''
import os, pathlib, socket, time
# The host gains an address while this agent runs (the test adds it, and a service on it,
# when asked through a file of the workspace), after its sandbox was set up.
here = pathlib.Path(os.environ["EVALPIPE_WORKSPACE"])
(here / "ask.late").touch()
deadline = time.monotonic() + 60
while not (here / "answer.late").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
address, port = (here / "answer.late").read_text().split()
time.sleep(1)  # past the watcher's window (milliseconds; docs/sandbox.md)
for how in ("plain", "bound"):
    try:
        s = socket.socket()
        s.settimeout(3)
        if how == "bound":
            link = next(name for _, name in socket.if_nameindex() if name != "lo")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, link.encode())
        s.connect((address, int(port)))
        print(how, s.recv(5).decode())
    except OSError as exc:
        print(how, "unreachable", type(exc).__name__)
(here / "answer.late").unlink()
'''


class LateAddresses:
    """Each time an agent asks (its file `ask.late`, found under `home`), the next of
    `addresses` is added to this host (on its loopback device) with a TCP service answering
    "hello" on it, and the agent told where (`answer.late` beside the question); `reached`
    counts the connections the services got. `close` removes every address and ends every
    socket."""

    def __init__(self, home: Path, addresses: list[str]) -> None:
        self.home, self.pending, self.added, self.sockets, self.reached = home, list(addresses), [], [], 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._answer_asks, daemon=True)
        self.thread.start()

    def _answer_asks(self) -> None:
        while not self.stopping.wait(0.02):
            try:
                asks = list(self.home.rglob("ask.late"))
            except OSError:  # a sample's scratch directory removed while walking
                continue
            for ask in asks:
                ask.unlink()
                address = self.pending.pop(0)
                if _ip("addr", "add", f"{address}/32", "dev", "lo").returncode != 0:
                    continue
                self.added.append(address)
                service = socket.socket()
                service.bind((address, 0))
                service.listen()
                self.sockets.append(service)
                threading.Thread(target=self._hello, args=(service,), daemon=True).start()
                answer = ask.with_name("answer.tmp")
                answer.write_text(f"{address} {service.getsockname()[1]}\n")
                answer.replace(ask.with_name("answer.late"))

    def _hello(self, service: socket.socket) -> None:
        while True:
            try:
                conn, _ = service.accept()
            except OSError:
                return
            self.reached += 1
            conn.sendall(b"hello")
            conn.close()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()
        for service in self.sockets:
            try:
                service.shutdown(socket.SHUT_RDWR)  # wakes its accept: a closed socket would go on listening
            except OSError:
                pass
            service.close()
        for address in self.added:
            _ip("addr", "del", f"{address}/32", "dev", "lo")


_LATE_TAGS = iter(range(1, 1 << 16))


@pytest.mark.usefixtures("bwrap", "joined_by")
def test_an_address_the_host_gains_while_the_agent_runs_is_out_of_reach(home, calc_repo, tmp_path, monkeypatch):
    """The filter was read once, when the sandbox started: an address the host gained later
    (a docker bridge coming up, a VPN) was reachable from an agent already running. Now the
    host's route announcements are watched while it runs: the address the test adds when
    the running agent asks, and the service on it, are out of reach, plainly or bound to pasta's
    interface; the control without the watch reaches the service."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("adding an address to this host needs root and iproute2's ip")
    tag = (os.getpid() % 250, next(_LATE_TAGS) % 60)
    late = LateAddresses(home, [f"198.18.{tag[1] * 2 + half}.{tag[0] + 1}" for half in (0, 1)])
    try:
        repo, _ = calc_repo
        probe = tmp_path / "agents" / "late.py"
        probe.parent.mkdir()
        probe.write_text(LATE_PROBE)
        monkeypatch.delenv("EVALPIPE_AGENT_NETWORK", raising=False)
        agent = script_agent(tmp_path, f'"{sys.executable}" "{probe}"\n')
        sample = draw(agent, calc_case(repo))
        lines = sample.trace.agent_run.stdout_tail.splitlines()
        assert [line.split()[:2] for line in lines] == [["plain", "unreachable"], ["bound", "unreachable"]], (
            lines, sample.verdict.detail, sample.trace.agent_run)
        assert late.reached == 0 and len(late.added) == 1
        # The control: with no watch, the filter of the start misses it and the service answers.
        monkeypatch.setattr(network.AddressWatch, "start", lambda self: self)
        control = draw(agent, calc_case(repo))
        assert control.trace.agent_run.stdout_tail.splitlines()[:1] == ["plain hello"], (
            control.verdict.detail, control.trace.agent_run)
        assert late.reached >= 1
    finally:
        late.close()
    assert subprocess.run(["pgrep", "-P", str(os.getpid()), "pasta"], capture_output=True).stdout == b""


@pytest.mark.usefixtures("bwrap")
def test_where_a_gained_address_cannot_be_filtered_the_agent_is_killed(home, calc_repo, tmp_path, monkeypatch):
    """The watch's filter for an address gained mid-run fails (the start's succeeded): the
    agent, which would wait a minute, is killed at once, and the sample says why in one
    line; never an open network."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("adding an address to this host needs root and iproute2's ip")
    calls = []
    original = network.guard

    def second_fails(net, user, destinations):
        calls.append(destinations)
        if len(calls) > 1:
            raise SandboxError("cannot filter the sandbox's network: no route may be added here")
        original(net, user, destinations)

    monkeypatch.setattr(network, "guard", second_fails)
    tag = (os.getpid() % 250, next(_LATE_TAGS) % 60)
    late = LateAddresses(home, [f"198.18.{tag[1] * 2}.{tag[0] + 1}"])
    try:
        repo, _ = calc_repo
        probe = tmp_path / "agents" / "late.py"
        probe.parent.mkdir()
        probe.write_text(LATE_PROBE.replace("time.sleep(1)", "time.sleep(60)"))
        monkeypatch.delenv("EVALPIPE_AGENT_NETWORK", raising=False)
        sample = draw(script_agent(tmp_path, f'"{sys.executable}" "{probe}"\n', timeout=300.0), calc_case(repo))
        detail = sample.verdict.detail
        assert sample.verdict.status is Status.agent_error, (detail, sample.trace.agent_run)
        assert "cannot filter the sandbox's network: no route may be added here (while the sandbox ran: it was killed)" \
            in detail and "\n" not in detail.strip(), detail
        assert late.added and late.reached == 0
    finally:
        late.close()
    assert subprocess.run(["pgrep", "-P", str(os.getpid()), "pasta"], capture_output=True).stdout == b""


# Three tries: a name lookup through the host's resolver can miss once on a busy machine (a
# two-worker run met one), which says nothing about the filter.
OUTSIDE_PROBE = '''
import socket, time
for attempt in range(3):
    try:
        print("outside", socket.create_connection(("pypi.org", 443), timeout=10).getpeername()[0])
        break
    except OSError as exc:
        failed = exc
        time.sleep(1)
else:
    print("outside unreachable", type(failed).__name__, failed)
'''


@pytest.mark.slow
@pytest.mark.usefixtures("bwrap")
def test_the_outside_stays_in_reach_through_the_filter(home, calc_repo, tmp_path, monkeypatch):
    """What the filter must not take: a registry this host reaches, the agent reaches too
    (its name resolved by the host's resolver, its connection carried by pasta)."""
    try:
        socket.create_connection(("pypi.org", 443), timeout=10).close()
    except OSError as exc:
        pytest.skip(f"this host does not reach pypi.org:443 ({exc})")
    repo, _ = calc_repo
    probe = tmp_path / "agents" / "outside.py"
    probe.parent.mkdir()
    probe.write_text(OUTSIDE_PROBE)
    monkeypatch.delenv("EVALPIPE_AGENT_NETWORK", raising=False)
    sample = draw(script_agent(tmp_path, f'"{sys.executable}" "{probe}"\n'), calc_case(repo))
    lines = sample.trace.agent_run.stdout_tail.splitlines()
    assert lines and lines[0].startswith("outside ") and "unreachable" not in lines[0], (lines, sample.verdict)
