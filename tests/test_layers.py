"""The layers of docs/architecture.md: the core (`tasks`) never imports storage, the flows,
the server management or Prefect; the server management (`server`) imports only the core;
and no module of ours is part of an import cycle."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tasks", "storage", "service", "flows", "server")


def modules(package: str) -> list[str]:
    return sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / package).rglob("*.py")
    )


def test_importing_every_core_module_leaves_out_storage_flows_server_and_prefect():
    probe = (
        "import importlib, json, sys\n"
        f"for name in {modules('tasks')!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('storage', 'flows', 'server', 'prefect'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def _imports(module: str) -> set[str]:
    """Our modules that `module` imports, at any depth of its code (function-level too)."""
    path = ROOT / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n for n in names if n.split(".")[0] in PACKAGES}
    return found


def test_the_server_management_imports_only_the_core():
    """`server` starts and stops processes; which API a command uses, and the flows, are
    `flows`' business: it may use `server`, never the other way round."""
    ours = {d for m in modules("server") for d in _imports(m)}
    assert {d.split(".")[0] for d in ours} <= {"server", "tasks"}, sorted(ours)


def test_the_run_service_imports_the_core_and_storage_only():
    """`service` (one run from its prepared configuration to its stored decision) is what the
    flows and the Python API adapt: it never imports them, nor Prefect."""
    ours = {d for m in modules("service") for d in _imports(m)}
    assert {d.split(".")[0] for d in ours} <= {"service", "storage", "tasks"}, sorted(ours)
    probe = ("import json, sys, service.run\n"
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'flows', 'prefect', 'server'})))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_no_import_cycles():
    known = {m for p in PACKAGES for m in modules(p)}
    graph = {m: {i for i in _imports(m) if i in known and i != m} for m in known}
    # A package's own __init__ importing its submodules (the grader registry) is not a cycle.
    for m, deps in graph.items():
        deps -= {d for d in deps if d.startswith(m + ".")}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, "import cycle: " + " -> ".join([*path, m, d])
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


# The core's stages, bottom first (docs/architecture.md). A module may import its own stage
# and the stages below it, never one above: the folders read in the order a sample flows.
STAGES = (
    (
        "tasks.errors",
        "tasks.registry",
        "tasks.models",
        "tasks.verdict",
        "tasks.trace",
        "tasks.trajectory",
        "tasks.tools",
        "tasks.params",
        "tasks.home",
        "tasks.settings",
        "tasks.callables",
        "tasks.redaction",
        "tasks.fences",
        "tasks.files",
    ),
    ("tasks.sandbox",),
    ("tasks.repos",),
    ("tasks.suites",),
    ("tasks.agents",),
    ("tasks.graders",),
    ("tasks.metrics",),
    ("tasks.run",),
    ("tasks.report",),
)


def _stage(module: str) -> int:
    for level, names in enumerate(STAGES):
        if any(module == n or module.startswith(n + ".") for n in names):
            return level
    raise AssertionError(f"{module} is in no stage of STAGES: place it in docs/architecture.md and here")


def test_core_imports_point_down_the_stages():
    known = set(modules("tasks")) - {"tasks"}
    upward = [
        f"{m} (stage {_stage(m)}) imports {d} (stage {_stage(d)})"
        for m in sorted(known)
        for d in sorted(_imports(m) & known)
        if _stage(d) > _stage(m)
    ]
    assert upward == []


def test_the_command_line_loads_no_heavy_library_before_a_command_needs_it():
    """`evalpipe --help`, `suite hash` and a bad-input exit 2 stay fast: Prefect, DuckDB,
    Arrow, NumPy, Jinja and the openai SDK are imported inside the commands that use them."""
    heavy = ("prefect", "duckdb", "pyarrow", "numpy", "jinja2", "openai")
    probe = f"import json, sys, flows.cli; print(json.dumps([m for m in {heavy!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
