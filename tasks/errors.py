"""The two failures the command line reports as one line: bad input (exit 2) and a failing
machine (exit 3). Here, below every stage, so the registry can raise them too."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input from the user (a file, a flag, a reference). The CLI prints the message
    as one line and exits 2; the message must name what is wrong and where."""


class PlatformError(RuntimeError):
    """The machine, not the input, failed: a database locked past the wait or damaged, a
    full disk, a server that did not start. The CLI prints the message as one line and
    exits 3; the message must name what failed and what to do."""
