"""The task runners a run's stages run on (`flows.runners`): their workers talk to the
caller's Prefect API, and the caller's settings come back after."""

from __future__ import annotations


def test_worker_processes_get_the_callers_api_and_the_process_gets_its_settings_back(monkeypatch):
    """Process and Dask workers, and the thread forwarding their events, read the
    environment and Prefect's global settings, not the caller's context: both name the
    caller's API for the mapping, and are as they were after it."""
    import os

    import prefect.context
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.runners import _api_for_workers

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("PREFECT_API_AUTH_STRING", raising=False)
    before = prefect.context.GLOBAL_SETTINGS_CONTEXT
    api = {PREFECT_API_URL: "http://127.0.0.1:9/api", PREFECT_API_AUTH_STRING: "evalpipe:secret"}
    with temporary_settings(updates=api), _api_for_workers("processes"):
        assert (os.environ["PREFECT_API_URL"], os.environ["PREFECT_API_AUTH_STRING"]) == (
            "http://127.0.0.1:9/api", "evalpipe:secret")
        assert prefect.context.GLOBAL_SETTINGS_CONTEXT.settings.api.url == "http://127.0.0.1:9/api"
    assert prefect.context.GLOBAL_SETTINGS_CONTEXT is before
    assert "PREFECT_API_URL" not in os.environ and "PREFECT_API_AUTH_STRING" not in os.environ
