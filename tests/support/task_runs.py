"""A flow run's task runs as its server holds them. The server records them from the events
the run sends, a moment after the flow run has ended and longer on a loaded machine (read
straight after `evaluate` returned, a server busy with three test workers held only the
snapshot's), so a test reads them until the ones it expects are there and final."""

from __future__ import annotations

from support.waiting import wait_until


def kind(task_run) -> str:
    """A task run's name without its key: "sample q000…", "aggregate-4c8" → sample, aggregate."""
    return task_run.name.replace("-", " ").split(" ")[0]


def task_runs(client, flow_run_id: str, kinds: set[str], timeout_s: float = 60.0) -> list:
    """The task runs of `flow_run_id` on `client`'s server, once at least one of each of
    `kinds` is recorded and every one recorded is in a final state."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    def landed():
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        done = kinds <= {kind(r) for r in runs} and all(r.state and r.state.is_final() for r in runs)
        return (runs,) if done else None  # a tuple: true however few runs it holds

    (runs,) = wait_until(landed, f"task runs {sorted(kinds)} of flow run {flow_run_id}", timeout_s=timeout_s,
                         every_s=0.2)
    return runs
