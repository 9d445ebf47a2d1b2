"""The run service: a run from its prepared configuration to its stored decision (snapshot, the
sandbox's mode, the loop, the reduction, the gate) over one evalpipe home's `Store`, without
Prefect. The shells are adapters of a few lines each: the `evaluate` and `rescore` flows
(`flows/`, with Prefect's task runners and artifacts), `evalpipe.evaluate` and `rescore` (the
Python API, on thread pools), and through the flows the CLI's `run` and `rescore`."""
