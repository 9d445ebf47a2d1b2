"""What a run cost (issue 19): agent latency and tokens per sample, priced by genai-prices or
a user price file, summed apart for drawn and cached samples; and budgets that stop a run
`partial` (exit 6) and a resume that draws only the rest."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import test_cache_levels
from support.cli import as_process
from support.judges import ChatServer
from test_cache_levels import cli
from test_evaluate import AGENTS, calls

from tasks.agents import AgentContext, AgentError, load_agent
from tasks.models import EvalCase

env = test_cache_levels.env  # the fixture: a Prefect API, a fresh home, a call log, no price file


def suite(path: Path, cases: int) -> Path:
    path.write_text("name: toy\ncases:\n" + "".join(
        f"  - {{id: q{i}, inputs: {{prompt: 'question {i}', p: 0.5}}, reference: 'yes', grader: {{kind: exact}}}}\n"
        for i in range(cases)))
    return path


def test_tokens_and_cost_of_an_openai_compatible_endpoint(env, tmp_path):
    from genai_prices import Usage, calc_price

    usage = {"prompt_tokens": 1200, "completion_tokens": 300, "total_tokens": 1500}
    path = suite(tmp_path / "toy.yaml", 2)
    with ChatServer(lambda body: (200, "yes"), usage=usage, model="gpt-4o-mini-2024-07-18") as server:
        env = {**env, "OPENAI_BASE_URL": server.url}
        proc = cli(["run", str(path), "--agent", "openai:gpt-4o-mini", "-n", "2", "--json"], env)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)["usage"]
        one = float(calc_price(Usage(input_tokens=1200, output_tokens=300), "gpt-4o-mini-2024-07-18").total_price)
        assert one > 0
        assert doc["samples"] == 4 and doc["input_tokens"] == 4800 and doc["output_tokens"] == 1200
        assert doc["cost_usd"] == pytest.approx(4 * one, rel=1e-5) and doc["cost_note"] is None
        assert doc["latency_p50_s"] > 0 and doc["latency_p95_s"] >= doc["latency_p50_s"]
        assert doc["cached"]["samples"] == 0

        # The same run again: nothing drawn, nothing spent; the cache saved the whole bill.
        again = json.loads(cli(["run", str(path), "--agent", "openai:gpt-4o-mini", "-n", "2", "--json"], env).stdout)
        assert len(server.requests) == 4
        assert again["usage"]["samples"] == 0 and again["usage"]["cost_usd"] == 0
        assert again["usage"]["cached"]["cost_usd"] == pytest.approx(4 * one, rel=1e-5)
        assert again["usage"]["cached"]["input_tokens"] == 4800

    # A model no price table knows: no made-up number, and the reason; a price file prices it.
    with ChatServer(lambda body: (200, "yes"), usage=usage, model="acme-local-7b") as server:
        env = {**env, "OPENAI_BASE_URL": server.url}
        proc = cli(["run", str(path), "--agent", "openai:acme-local-7b", "--json"], env)
        doc = json.loads(proc.stdout)["usage"]
        assert doc["input_tokens"] == 2400 and doc["cost_usd"] is None
        assert "acme-local-7b" in doc["cost_note"] and "no price" in doc["cost_note"]
        text = cli(["runs", "show", json.loads(proc.stdout)["run_id"]], env).stdout
        assert "cost n/a" in text and "acme-local-7b" in text

        prices = tmp_path / "prices.yaml"
        prices.write_text("acme-local-7b: {input_per_mtok: 2.0, output_per_mtok: 10.0}\n")
        proc = cli(["run", str(path), "--agent", "openai:acme-local-7b?temperature=0.5", "--prices", str(prices),
                    "--json"], env)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["usage"]["cost_usd"] == pytest.approx(2 * (1200 * 2.0 + 300 * 10.0) / 1e6)


def test_a_bad_price_file_is_bad_input_before_any_call(env, tmp_path):
    prices = tmp_path / "prices.yaml"
    prices.write_text("toy-model: {input_per_mtok: -1, output_per_mtok: 0}\n")
    proc = cli(["run", str(suite(tmp_path / "toy.yaml", 1)), "--agent", f"python:{AGENTS}:metered",
                "--prices", str(prices)], env)
    assert proc.returncode == 2 and "toy-model" in proc.stderr and str(prices) in proc.stderr
    assert calls(Path(env["EVALPIPE_TEST_CALLS"])) == []


def test_a_cmd_agent_reports_usage_through_its_usage_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, sys\n"
        "case = json.load(sys.stdin)\n"
        "doc = {'input_tokens': 7 * case['index'] + 1, 'output_tokens': 2, 'model': 'gpt-4o-mini'}\n"
        "if case['inputs'].get('bad'): doc = {'input_tokens': 'many'}\n"
        "open(os.environ['EVALPIPE_USAGE_FILE'], 'w').write(json.dumps(doc))\n"
        "print('yes')\n")
    agent = load_agent(f"cmd:{sys.executable} agent.py")
    ctx = AgentContext(case_id="c", index=2, seed=1, n=3)
    assert agent.generate(EvalCase(id="c", inputs={}, grader={"kind": "exact"}), ctx).strip() == "yes"
    assert ctx.reported == {"input_tokens": 15, "output_tokens": 2, "model": "gpt-4o-mini"}
    with pytest.raises(AgentError, match="EVALPIPE_USAGE_FILE"):
        agent.generate(EvalCase(id="c", inputs={"bad": True}, grader={"kind": "exact"}),
                       AgentContext(case_id="c", index=0, seed=1, n=1))


def test_a_python_agent_reports_usage_through_ctx_and_a_bad_report_fails_its_sample(tmp_path):
    from tasks.run.sampling import draw_sample, plan_samples
    from tasks.suites.dataset import load_suite

    (tmp_path / "agent.py").write_text(
        "def good(inputs, ctx):\n    ctx.report_usage(input_tokens=5, output_tokens=1, model='m')\n    return 'yes'\n"
        "def bad(inputs, ctx):\n    ctx.report_usage(input_tokens=-5)\n    return 'yes'\n")
    toy = load_suite(suite(tmp_path / "toy.yaml", 1))
    planned = plan_samples(toy, "fp", 1, 0)[0]
    good = draw_sample(load_agent(f"python:{tmp_path}/agent.py:good"), toy.cases[0], planned, 1)
    assert (good.usage.input_tokens, good.usage.output_tokens, good.usage.model) == (5, 1, "m")
    assert good.usage.latency_s is not None and good.usage.latency_s >= 0
    bad = draw_sample(load_agent(f"python:{tmp_path}/agent.py:bad"), toy.cases[0], planned, 1)
    assert bad.verdict.status == "agent_error" and "input_tokens" in bad.verdict.detail


def test_a_budget_stops_the_run_partial_and_a_larger_one_draws_only_the_rest(env, tmp_path):
    path = suite(tmp_path / "toy.yaml", 4)
    prices = tmp_path / "prices.yaml"
    prices.write_text("toy-model: {input_per_mtok: 1000, output_per_mtok: 0}\n")  # $1 a call
    log = Path(env["EVALPIPE_TEST_CALLS"])
    base = ["run", str(path), "--agent", f"python:{AGENTS}:metered", "-n", "2", "--workers", "1",
            "--prices", str(prices), "--json"]

    proc = cli([*base, "--max-cost", "3"], env)
    assert proc.returncode == 6, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["partial"] is True and doc["undrawn_samples"] == 5 and doc["samples"] == 3
    assert doc["budget"]["spent_usd"] == pytest.approx(3.0) and "--max-cost 3" in doc["budget"]["stopped"]
    assert sorted(calls(log)) == ["q0#0", "q1#0", "q2#0"]  # sample 0 of every case first
    assert "5 samples undrawn" in proc.stderr and "Traceback" not in proc.stderr
    from storage.store import Store

    assert Store.default().runs.get(doc["run_id"])["status"] == "partial"

    proc = cli([*base, "--max-samples", "2"], env)
    assert proc.returncode == 6
    doc = json.loads(proc.stdout)
    assert (doc["cached_samples"], doc["undrawn_samples"], doc["usage"]["samples"]) == (3, 3, 2)
    assert "--max-samples 2" in doc["budget"]["stopped"]

    proc = cli([*base, "--max-cost", "100"], env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert "partial" not in doc and doc["samples"] == 8 and doc["cached_samples"] == 5
    assert doc["usage"]["cost_usd"] == pytest.approx(3.0) and doc["usage"]["cached"]["cost_usd"] == pytest.approx(5.0)
    assert len(calls(log)) == 8 and len(set(calls(log))) == 8  # every sample drawn once in all
    assert Store.default().runs.get(doc["run_id"])["status"] == "completed"


def test_a_price_file_given_later_prices_the_cached_samples_of_an_unpriced_model(env, tmp_path):
    path = suite(tmp_path / "toy.yaml", 3)
    base = ["run", str(path), "--agent", f"python:{AGENTS}:metered", "-n", "2", "--workers", "1", "--json"]
    first = json.loads(cli(base, env).stdout)
    assert first["usage"]["cost_usd"] is None and "toy-model" in first["usage"]["cost_note"]
    prices = tmp_path / "prices.yaml"
    prices.write_text("toy-model: {input_per_mtok: 1000, output_per_mtok: 0}\n")  # $1 a call
    again = cli([*base, "--prices", str(prices)], env)
    assert again.returncode == 0, again.stderr
    cached = json.loads(again.stdout)["usage"]["cached"]
    assert cached["samples"] == 6 and cached["cost_usd"] == pytest.approx(6.0) and cached["cost_note"] is None


def test_a_cost_budget_that_cannot_be_measured_stops_the_run(env, tmp_path):
    """No price for the agent's model: spending cannot be kept under a limit, so the run
    stops after the first call rather than spending blind."""
    proc = cli(["run", str(suite(tmp_path / "toy.yaml", 3)), "--agent", f"python:{AGENTS}:metered",
                "--workers", "1", "--max-cost", "10", "--json"], env)
    assert proc.returncode == 6
    doc = json.loads(proc.stdout)
    assert doc["samples"] == 1 and "no known cost" in doc["budget"]["stopped"]


def _rows(*samples: tuple):
    """Sample rows from (cached, input_tokens, output_tokens, model, cost_usd, latency_s)."""
    import pyarrow as pa

    from tasks.run.samples import SAMPLE_SCHEMA

    cols = {name: [None] * len(samples) for name in SAMPLE_SCHEMA.names}
    for key, i in (("cached", 0), ("input_tokens", 1), ("output_tokens", 2), ("usage_model", 3), ("cost_usd", 4),
                   ("latency_s", 5)):
        cols[key] = [s[i] for s in samples]
    return pa.table(cols, schema=SAMPLE_SCHEMA)


def test_usage_figures_never_make_up_a_cost():
    from tasks.run.usage import usage_summary

    mixed = usage_summary(_rows((False, 100, 10, "m", 0.5, 1.0), (False, None, None, None, None, 3.0),
                                (True, 50, 5, "m", 0.25, 2.0)))
    assert (mixed.samples, mixed.input_tokens, mixed.output_tokens, mixed.cost_usd) == (2, 100, 10, 0.5)
    assert mixed.cost_note == "1 sample(s) reported no tokens and are not counted"
    assert (mixed.latency_p50_s, mixed.latency_p95_s) == (2.0, pytest.approx(2.9))
    assert (mixed.cached.samples, mixed.cached.cost_usd, mixed.cached.cost_note) == (1, 0.25, None)

    unpriced = usage_summary(_rows((False, 100, 10, "m", 0.5, 1.0), (False, 100, 10, "acme-x", None, 1.0)))
    assert unpriced.cost_usd is None and "'acme-x'" in unpriced.cost_note and unpriced.input_tokens == 200
    silent = usage_summary(_rows((False, None, None, None, None, 1.0)))
    assert silent.input_tokens is None and silent.cost_usd is None and "no sample reported" in silent.cost_note
    nothing = usage_summary(_rows((True, None, None, None, None, 1.0)))
    assert (nothing.samples, nothing.input_tokens, nothing.cost_usd) == (0, 0, 0.0)


def test_usage_partial_and_unscored_show_in_the_report_and_the_artifact():
    from tasks.report import render_report, summary_markdown
    from tasks.run.summary import BudgetSummary, RunSummary
    from tasks.run.usage import usage_summary

    summary = RunSummary(
        run_id="r1", suite_version="v" * 64, suite_name="toy", agent="a", n=1, cases=1, samples=1,
        cached_samples=0, pass_at_k={"1": 1.0}, pass_at_k_notes={}, pass_at_1_ci=[1.0, 1.0], ci_level=0.95,
        pass_at_1_se=None, slices={}, flaky_cases=0, flaky_case_ids=[], status_counts={"passed": 1},
        safety_failed=False, safety_violations=[], duration_s=1.0, source_run="r0", unscored=["zeta"],
        usage=usage_summary(_rows((False, 1234, 56, "m", 0.0123, 0.5))), partial=True, undrawn_samples=7,
        budget=BudgetSummary(max_cost_usd=0.01, max_samples=None, drawn_samples=1, spent_usd=0.0123,
                             stopped="--max-cost 0.01 spent"))
    markdown = summary_markdown(summary)
    assert "**PARTIAL** — 7 samples undrawn" in markdown and "--max-cost 0.01 spent" in markdown
    assert "tokens 1,234 in, 56 out" in markdown and "$0.012300" in markdown and "zeta" in markdown
    html = render_report(summary, [])
    assert 'id="partial"' in html and 'id="usage"' in html and "1,234" in html and "zeta" in html


@pytest.mark.parametrize(("latency", "shown"), [(0.000023, "23µs"), (0.0123, "12.3ms"), (1.5, "1.5s"),
                                                (0.9996, "1s"), (0.0009996, "1ms"), (12.345, "12.3s"),
                                                (1234.5, "1,234.5s")])
def test_latency_reads_in_a_unit_that_fits(latency, shown):
    from tasks.run.usage import usage_lines, usage_summary

    line = usage_lines(usage_summary(_rows((False, 100, 10, "m", 0.5, latency))))[0]
    assert f"agent latency p50 {shown} p95 {shown}" in line and "e-0" not in line and "e+0" not in line


# Issue 33, item 5: usage counts beyond what a sample's BIGINT column holds, and prices that
# are not finite numbers. Each was a crash (OverflowError, nothing stored, every retry paying
# again) or a budget bypass (0 tokens x inf = NaN, never >= --max-cost).
HUGE = 2**64


def test_a_token_count_beyond_int64_from_an_endpoint_is_an_agent_error_stored_once(env, tmp_path):
    path = suite(tmp_path / "toy.yaml", 1)
    usage = {"prompt_tokens": HUGE, "completion_tokens": 1, "total_tokens": HUGE + 1}
    with ChatServer(lambda body: (200, "yes"), usage=usage, model="gpt-4o-mini") as server:
        run_env = {**env, "OPENAI_BASE_URL": server.url}
        proc = as_process(["run", str(path), "--agent", "openai:gpt-4o-mini", "--json"], run_env)  # its stderr whole
        assert proc.returncode == 4, proc.stderr  # a run whose agent is broken (exit 4), not a crash
        assert "OverflowError" not in proc.stderr and "Traceback" not in proc.stderr
        doc = json.loads(proc.stdout)
        assert len(server.requests) == 1
    assert doc["status_counts"] == {"agent_error": 1}
    text = cli(["runs", "show", doc["run_id"], "--case", "q0"], run_env).stdout
    assert "agent_error" in text and "input_tokens" in text and "9223372036854775807" in text


@pytest.mark.parametrize("count", [HUGE, 2**63, -1])
def test_a_token_count_outside_int64_from_ctx_or_the_usage_file_is_an_agent_error(tmp_path, monkeypatch, count):
    from tasks.run.sampling import draw_sample, plan_samples
    from tasks.suites.dataset import load_suite

    monkeypatch.chdir(tmp_path)
    (tmp_path / "agent.py").write_text(
        f"def huge(inputs, ctx):\n    ctx.report_usage(input_tokens={count}, model='gpt-4o-mini')\n    return 'yes'\n")
    (tmp_path / "cmd_agent.py").write_text(
        "import json, os\n"
        f"open(os.environ['EVALPIPE_USAGE_FILE'], 'w').write(json.dumps({{'output_tokens': {count}}}))\n"
        "print('yes')\n")
    toy = load_suite(suite(tmp_path / "toy.yaml", 1))
    planned = plan_samples(toy, "fp", 1, 0)[0]
    for spec in (f"python:{tmp_path}/agent.py:huge", f"cmd:{sys.executable} cmd_agent.py"):
        sample = draw_sample(load_agent(spec), toy.cases[0], planned, 1)
        assert sample.verdict.status == "agent_error", spec
        assert "tokens" in sample.verdict.detail and "\n" not in sample.verdict.detail
        assert sample.usage.input_tokens is None and sample.usage.output_tokens is None


def test_the_largest_count_a_sample_holds_is_stored_and_priced(tmp_path):
    from tasks.metrics.cost import PriceTable
    from tasks.models import Usage
    from tasks.run.usage import priced

    top = 2**63 - 1
    usage = priced(Usage(input_tokens=top, output_tokens=top, model="m"),
                   PriceTable.load(_prices(tmp_path, "m: {input_per_mtok: 1, output_per_mtok: 1}")))
    assert usage.cost_usd == pytest.approx(2 * top / 1e6)


def _prices(tmp_path: Path, text: str, name: str = "prices.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("entry", [".inf", ".nan", "-.inf", "1e400"])
def test_a_price_file_with_a_non_finite_price_is_bad_input_naming_the_file_and_model(env, tmp_path, entry):
    prices = _prices(tmp_path, f"toy-model: {{input_per_mtok: {entry}, output_per_mtok: 0}}\n")
    proc = cli(["run", str(suite(tmp_path / "toy.yaml", 1)), "--agent", f"python:{AGENTS}:metered",
                "--prices", str(prices), "--max-cost", "1"], env)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and str(prices) in line and "toy-model" in line and "finite" in line
    assert calls(Path(env["EVALPIPE_TEST_CALLS"])) == []


def test_a_json_price_file_with_infinity_is_refused(tmp_path):
    from tasks.metrics.cost import PriceTable
    from tasks.models import InputError

    path = _prices(tmp_path, '{"m": {"input_per_mtok": Infinity, "output_per_mtok": 0}}', "prices.json")
    with pytest.raises(InputError, match="finite"):
        PriceTable.load(path)


def test_a_cost_that_overflows_is_unknown_and_stops_a_budget(tmp_path):
    """Finite prices times counts that fit can still overflow a float: the cost is unknown
    (with the reason), never inf or NaN, and a budget that cannot be measured stops."""
    from tasks.metrics.cost import PriceTable
    from tasks.run.budget import Budget, Meter

    table = PriceTable.load(_prices(tmp_path, "m: {input_per_mtok: 1.0e+300, output_per_mtok: 1.0e+300}\n"))
    cost, why = table.cost("m", 2**63 - 1, 0)
    assert cost is None and "finite" in why
    meter = Meter(Budget(max_cost_usd=1.0))
    meter.add([cost])
    assert meter.stopped
