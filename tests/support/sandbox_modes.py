"""Run a test in both sandbox modes: `bwrap`, and the rlimits fallback a run may allow
with --unsafe-no-sandbox. Use the `mode` fixture (or `usefixtures("mode")`)."""

from __future__ import annotations

import pytest

from tasks.sandbox import policy as sandbox
from tasks.sandbox import shutdown


def _reset() -> None:
    sandbox._bwrap_problem.cache_clear()
    shutdown()  # idle servers of the other mode


@pytest.fixture(params=["bwrap", "rlimits"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    if request.param == "rlimits":
        monkeypatch.setenv(sandbox.MODE_ENV, "rlimits")
        monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    else:
        monkeypatch.delenv(sandbox.MODE_ENV, raising=False)
        monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    _reset()
    if request.param == "bwrap" and not sandbox.bwrap_available():
        pytest.skip("bubblewrap does not run here")
    yield request.param
    _reset()


def bwrap_only(mode: str, why: str) -> None:
    """Skip, in the fallback, a test of what only bubblewrap holds."""
    if mode != "bwrap":
        pytest.skip(f"only bubblewrap holds this: {why}")
