"""Moved to `service.gate` (the gate's logic lives below the shell); this name is kept while
the CLI's modules are being split, and goes once they import `service.gate`."""

from service.gate import Comparison, decision, gate_comparison, pair_runs, run_gate  # noqa: F401
