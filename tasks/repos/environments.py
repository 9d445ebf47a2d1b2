"""Repository environments: a venv per (repository, commit, python, install), built once,
in which `repo_tests` runs a repository's tests instead of the harness's interpreter.

Layout under `EVALPIPE_HOME/envs/`:

    <name>/venv/        the virtual environment (uv; `python -m venv` + pip without uv)
    <name>/build.log    the output of every build command
    <name>/env.json     written last: present means built; its mtime is the last use
    .locks/<name>       flock: exclusive while building or pruning, shared while in use
    <name>/.cache/      the build's own download caches (uv, pip), removed when it ends

A build runs in the sandbox with the workspace agent's network (`tasks.sandbox.network`: the
outside, package indexes included, and the loopback endpoints the passed index and proxy
variables name; nothing else of this machine, its loopback and its other addresses
included, unless EVALPIPE_AGENT_NETWORK=host), a tree of the repository at the environment's
commit mounted at TESTBED, and only that tree and its own env dir writable. Its download
cache is its own: install commands come from suites and `setup.py` files (untrusted), and a
shared cache would let one build change what every later build installs. Tests
run in the sandbox without network, the sample's worktree mounted at the same TESTBED (so
an editable install made at build time imports the sample's code), the env read-only and
the harness's own venv and code hidden.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tasks.files import atomic_write
from tasks.home import CODE_ROOT, evalpipe_home
from tasks.models import InputError, canonical_json, sha256_hex
from tasks.params import Environment
from tasks.redaction import MIN_SECRET_CHARS, redact
from tasks.repos.worktrees import RepoError, checkout, ensure_commit, mirror, source_of
from tasks.sandbox import Limits, Mounts, SandboxError, SandboxResult, bwrap_available, run_command
from tasks.sandbox.network import OwnNetwork, agent_network
from tasks.settings import ENV, current
from tasks.trace import EnvironmentTrace, RepoTestsTrace

# Where every tree appears inside the sandbox, at build and at test time (a path under
# the sandbox's private /tmp: bubblewrap cannot create one in the read-only root).
TESTBED = "/tmp/testbed"
# "pip" builds with `python -m venv` + pip even when uv is installed (`MachineSettings.env_installer`).
INSTALLER_ENV = ENV["env_installer"]
BUILD_MEMORY_MB = 8192
BUILD_FILE_SIZE_MB = 4096  # wheels of big packages are larger than the tests' cap
# A failed build is not retried by the same process for this long (a run with many
# samples of one environment reports the failure once per sample instead of rebuilding).
FAILURE_MEMO_S = 300.0
# The host settings a build may need to reach a package index (never passed to tests):
# these names, in any case, and the ones the machine's settings list (BUILD_PASS_ENV). Everything else of
# the host's environment (publish tokens, cache and config locations) stays out.
_INDEX_VARS = frozenset({
    "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST", "PIP_CERT",
    "PIP_CLIENT_CERT", "UV_INDEX", "UV_DEFAULT_INDEX", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL",
    "UV_FIND_LINKS", "UV_INSECURE_HOST", "UV_NATIVE_TLS", "UV_INDEX_STRATEGY",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY",
})
BUILD_PASS_ENV = ENV["build_pass_env"]
# What an interpreter is: run in the sandbox for a named python, in-process for our own.
_DESCRIBE = (
    "def describe():\n"
    "    import os, sys\n"
    "    try:\n"
    "        import ensurepip\n"
    "        b = os.path.join(os.path.dirname(ensurepip.__file__), '_bundled')\n"
    "    except ImportError:\n"
    "        b = ''\n"
    "    return [getattr(sys, '_base_executable', sys.executable), sys.base_prefix,\n"
    "            sys.version.split()[0], b if b and os.path.isdir(b) else '']\n"
)
_PROBE = _DESCRIBE + "print('\\n'.join(describe()))\n"


class EnvironmentFailed(Exception):
    """The environment could not be had (graders report `error` with this message)."""


def parse_environment(value: Any, where: str = "repo_tests: environment") -> Environment | None:
    """The checked spec, or None when absent; raises `InputError` naming the bad field."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InputError(f"{where} must be a mapping (python, install)")
    try:
        return Environment.model_validate(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "environment"
        raise InputError(f"{where}: {field}: {err['msg']}") from None


@dataclass(frozen=True)
class Interpreter:
    executable: str  # the base interpreter (a venv's python resolves to its base)
    prefix: str
    version: str
    bundled: str  # ensurepip's bundled wheels ("" if this Python has none)


@dataclass(frozen=True)
class Identity:
    """What an environment is built from; `key` is the sha256 of it."""

    name: str
    key: str
    repo: str
    commit: str
    interpreter: Interpreter
    installer: str  # path of uv, or "pip"

    def describe(self) -> str:
        return (f"environment {self.name} ({self.repo.rsplit('/', 1)[-1]}@{self.commit[:12]},"
                f" python {self.interpreter.version})")


@dataclass(frozen=True)
class Runtime:
    """How the tests of a tree run: the interpreter, and (with an environment) the mounts
    and variables that put the tree at TESTBED beside the environment."""

    python: str
    env: Mapping[str, str]
    mounts: Mounts | None = None
    lock: Path | None = None  # held shared around each use, so `prune` cannot pull it away
    ready: Path | None = None

    def path(self, host: Path, tree: Path) -> str:
        """`host` (inside `tree`) as the sandboxed command sees it."""
        if self.mounts is None:
            return str(host)
        return f"{TESTBED}/{host.relative_to(tree).as_posix()}"

    def run(self, argv: Sequence[str], tree: Path, limits: Limits, env: Mapping[str, str],
            **options: Any) -> SandboxResult:
        """`run_command` in `tree` (`options`: its scratch_mb, pass_fds)."""
        if self.lock is None or self.ready is None:
            return run_command(list(argv), workdir=tree, limits=limits, env=env, **options)
        with _locked(self.lock, shared=True):
            if not self.ready.exists():
                raise SandboxError(f"environment {self.ready.parent.name} was removed while in use")
            return run_command(list(argv), workdir=tree, limits=limits,
                               env={**env, **self.env}, mounts=self.mounts, **options)


# Today's behaviour: the harness's interpreter, the tree at its own path.
HOST = Runtime(python=sys.executable, env={})


def runtime_for(spec: Environment | None, repo: str, base_commit: str, *, needs_pytest: bool,
                trace: RepoTestsTrace | None = None, home: Path | None = None) -> Runtime:
    """The runtime for a sample's tests: HOST without a spec; otherwise the environment,
    built first if it is not yet. Raises `EnvironmentFailed`."""
    if spec is None:
        return HOST
    home = home or evalpipe_home()
    ident = identify(spec, repo, base_commit, home)
    path = home / "envs" / ident.name
    meta = _ensure_built(ident, spec, path)
    if trace is not None:
        trace.environment = EnvironmentTrace(name=ident.name, python=ident.interpreter.version,
                                             pytest=meta.get("pytest"))
    if needs_pytest and not meta.get("pytest"):
        raise EnvironmentFailed(f"{ident.describe()} has no pytest, which the default test "
                                "command needs: add it to install")
    venv = path / "venv"
    return Runtime(
        python=str(venv / "bin" / "python"),
        env={"VIRTUAL_ENV": str(venv), "PATH": f"{venv}/bin:{_host_path()}"},
        mounts=Mounts(workdir_at=TESTBED, ro=(str(path), ident.interpreter.prefix),
                      hide=_harness_dirs()),
        lock=_lock_path(path),
        ready=path / "env.json",
    )


def ensure_environment(spec: Environment, repo: str, base_commit: str, home: Path | None = None) -> dict:
    """Build the environment unless it is built; its record (`env.json`: name, build_s,
    pytest, ...) and whether this call built it. Raises `EnvironmentFailed`."""
    home = home or evalpipe_home()
    ident = identify(spec, repo, base_commit, home)
    path = home / "envs" / ident.name
    built_before = _read_meta(path / "env.json") is not None
    return {**_ensure_built(ident, spec, path), "built_now": not built_before}


# ------------------------------------------------------------------ identity

_identities: dict[tuple, Identity] = {}
_interpreters: dict[str, Interpreter] = {}
_memo_lock = threading.Lock()


def identify(spec: Environment, repo: str, base_commit: str, home: Path) -> Identity:
    """The environment's identity, computed once per process (a git lookup and, for a
    named python, one sandboxed probe)."""
    memo = (spec, repo, base_commit, str(home))
    with _memo_lock:
        if memo in _identities:
            return _identities[memo]
    try:
        source = source_of(repo)
        commit = ensure_commit(mirror(repo, home), spec.setup_commit or base_commit, repo)
    except RepoError as exc:
        raise EnvironmentFailed(f"environment for {repo}: {exc}") from None
    interpreter = _interpreter(spec.python) if spec.python else _this_interpreter()
    installer = _uv() or "pip"
    content = {
        "repo": source,
        "commit": commit,
        "python": [interpreter.executable, interpreter.version],
        "install": list(spec.install),
        "installer": "pip" if installer == "pip" else "uv",
    }
    key = sha256_hex(canonical_json(content))
    stem = re.sub(r"[^\w.-]", "_", source.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git"))
    ident = Identity(name=f"{stem[:40] or 'repo'}-{key[:16]}", key=key, repo=source,
                     commit=commit, interpreter=interpreter, installer=installer)
    with _memo_lock:
        _identities[memo] = ident
    return ident


def _interpreter(python: str) -> Interpreter:
    with _memo_lock:
        if python in _interpreters:
            return _interpreters[python]
    # Run in the sandbox: the name comes from a suite file, which may come from anywhere.
    with tempfile.TemporaryDirectory(prefix="evalpipe-probe-") as tmp:
        try:
            result = run_command([python, "-I", "-c", _PROBE], workdir=Path(tmp),
                                 limits=Limits(timeout_s=60))
            lines = result.stdout.decode(errors="replace").splitlines()
            ok = result.returncode == 0 and len(lines) == 4
            why = _tail(result.stderr, 300).strip()
        except SandboxError as exc:
            ok, lines, why = False, [], str(exc)
    if not ok:
        raise EnvironmentFailed(f"environment: python {python!r} not found or not runnable"
                                f" on this machine: {why or 'no answer'}")
    interpreter = Interpreter(*lines)
    with _memo_lock:
        _interpreters[python] = interpreter
    return interpreter


@cache
def _this_interpreter() -> Interpreter:
    """The harness's own interpreter (trusted: described in-process, no sandbox start)."""
    namespace: dict[str, Any] = {}
    exec(_DESCRIBE, namespace)  # noqa: S102 - our own constant
    return Interpreter(*namespace["describe"]())


def _uv() -> str | None:
    if current().env_installer == "pip":
        return None
    try:
        from uv import find_uv_bin
    except ImportError:
        return shutil.which("uv")
    try:
        return find_uv_bin()
    except FileNotFoundError:
        return None


def _harness_dirs() -> tuple[str, ...]:
    """The harness's own venv and code: hidden from graded code."""
    dirs = [str(CODE_ROOT)]
    if sys.prefix != sys.base_prefix:
        dirs.append(sys.prefix)
    return tuple(dirs)


def _host_path() -> str:
    return os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin"


# ------------------------------------------------------------------ building

_failures: dict[str, tuple[float, str]] = {}


def _ensure_built(ident: Identity, spec: Environment, path: Path) -> dict:
    meta = _read_meta(path / "env.json")
    if meta is None:
        _raise_recent_failure(path)
        with _locked(_lock_path(path)):
            meta = _read_meta(path / "env.json")
            if meta is None:
                _raise_recent_failure(path)
                try:
                    meta = _build(ident, spec, path)
                except EnvironmentFailed as exc:
                    with _memo_lock:
                        _failures[str(path)] = (time.monotonic(), str(exc))
                    raise
    try:
        os.utime(path / "env.json")  # the last use, for `env list` and `env prune`
    except OSError:
        pass
    return meta


def _raise_recent_failure(path: Path) -> None:
    with _memo_lock:
        failed = _failures.get(str(path))
    if failed and time.monotonic() - failed[0] < FAILURE_MEMO_S:
        raise EnvironmentFailed(failed[1])


def _read_meta(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _build(ident: Identity, spec: Environment, path: Path) -> dict:
    shutil.rmtree(path, ignore_errors=True)  # what an interrupted or failed build left
    path.mkdir(parents=True)
    venv = path / "venv"
    env = _build_env(ident, path, venv)
    mounts = Mounts(workdir_at=TESTBED, rw=(str(path),), ro=(ident.interpreter.prefix,))
    passed = _passed_values(env)
    try:  # setup.py and the install commands are a suite's or a history's: kept off this host
        network = agent_network(build_pass_env()) if bwrap_available() else True
    except InputError as exc:
        raise EnvironmentFailed(f"{ident.describe()}: {exc}") from None
    steps = [*_venv_steps(ident, venv), *((cmd, ["/bin/sh", "-ec", cmd]) for cmd in spec.install)]
    start = time.monotonic()
    _say(f"building {ident.describe()}: {len(spec.install)} install command(s)")
    with (path / "build.log").open("ab") as log:
        try:
            with checkout(ident.repo, ident.commit, path.parent.parent) as tree:
                for i, (label, argv) in enumerate(steps, 1):
                    _say(f"  [{i}/{len(steps)}] {label}")
                    remaining = spec.timeout_s - (time.monotonic() - start)
                    if remaining <= 0:
                        raise EnvironmentFailed(f"{ident.describe()}: the build timed out "
                                                f"after {spec.timeout_s:g}s, before {label!r}")
                    result = _run_step(argv, tree, remaining, env, mounts, log, label, passed, network)
                    if result.timed_out:
                        raise EnvironmentFailed(f"{ident.describe()}: {label!r} timed out (the "
                                                f"build's timeout_s is {spec.timeout_s:g}s)")
                    if result.returncode != 0:
                        tail = redact(_tail(result.stdout + result.stderr, 800).strip(), passed)
                        raise EnvironmentFailed(f"{ident.describe()}: {label!r} exited "
                                                f"{result.returncode}: {tail}{_host_note(network)}")
                pytest = _pytest_version(venv, tree, mounts)
        except (SandboxError, RepoError, EnvironmentFailed) as exc:
            shutil.rmtree(venv, ignore_errors=True)  # keep the log, drop the half-built venv
            if isinstance(exc, EnvironmentFailed):
                raise
            raise EnvironmentFailed(f"{ident.describe()}: build failed: {exc}") from None
        finally:
            shutil.rmtree(path / ".cache", ignore_errors=True)
    meta = {
        "name": ident.name, "key": ident.key, "repo": ident.repo, "commit": ident.commit,
        "python": ident.interpreter.executable, "python_version": ident.interpreter.version,
        "install": list(spec.install), "installer": "pip" if ident.installer == "pip" else "uv",
        "pytest": pytest, "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "build_s": round(time.monotonic() - start, 3),
    }
    atomic_write(path / "env.json", json.dumps(meta, indent=1))
    _say(f"built {ident.name} in {meta['build_s']:.1f}s")
    return meta


def _venv_steps(ident: Identity, venv: Path) -> list[tuple[str, list[str]]]:
    """Create the venv with pip (and setuptools where the Python bundles it), as
    `python -m venv` would; uv does it from ensurepip's wheels in a fraction of the time."""
    python = ident.interpreter
    if ident.installer == "pip":
        return [(f"python -m venv (python {python.version})",
                 [python.executable, "-m", "venv", str(venv)])]
    wheels = sorted(str(p) for p in Path(python.bundled).glob("*.whl")) if python.bundled else []
    create = [ident.installer, "venv", "--quiet", "--python", python.executable, str(venv)]
    if not wheels:
        return [(f"uv venv --seed (python {python.version})", [*create, "--seed"])]
    return [
        (f"uv venv (python {python.version})", create),
        ("seed pip from ensurepip", [ident.installer, "pip", "install", "--quiet", "--python",
                                     str(venv / "bin" / "python"), *wheels]),
    ]


def _build_env(ident: Identity, path: Path, venv: Path) -> dict[str, str]:
    """The activated venv, the build's own caches, and the host's package-index settings
    (which can never move the caches: ours are set last)."""
    bin_dirs = [str(venv / "bin")]
    if ident.installer != "pip":
        # `pip` in an install command is uv's pip (`python -m pip` stays pip).
        shim = path / "shim"
        shim.mkdir(exist_ok=True)
        for name in ("pip", "pip3"):
            (shim / name).write_text(f'#!/bin/sh\nexec {shlex.quote(ident.installer)} pip "$@"\n')
            (shim / name).chmod(0o755)
        bin_dirs.insert(0, str(shim))
    cache = path / ".cache"
    env = {
        **build_pass_env(),
        "UV_CACHE_DIR": str(cache / "uv"),
        "PIP_CACHE_DIR": str(cache / "pip"),
        "UV_SYSTEM_CERTS": "1",  # a TLS-inspecting proxy's CA is in the system store
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_NO_PROGRESS": "1",
        # Tests run on the venv read-only and write no bytecode: compiled here, once, or each
        # graded run compiles pytest and the rest again (0.47 s a bare pytest run, 0.22 s so).
        "UV_COMPILE_BYTECODE": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_CONFIG_FILE": os.devnull,  # the host's pip.conf may name its own cache or index
        "UV_NO_CONFIG": "1",
        "PYTHONNOUSERSITE": "1",
        "VIRTUAL_ENV": str(venv),
        "PATH": ":".join([*bin_dirs, _host_path()]),
    }
    for directory in (env["UV_CACHE_DIR"], env["PIP_CACHE_DIR"]):
        Path(directory).mkdir(parents=True, exist_ok=True)
    return env


def build_pass_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The host variables a build receives (their values from `environ`, default this process's
    environment): the package-index settings (`_INDEX_VARS`) and those the machine's settings
    name (EVALPIPE_BUILD_PASS_ENV)."""
    environ = os.environ if environ is None else environ
    extra = current().build_pass_env
    return {k: v for k, v in environ.items() if k.upper() in _INDEX_VARS | extra}


def _passed_values(env: Mapping[str, str]) -> tuple[str, ...]:
    """What a build log must not show: the values of every host variable passed in (an index
    URL may carry a password)."""
    return tuple(v for k, v in build_pass_env().items() if len(v) >= MIN_SECRET_CHARS and env.get(k) == v)


def _host_note(network: OwnNetwork | bool) -> str:
    """What a failed build run off this host is told: it may have needed the host."""
    if network is True:
        return ""
    return (" (the build reached the outside, not this machine: one that needs a service of this host runs with"
            " EVALPIPE_AGENT_NETWORK=host, or names its index on the loopback in PIP_INDEX_URL or UV_INDEX_URL)")


def _run_step(argv: list[str], tree: Path, timeout_s: float, env: Mapping[str, str], mounts: Mounts, log: Any,
              label: str, secrets: Sequence[str], network: OwnNetwork | bool) -> SandboxResult:
    limits = Limits(timeout_s=timeout_s, memory_mb=BUILD_MEMORY_MB,
                    file_size_mb=BUILD_FILE_SIZE_MB, max_procs=512)
    result = run_command(argv, workdir=tree, limits=limits, env=env, network=network, mounts=mounts)
    text = (result.stdout + result.stderr).decode("utf-8", "replace")
    log.write(redact(f"$ {label}\n{text}[exit {result.returncode}, {result.duration_s:.1f}s]\n", secrets).encode())
    log.flush()
    return result


def _pytest_version(venv: Path, tree: Path, mounts: Mounts) -> str | None:
    result = run_command(
        [str(venv / "bin" / "python"), "-c", "import pytest; print(pytest.__version__)"],
        workdir=tree, limits=Limits(timeout_s=120), env={"PYTHONNOUSERSITE": "1"}, mounts=mounts,
    )
    return (result.stdout.decode().strip() or None) if result.returncode == 0 else None


def _say(message: str) -> None:
    """A progress line on stderr: a build can take minutes."""
    print(f"evalpipe: {message}", file=sys.stderr, flush=True)


def _tail(data: bytes, size: int) -> str:
    return data[-size:].decode("utf-8", "replace")


# ------------------------------------------------------------------ locks, list, prune


def _lock_path(path: Path) -> Path:
    return path.parent / ".locks" / path.name


@contextmanager
def _locked(path: Path, *, shared: bool = False, blocking: bool = True) -> Iterator[bool]:
    """flock on `path` (opened per acquisition, so threads contend like processes);
    yields False when non-blocking and taken."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def list_environments(home: Path | None = None) -> list[dict[str, Any]]:
    """Every environment directory: name, status (`ready` or `incomplete`), size, last use."""
    envs = (home or evalpipe_home()) / "envs"
    rows = []
    for path in sorted(envs.iterdir()) if envs.is_dir() else []:
        if path.name.startswith(".") or not path.is_dir():
            continue
        meta = _read_meta(path / "env.json")
        marker = path / "env.json" if meta else path
        rows.append({
            "name": path.name,
            "status": "ready" if meta else "incomplete",
            "size_bytes": _size(path),
            "last_used": datetime.fromtimestamp(marker.stat().st_mtime, UTC).isoformat(timespec="seconds"),
            "repo": (meta or {}).get("repo"),
            "commit": (meta or {}).get("commit"),
            "python": (meta or {}).get("python_version"),
            "path": str(path),
        })
    return rows


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def prune(names: Sequence[str] = (), *, unused_days: float | None = None, everything: bool = False,
          home: Path | None = None) -> dict[str, list[str]]:
    """Remove environments: the named ones (name or prefix), those unused for `unused_days`,
    or all; incomplete builds always. One in use or being built is skipped, not broken."""
    envs = (home or evalpipe_home()) / "envs"
    now = time.time()
    removed, busy = [], []
    for row in list_environments(home):
        path = Path(row["path"])
        chosen = (
            everything
            or row["status"] != "ready"
            or any(row["name"].startswith(n) for n in names)
            or (unused_days is not None
                and now - (path / "env.json").stat().st_mtime > unused_days * 86400)
        )
        if not chosen:
            continue
        with _locked(_lock_path(path), blocking=False) as mine:
            if not mine:
                busy.append(row["name"])
                continue
            (path / "env.json").unlink(missing_ok=True)  # no longer ready, even if rmtree stops
            shutil.rmtree(path, ignore_errors=True)
            removed.append(row["name"])
    if everything:
        shutil.rmtree(envs / ".cache", ignore_errors=True)
    return {"removed": removed, "busy": busy}


def read_environment_file(path: Path) -> Any:
    """An environment file's YAML document; `InputError` naming the file if it does not read."""
    import yaml

    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: malformed YAML: {getattr(exc, 'problem', None) or exc}") from None


def load_environment_map(path: Path) -> dict[str, Environment]:
    """An `--environments` file: `owner/name` or `owner/name@version` → environment spec."""
    doc = read_environment_file(path)
    if not isinstance(doc, dict) or not doc:
        raise InputError(f"{path}: expected a mapping of owner/name[@version] to environments")
    specs = {}
    for key, value in doc.items():
        if not isinstance(key, str) or not re.fullmatch(r"[\w.-]+/[\w.-]+(@\S+)?", key):
            raise InputError(f"{path}: {key!r} is not owner/name or owner/name@version")
        spec = parse_environment(value, f"{path}: {key}")
        if spec is None:
            raise InputError(f"{path}: {key}: an environment is a mapping (python, install)")
        specs[key] = spec
    return specs
