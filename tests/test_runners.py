"""The task runners a run's stages run on (`flows.runners`): their workers talk to the
caller's Prefect API, and the caller's settings come back after."""

from __future__ import annotations


def test_worker_processes_get_the_callers_api_and_the_process_gets_its_settings_back(monkeypatch):
    """Dask's workers read the environment and Prefect's global settings, not the caller's
    context: both name the caller's API for the mapping, and are as they were after it."""
    import os

    import prefect.context
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.runners import _api_for_workers

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("PREFECT_API_AUTH_STRING", raising=False)
    before = prefect.context.GLOBAL_SETTINGS_CONTEXT
    api = {PREFECT_API_URL: "http://127.0.0.1:9/api", PREFECT_API_AUTH_STRING: "evalpipe:secret"}
    with temporary_settings(updates=api), _api_for_workers("dask"):
        assert (os.environ["PREFECT_API_URL"], os.environ["PREFECT_API_AUTH_STRING"]) == (
            "http://127.0.0.1:9/api", "evalpipe:secret")
        assert prefect.context.GLOBAL_SETTINGS_CONTEXT.settings.api.url == "http://127.0.0.1:9/api"
    assert prefect.context.GLOBAL_SETTINGS_CONTEXT is before
    assert "PREFECT_API_URL" not in os.environ and "PREFECT_API_AUTH_STRING" not in os.environ


DASK_PROBE = '''
import subprocess
import sys

ATTACK = """
import sys
from distributed import Client
from distributed.security import Security

address, marker = sys.argv[1], sys.argv[2]
_, _, hostport = address.partition("://")
for url, security in (("tcp://" + hostport, None), ("tls://" + hostport, Security.temporary())):
    try:
        with Client(url, security=security, timeout=5) as client:
            client.run(lambda: open(marker, "w").write("ran"))  # on every worker, beside its tasks
            print("ran", end=" ")
    except Exception:
        print("refused", end=" ")
"""


def probe(inputs, ctx):
    """What a process on the machine gets from the run's own Dask scheduler: a client
    without the cluster's credentials, plain or with TLS of its own making."""
    from distributed import get_worker

    address = get_worker().scheduler.address
    proc = subprocess.run([sys.executable, "-c", ATTACK, address, inputs["marker"]], capture_output=True,
                          text=True, timeout=120)
    return address.partition("://")[0] + " " + proc.stdout.strip()
'''


def test_the_local_dask_cluster_takes_no_client_without_its_credentials(prefect_harness, home, tmp_path):
    """Issue 33: an agent reached the run's local Dask scheduler on 127.0.0.1 (no TLS, no
    auth) and had a worker write a file. The cluster now speaks TLS with credentials of its
    own: the run works, a client without them is refused, and nothing runs."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    (tmp_path / "probe.py").write_text(DASK_PROBE)
    marker = tmp_path / "written-by-the-agent"
    suite = tmp_path / "probe.jsonl"
    suite.write_text(json.dumps({"id": "p", "inputs": {"marker": str(marker)}, "reference": "tls refused refused",
                                 "grader": {"kind": "exact"}}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(suite), "--agent",
                           f"python:{tmp_path / 'probe.py'}:probe", "--runner", "dask", "--workers", "1", "--json"],
                          cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["status_counts"] == {"passed": 1}, proc.stdout
    assert not marker.exists()


def test_two_local_dask_clusters_at_once_warn_nothing_and_serve_http_on_loopback_only(recwarn):
    """Each cluster's scheduler serves HTTP (health, metrics) even without a dashboard: on
    Dask's fixed 8787 the second of two runs at once warned 'Port 8787 is already in use'."""
    from distributed import LocalCluster

    from flows.runners import _make

    kwargs = {**_make("dask", 1, None).cluster_kwargs, "processes": False}
    with LocalCluster(**kwargs) as first, LocalCluster(**kwargs) as second:
        for cluster in (first, second):
            hosts = {sock.getsockname()[0] for sock in cluster.scheduler.http_server._sockets.values()}
            assert hosts == {"127.0.0.1"}
    assert [str(w.message) for w in recwarn if "in use" in str(w.message)] == []
