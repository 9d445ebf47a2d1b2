"""`evalpipe env`: the repository environments under EVALPIPE_HOME/envs/, listed and pruned."""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli.common import JsonFlag, size_text
from flows.output import json_doc

env_app = typer.Typer(no_args_is_help=True, help="Repository environments under EVALPIPE_HOME/envs/.")


@env_app.command("list")
def env_list(as_json: JsonFlag = False) -> None:
    """Built environments with their size and last use."""
    from tasks.repos.environments import list_environments

    rows = list_environments()
    if as_json:
        typer.echo(json_doc(rows))
        return
    for r in rows:
        source = f"{(r['repo'] or '?').rsplit('/', 1)[-1]}@{(r['commit'] or '?')[:12]}"
        typer.echo(f"{r['name']}  {r['status']:<10} {size_text(r['size_bytes']):>9}  last used {r['last_used']}"
                   f"  {source}  python {r['python'] or '?'}")
    if not rows:
        typer.echo("no environments")


@env_app.command("prune")
def env_prune(
    names: Annotated[list[str] | None, typer.Argument(help="Environment names (or prefixes) to remove.")] = None,
    unused_days: Annotated[float | None, typer.Option("--unused-days", min=0, help="Remove those unused this long.")] = None,
    everything: Annotated[bool, typer.Option("--all", help="Remove every environment and the download caches.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Remove environments (incomplete builds always); one in use is skipped."""
    from tasks.repos.environments import prune

    result = prune(names or (), unused_days=unused_days, everything=everything)
    if as_json:
        typer.echo(json_doc(result))
        return
    typer.echo(f"removed {len(result['removed'])}: {', '.join(result['removed']) or '-'}")
    if result["busy"]:
        typer.echo(f"in use, kept: {', '.join(result['busy'])}")
