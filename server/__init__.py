"""Prefect servers evalpipe starts and keeps: the managed one of an EVALPIPE_HOME (started on
first use, reused, stopped when idle), `evalpipe server` in the foreground, Prefect's
temporary server started with our timeout and reaper. Process management only: which API a
command talks to, and the flows, are `flows/`'s business."""
