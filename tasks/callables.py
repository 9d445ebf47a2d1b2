"""Load a user's Python callable named `module:function` or `path/to/file.py:function`.

The `python:` agent uses it in the harness; `predicate` and a suite's `judge` inside the
sandbox (`tasks.graders.predicate_host`), since a suite is not trusted, or a judge the
machine allows (`EVALPIPE_HARNESS_JUDGES`) in the harness, scoped (below). Besides the
callable it returns the sha256 of the source file, because a change to the user's code must
change every cache key that depends on it.

Import rules, chosen to match what a user running a script from the project root expects:
- `module:function` is imported with the base directory (the working directory by default;
  a suite's callables pass the suite file's directory) on `sys.path`, so a module beside the suite imports even under the `evalpipe` script.
- `file.py:function` is executed as a module of its own, named after its path and content:
  loading the same file twice is free, and an edited file is loaded afresh.
- A callable a suite names (`own_code_only`: a suite is not trusted) is checked before
  anything is imported, then loaded scoped: its file run as a module of its own, the
  suite's folder on `sys.path` only while it runs and after every other entry, and the
  modules of the suite's files it imported dropped from `sys.modules` after. Loaded or
  refused, it leaves `sys.path` as it was and no module of the suite's in `sys.modules`: no
  later import of the harness finds the suite's files.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from tasks.models import InputError, sha256_hex


@dataclass(frozen=True)
class UserCallable:
    ref: str
    func: Callable[..., Any]
    source: Path | None  # the file the function comes from (None for built-in modules)
    code_sha256: str  # sha256 of that file's bytes; "" when there is no file


# Modules imported by name, with the hash of their file when imported: an edited module is
# reloaded so that the code that runs is the code that was hashed.
_module_hashes: dict[str, str] = {}


# A suite's modules loaded scoped, by file and content: never in sys.modules.
_scoped: dict[tuple[Path, str], ModuleType] = {}

# A module sits in sys.modules before its code has run: another thread loading the same
# file at that moment would see it half-initialised. Loading is rare; serialise it.
_LOADING = threading.RLock()


def load_callable(ref: str, base: Path | None = None, *, own_code_only: bool = False) -> UserCallable:
    """Resolve `ref`; raises `InputError` with a one-line message naming what is missing.

    `own_code_only` (a callable named by a suite, which is not trusted): only a module or
    file of the user's own, never a standard-library, installed or built-in callable by
    name (`shutil:rmtree`); checked before anything is imported.
    """
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not name:
        raise InputError(f"{ref!r}: expected MODULE:FUNCTION or path/to/file.py:FUNCTION")
    base = base or Path.cwd()
    is_file = target.endswith(".py") or "/" in target
    with _LOADING:
        if own_code_only:
            module, source, digest = _load_scoped(ref, own_code(ref, base), base)
        elif is_file:
            module, source, digest = _load_file(ref, (base / target).resolve())
        else:
            if str(base.resolve()) not in sys.path:
                sys.path.insert(0, str(base.resolve()))
            module, source, digest = _import_module(ref, target)
    func = getattr(module, name, None)
    if func is None:
        raise InputError(f"{ref!r}: {target} has no attribute {name!r}")
    if not callable(func):
        raise InputError(f"{ref!r}: {target}.{name} is a {type(func).__name__}, not a function")
    return UserCallable(ref=ref, func=func, source=source, code_sha256=digest)


def source_dirs(ref: str, base: Path) -> list[str]:
    """The directories `load_callable(ref, base)` reads from (without importing anything):
    what a sandbox must show for the callable to load there."""
    target = ref.rpartition(":")[0]
    dirs = [str(base.resolve())]
    if target.endswith(".py") or "/" in target:
        dirs.append(str((base / target).resolve().parent))
    return dirs


def _module_file(target: str, base: Path) -> Path | None:
    """The file module `target` would be imported from, `base` first, then `sys.path`:
    found without importing or running anything, nor changing `sys.path`."""
    locations: list[str] | None = [str(base.resolve()), *sys.path]
    spec = None
    for part in target.split("."):
        if locations is None:  # a module, not a package: it has no submodules
            return None
        try:
            spec = importlib.machinery.PathFinder.find_spec(part, locations)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations) if spec.submodule_search_locations is not None else None
    if spec is not None and spec.has_location and spec.origin:
        return Path(spec.origin).resolve()
    return Path(locations[0]).resolve() if locations else None  # a namespace package


def own_code(ref: str, base: Path) -> Path:
    """The file of a callable a suite names, if it is the user's own code (not the standard
    library's, an installed package's or a built-in); `InputError` otherwise. Nothing is
    imported or run."""
    target = ref.rpartition(":")[0]
    is_file = target.endswith(".py") or "/" in target
    source = (base / target).resolve() if is_file else _module_file(target, base)
    installs = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    if source is None or any(source.is_relative_to(p) for p in installs):
        where = source or "a built-in or missing module"
        raise InputError(f"{ref!r}: a suite may name only its own code, not {where}")
    return source


def _load_scoped(ref: str, path: Path, base: Path) -> tuple[ModuleType, Path, str]:
    """A suite's module (see the module's docstring): run once per file and content."""
    try:
        digest = sha256_hex(path.read_bytes())
    except OSError:  # missing, or a folder (a namespace package): `_load_file` says which
        digest = ""
    if (path, digest) in _scoped:
        return _scoped[(path, digest)], path, digest
    folder = base.resolve()
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    sys.path.append(str(folder))  # its own imports: after everything of the harness's
    try:
        module, _, digest = _load_file(ref, path)
    finally:
        sys.path[:] = saved_path
        # Its module and the suite's files it imported; a library it imported first stays
        # (an extension module cannot be loaded twice).
        for name in set(sys.modules) - saved_modules:
            loaded = sys.modules[name]
            file = getattr(loaded, "__file__", None)
            where = [file] if file else list(getattr(loaded, "__path__", []))  # a namespace package: its folders
            if any(Path(w).resolve() == path or Path(w).resolve().is_relative_to(folder) for w in where):
                del sys.modules[name]
    _scoped[(path, digest)] = module
    return module, path, digest


def _load_file(ref: str, path: Path) -> tuple[ModuleType, Path, str]:
    if not path.is_file():
        raise InputError(f"{ref!r}: no such file {path}")
    try:
        code = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{ref!r}: cannot read {path}: {exc.strerror}") from None
    digest = sha256_hex(code)
    name = f"_evalpipe_user_{sha256_hex(f'{path}:{digest}'.encode())[:16]}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        # Registered before running, as a normal import would be (dataclasses need it).
        sys.modules[name] = module
        try:
            exec(compile(code, str(path), "exec"), module.__dict__)  # noqa: S102 - user's own code
        except BaseException as exc:
            del sys.modules[name]
            if not isinstance(exc, Exception):
                raise
            raise InputError(f"{ref!r}: loading {path} raised {_describe(exc)}") from None
    return module, path, digest


def _import_module(ref: str, target: str) -> tuple[ModuleType, Path | None, str]:
    try:
        module = importlib.import_module(target)
        file = getattr(module, "__file__", None)
        source = Path(file) if file and Path(file).is_file() else None
        code = source.read_bytes() if source is not None else b""
        digest = sha256_hex(code) if source is not None else ""
        if _module_hashes.setdefault(target, digest) != digest:
            # Run the hashed bytes themselves: `importlib.reload` may pick up a stale .pyc
            # when an edit kept the file's size and its second of modification.
            exec(compile(code, str(source), "exec"), module.__dict__)  # noqa: S102
            _module_hashes[target] = digest
    except ModuleNotFoundError as exc:
        raise InputError(f"{ref!r}: no module named {exc.name!r}") from None
    except Exception as exc:
        raise InputError(f"{ref!r}: importing {target} raised {_describe(exc)}") from None
    return module, source, digest


def _describe(exc: BaseException) -> str:
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__
