"""Build the `pricing` example repository: a src-layout package with a pinned dependency.

    python examples/pricing/build_repo.py [DEST]   # default: examples/pricing/repos/evalpipe__pricing

`pricing` (under `src/`, so it is importable only once installed) depends on
`centscribe==0.9.0`, an old release whose `fmt` was renamed in 1.0; the wheel is vendored
in `vendor/`, as a repository might pin a dependency that its index no longer serves.
Neither is in evalpipe's own venv: the tests can only run in the repository's own
environment (see `environments.yaml`).

At the base commit `total` divides a percentage by 10: `test_discount` fails,
`test_subtotal` and `test_receipt` pass. Author, committer, dates and the wheel's bytes
are fixed, so the base commit's sha is the same on every machine and `instances.jsonl`
can pin it.
"""

from __future__ import annotations

import base64
import hashlib
import io
import shutil
import sys
import zipfile
from pathlib import Path

import git

CENTSCRIBE = {
    "centscribe/__init__.py": '''"""Cents as money. 0.9 API: `fmt(cents, symbol)` (1.0 renamed it `format_cents`)."""

__version__ = "0.9.0"


def fmt(cents, symbol="$"):
    sign = "-" if cents < 0 else ""
    cents = abs(cents)
    return f"{sign}{symbol}{cents // 100}.{cents % 100:02d}"
''',
}

FILES = {
    "pyproject.toml": '''[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "pricing"
version = "0.1.0"
dependencies = ["centscribe==0.9.0"]

[tool.setuptools.packages.find]
where = ["src"]
''',
    "src/pricing/__init__.py": '"""Shopping-cart prices, in cents."""\n',
    "src/pricing/cart.py": '''from centscribe import fmt


def subtotal(prices):
    """The sum of the prices (cents)."""
    return sum(prices)


def total(prices, discount_percent=0):
    """The subtotal less a percentage discount, rounded down to the cent."""
    sub = subtotal(prices)
    return sub - sub * discount_percent // 10


def receipt(prices, discount_percent=0):
    """The total, formatted as money."""
    return fmt(total(prices, discount_percent))
''',
    "tests/test_cart.py": '''from pricing.cart import receipt, subtotal, total


def test_subtotal():
    assert subtotal([250, 199]) == 449


def test_receipt():
    assert receipt([250, 199]) == "$4.49"


def test_discount():
    assert total([1000], 10) == 900
''',
    "README.md": "# pricing\n\n`total([1000], 10)` returns 0. A 10% discount should give 900.\n",
}

ACTOR = git.Actor("evalpipe example", "example@evalpipe.invalid")
DATE = "2024-01-01T00:00:00+0000"


def make_wheel(name: str, version: str, files: dict[str, str | bytes]) -> tuple[str, bytes]:
    """A pure-Python wheel (file name, bytes) holding `files`, byte-for-byte reproducible."""
    dist = f"{name}-{version}.dist-info"
    contents = {path: text.encode() if isinstance(text, str) else text for path, text in files.items()}
    contents.setdefault(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode())
    contents.setdefault(
        f"{dist}/WHEEL",
        b"Wheel-Version: 1.0\nGenerator: evalpipe-example\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    )
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in contents.items()
    ]
    contents[f"{dist}/RECORD"] = ("\n".join([*record, f"{dist}/RECORD,,"]) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as whl:
        for path, data in contents.items():
            info = zipfile.ZipInfo(path, date_time=(2024, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            whl.writestr(info, data)
    return f"{name}-{version}-py3-none-any.whl", buffer.getvalue()


def build(dest: Path, extra: dict[str, str | bytes] | None = None) -> str:
    """Create the repository at `dest` (replacing it) and return the base commit sha.
    `extra` adds files (tests use it for more checks and vendored wheels)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    repo = git.Repo.init(dest, initial_branch="main")
    wheel_name, wheel = make_wheel("centscribe", "0.9.0", CENTSCRIBE)
    files = {**FILES, f"vendor/{wheel_name}": wheel, **(extra or {})}
    for name, data in files.items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            (dest / name).write_bytes(data)
        else:
            (dest / name).write_text(data)
    repo.index.add(sorted(files))
    commit = repo.index.commit(
        "pricing: cart totals", author=ACTOR, committer=ACTOR, author_date=DATE, commit_date=DATE
    )
    return commit.hexsha


# ---- an offline variant (the tests and bench/env_grading.py): pytest vendored too, as
# wheels made from this venv's installed copies, and the src directory put on the path as
# an editable install would (a real `pip install -e .` needs setuptools' wheel support,
# which comes from the index).
PYTEST_DISTS = ("pytest", "iniconfig", "packaging", "pluggy", "pygments")
OFFLINE_ENVIRONMENT = {
    "install": [
        "pip install --no-index --find-links vendor centscribe==0.9.0 " + " ".join(PYTEST_DISTS),
        "python -c 'import os, site; open(site.getsitepackages()[0] + \"/pricing.pth\", \"w\")"
        ".write(os.getcwd() + \"/src\\n\")'",
    ]
}


def wheel_of_installed(dist_name: str) -> tuple[str, bytes]:
    """A wheel of an installed distribution (its files and metadata, as installed)."""
    import importlib.metadata

    dist = importlib.metadata.distribution(dist_name)
    skip = ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")
    files = {
        str(f): f.locate().read_bytes()
        for f in dist.files
        if not str(f).startswith("..") and "__pycache__" not in str(f) and Path(str(f)).name not in skip
    }
    info = next(p for p in files if p.endswith(".dist-info/METADATA"))  # its own spelling
    name = info.split("/")[0].removesuffix(f"-{dist.version}.dist-info")
    return make_wheel(name, dist.version, files)


def build_offline(dest: Path, extra: dict[str, str | bytes] | None = None) -> str:
    """The repository with pytest's wheels in vendor/ too (for OFFLINE_ENVIRONMENT)."""
    wheels = dict(wheel_of_installed(d) for d in PYTEST_DISTS)
    return build(dest, {**{f"vendor/{n}": w for n, w in wheels.items()}, **(extra or {})})


if __name__ == "__main__":
    target = (
        Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "repos" / "evalpipe__pricing"
    )
    print(build(target))
