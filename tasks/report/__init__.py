"""The run report: self-contained HTML (`render_report`) and the markdown summary Prefect
artifacts show (`summary_markdown`), both read from a stored `RunSummary`."""

from tasks.report.html import render_report, slices_table, summary_markdown

__all__ = ["render_report", "slices_table", "summary_markdown"]
