"""The tools an `openai:` agent gets with `--workspace` (docs/agents.md "Tools"): `bash`,
`read_file`, `write_file` and `edit` in the sample's checkout, so that a coding agent over any
OpenAI-compatible model needs no code of the user's.

`bash` runs in the sandbox as a workspace agent's command does (the checkout its working
directory, no network, no key of the harness's); the file tools run in the harness on paths
inside the checkout only: a path that is absolute, climbs out with `..`, or resolves through a
link to anything outside the checkout is an error the model sees. `edit` is the exact
search/replace of the suite's patches: the text must occur exactly once, else nothing changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.agents.toolbox import ToolFailed
from tasks.tools import ToolDef

BASH_OUTPUT_CHARS = 16_000  # of a command's stdout and of its stderr, each, sent back


def _object(**properties: str) -> dict[str, Any]:
    return {"type": "object", "properties": {name: {"type": "string", "description": text}
                                             for name, text in properties.items()},
            "required": list(properties)}


WORKSPACE_TOOLS = (
    ToolDef("bash", "Run a shell command in the repository's checkout (the working directory). Returns its"
                    " exit status, stdout and stderr. No network.", _object(command="the command, run by /bin/sh")),
    ToolDef("read_file", "Read a file of the checkout.", _object(path="the file's path, relative to the checkout")),
    ToolDef("write_file", "Create or overwrite a file of the checkout with the given content.",
            _object(path="the file's path, relative to the checkout", content="the whole new content")),
    ToolDef("edit", "Replace the one exact occurrence of `search` in a file of the checkout with `replace`."
                    " Fails, changing nothing, when `search` occurs zero times or more than once.",
            _object(path="the file's path, relative to the checkout", search="the exact text to replace",
                    replace="the text to put in its place")),
)


def workspace_handlers(tree: Path, bash: Callable[[str], tuple[int | str, str, str]],
                       max_file_bytes: int) -> dict[str, Callable[[dict[str, Any]], str]]:
    """The handlers of `WORKSPACE_TOOLS` for the checkout at `tree`; `bash(command)` runs a
    command in the sandbox and gives (status, stdout, stderr)."""
    root = Path(os.path.realpath(tree))

    def inside(path: str) -> Path:
        if not path or os.path.isabs(path):
            raise ToolFailed(f"{path!r}: give a path relative to the checkout")
        resolved = Path(os.path.realpath(root / path))
        if resolved != root and root not in resolved.parents:
            raise ToolFailed(f"{path!r} is outside the checkout")
        return resolved

    def run(args: dict[str, Any]) -> str:
        status, out, err = bash(args["command"])
        return f"exit status {status}\n--- stdout\n{out[-BASH_OUTPUT_CHARS:]}\n--- stderr\n{err[-BASH_OUTPUT_CHARS:]}"

    def read(args: dict[str, Any]) -> str:
        path = inside(args["path"])
        if not path.is_file():
            raise ToolFailed(f"{args['path']!r}: no such file")
        return path.read_text(encoding="utf-8", errors="replace")

    def write(args: dict[str, Any]) -> str:
        path, content = inside(args["path"]), args["content"]
        if len(content.encode("utf-8")) > max_file_bytes:
            raise ToolFailed(f"{args['path']!r}: {len(content):,} characters, over the {max_file_bytes:,}-byte cap")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
        return f"wrote {args['path']} ({len(content)} characters)"

    def edit(args: dict[str, Any]) -> str:
        path = inside(args["path"])
        if not path.is_file():
            raise ToolFailed(f"{args['path']!r}: no such file")
        text = path.read_text(encoding="utf-8")
        found = text.count(args["search"]) if args["search"] else 0
        if found != 1:
            raise ToolFailed(f"{args['path']!r}: the search text occurs {found} times (exactly once is needed);"
                             " nothing changed")
        path.write_text(text.replace(args["search"], args["replace"], 1), encoding="utf-8")
        return f"edited {args['path']}"

    return {"bash": run, "read_file": read, "write_file": write, "edit": edit}
