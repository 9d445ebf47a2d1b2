"""Environment builds run commands from suites and `setup.py` files: untrusted. One build
must not change what another installs (a shared download cache is the classic poison), nor
see the host's publish tokens, nor leave a password in the build log it stores."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tasks.repos import environments
from tasks.repos.environments import parse_environment, runtime_for

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("build_pricing", ROOT / "examples/pricing/build_repo.py")
pricing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pricing)

pytestmark = [pytest.mark.usefixtures("needs_bwrap"), pytest.mark.slow]


@pytest.fixture
def needs_bwrap():
    from tasks.sandbox import bwrap_available

    if not bwrap_available():
        pytest.skip("bubblewrap is not usable here")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    path = tmp_path_factory.mktemp("repos") / "evalpipe__pricing"
    return str(path), pricing.build(path)


def build(repo, *install: str):
    """Build an environment from `install` commands; the env directory."""
    spec = parse_environment({"install": list(install), "timeout_s": 120})
    runtime = runtime_for(spec, repo[0], repo[1], needs_pytest=False)
    return Path(runtime.python).parent.parent.parent


def test_one_build_cannot_poison_what_later_builds_install(repo, home: Path, tmp_path, monkeypatch) -> None:
    host_cache = tmp_path / "host-uv-cache"
    host_cache.mkdir()
    monkeypatch.setenv("UV_CACHE_DIR", str(host_cache))
    monkeypatch.setenv("PIP_CACHE_DIR", str(host_cache))
    shared = home / "envs" / ".cache"
    poison = (f'echo poison > "$UV_CACHE_DIR/poison"; echo poison > "$PIP_CACHE_DIR/poison"; '
              f'(mkdir -p {shared}/uv && echo poison > {shared}/uv/poison) || true; '
              f'(echo poison > {host_cache}/poison2) || true')
    first = build(repo, poison)
    # The build's cache was its own and is gone; nothing reached the host's or a shared one.
    assert list(host_cache.iterdir()) == []
    assert not (shared / "uv" / "poison").exists()
    assert not (first / ".cache").exists()
    # A later build sees a clean cache of its own (it fails if the poison is visible).
    build(repo, 'test ! -e "$UV_CACHE_DIR/poison" && test ! -e "$PIP_CACHE_DIR/poison"',
          f'case "$UV_CACHE_DIR" in {host_cache}*) exit 1;; esac')


def test_a_build_gets_index_settings_and_no_other_secret(repo, home: Path, monkeypatch) -> None:
    monkeypatch.setenv("UV_PUBLISH_TOKEN", "pypi-publish-token-0123456789")
    monkeypatch.setenv("PIP_INDEX_URL", "https://user:hunter2-index-password@index.invalid/simple")
    monkeypatch.setenv("TWINE_PASSWORD", "twine-password-0123456789")
    monkeypatch.setenv("MY_BUILD_FLAG", "wanted-by-the-user")
    monkeypatch.setenv(environments.BUILD_PASS_ENV, "MY_BUILD_FLAG")
    path = build(repo, 'env | sort > "$VIRTUAL_ENV/../env.txt"; echo "index: $PIP_INDEX_URL"')
    seen = (path / "env.txt").read_text()
    assert "PIP_INDEX_URL=https://user:hunter2-index-password@" in seen  # the build needs it
    assert "MY_BUILD_FLAG=wanted-by-the-user" in seen
    assert "UV_PUBLISH_TOKEN" not in seen and "TWINE_PASSWORD" not in seen
    log = (path / "build.log").read_text()
    assert "index: " in log and "hunter2-index-password" not in log


PROBE = ('"$VIRTUAL_ENV/bin/python" -c "import socket, sys\n'
         'for port in sys.argv[1:]:\n'
         '    try:\n'
         '        socket.create_connection((\'127.0.0.1\', int(port)), 3).close(); print(port, \'reached\')\n'
         '    except OSError as exc:\n'
         '        print(port, \'refused\', type(exc).__name__)" {ports} > "$VIRTUAL_ENV/../reach.txt"')


def test_a_build_reaches_the_index_its_variables_name_and_nothing_else_of_the_host(
        repo, home: Path, monkeypatch) -> None:
    """(#45 item 9) A setup.py or an install command reached the host's loopback (and every
    host address) where a workspace agent is kept off them. Now a build has the agent's
    network: the index the user's variables name on the loopback answers, nothing else."""
    import socket

    secret, index = socket.socket(), socket.socket()
    try:
        for server in (secret, index):
            server.bind(("127.0.0.1", 0))
            server.listen()
        monkeypatch.delenv("EVALPIPE_AGENT_NETWORK", raising=False)
        monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{index.getsockname()[1]}/simple")
        ports = f"{secret.getsockname()[1]} {index.getsockname()[1]}"
        reach = (build(repo, PROBE.format(ports=ports)) / "reach.txt").read_text().splitlines()
        assert reach[0].startswith(f"{secret.getsockname()[1]} refused"), reach
        assert reach[1] == f"{index.getsockname()[1]} reached", reach
        # A build that needs the host fails, and says what would let it.
        with pytest.raises(environments.EnvironmentFailed, match="EVALPIPE_AGENT_NETWORK=host"):
            build(repo, PROBE.format(ports=secret.getsockname()[1]) + ' && grep -q reached "$VIRTUAL_ENV/../reach.txt"')
        monkeypatch.setenv("EVALPIPE_AGENT_NETWORK", "host")  # the user allows it
        reach = (build(repo, PROBE.format(ports=ports), "true") / "reach.txt").read_text().splitlines()
        assert reach == [f"{p} reached" for p in ports.split()]
    finally:
        secret.close()
        index.close()
