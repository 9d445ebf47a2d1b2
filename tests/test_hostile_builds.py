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
