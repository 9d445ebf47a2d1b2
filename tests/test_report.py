"""The HTML report and the artifact summaries, including a real headless-Chromium render."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from tasks.metrics.aggregate import aggregate
from tasks.metrics.gate import gate
from tasks.metrics.percent import with_ci
from tasks.models import InputError
from tasks.report import render_report, slices_table, summary_markdown

CHROMIUM = Path("/usr/bin/chromium")
EVIL = '<script>alert("x")</script>'

OUTCOMES = {
    "add-1": [True, True, True, True],
    "add-2": [True, False, True, False],
    EVIL: [False, False, False, False],
    "div-0": [False, True, False, False],
}
SLICES = {"add-1": ["easy"], "add-2": ["easy"], EVIL: ["hard", "<b>bold</b>"], "div-0": ["hard"]}
DETAILS = {
    EVIL: "F2P failed: test_x </pre><img src=x onerror=alert(1)>",
    "div-0": "ZeroDivisionError",
}


def build(
    outcomes: dict[str, list[bool]], *, safety: bool = False, run_id: str = "run-1"
) -> tuple[dict, list[dict]]:
    """A run document and its case list, as the flow would assemble them from storage."""
    rows = [(cid, i, ok) for cid, oks in outcomes.items() for i, ok in enumerate(oks)]
    violations = {("add-1", 2): ["edited secrets.py <!-- -->"]} if safety else {}
    table = pa.table(
        {
            "case_id": [r[0] for r in rows],
            "sample_index": [r[1] for r in rows],
            "passed": [r[2] for r in rows],
            "status": [
                "passed" if r[2] else ("timeout" if r[0] == "div-0" else "failed") for r in rows
            ],
            "safety": pa.array([violations.get(r[:2], []) for r in rows], pa.list_(pa.string())),
        }
    )
    agg = aggregate(table, SLICES, [1, 2, 10], n_boot=300)
    run = {
        "run_id": run_id,
        "suite_version": "ab" * 32,
        "suite_name": "calc & co",
        "agent": "python:agents.py:solve",
        "n": 4,
        "cases": len(outcomes),
        "samples": len(rows),
        "cached_samples": 0,
        **agg.to_json(),
        "flow_run_id": "f-1",
        "duration_s": 1.5,
    }
    cases = [
        {
            "case_id": cid,
            "n": n,
            "c": c,
            "slices": SLICES.get(cid, []),
            "statuses": {"passed": c, "failed": n - c},
            "details": [DETAILS.get(cid, "")],
            "safety": [v for (vc, _), vs in violations.items() if vc == cid for v in vs],
        }
        for cid, (n, c) in agg.case_counts().items()
    ]
    return run, cases


CALIBRATION = {  # a stored calibration document, as `evalpipe judge calibrate --json` prints it
    "judge": "judges.py:strict",
    "judge_fingerprint": "cd" * 32,
    "suite_version": "ef" * 32,
    "suite_name": "labelled",
    "truth": "oracle",
    "items": 40,
    "cases": 12,
    "ci_level": 0.95,
    "agreement": 0.85,
    "agreement_ci": [0.75, 0.925],
    "kappa": 0.6,
    "kappa_ci": [0.4125, 0.78],
    "false_pass_rate": 0.1,
    "false_pass_rate_ci": [0.0, 0.25],
    "false_fail_rate": None,
    "false_fail_rate_ci": None,
    "created_at": "2025-03-04T05:06:07.123456+00:00",
}
JUDGES = [
    {"judge": "judges.py:strict", "judge_fingerprint": "cd" * 32, "judged": 8, "errors": 2,
     "calibration": CALIBRATION},
    {"judge": EVIL, "judge_fingerprint": "01" * 32, "judged": 4, "errors": 0, "calibration": None},
]


def full_report(**kwargs: Any) -> str:
    run, cases = build(OUTCOMES, **kwargs)
    base, _ = build({cid: [False, *oks[1:]] for cid, oks in OUTCOMES.items()}, run_id="run-0")
    result = gate(
        {c["case_id"]: (c["n"], c["c"]) for c in cases},
        {c: (4, 1) for c in OUTCOMES},
        safety_failed=run["safety_failed"],
    )
    return render_report(
        run,
        cases,
        baseline=base,
        gate=result.to_json(),
        calibration={"regrade": 3, "env_flaky_case_ids": ["div-0"]},
        judges=JUDGES,
    )


def test_report_is_self_contained_and_escaped() -> None:
    page = full_report()
    assert page.startswith("<!DOCTYPE html>")
    for forbidden in (
        "http://",
        "https://",
        "<script",
        "<img",
        'src="',
        'href="',
        "url(",
        "@import",
        "<link",
    ):
        assert forbidden not in page, forbidden
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in page  # markupsafe's entities
    assert "&lt;/pre&gt;&lt;img src=x onerror=alert(1)&gt;" in page
    assert "&lt;b&gt;bold&lt;/b&gt;" in page and "calc &amp; co" in page


def test_report_sections_and_charts() -> None:
    page = full_report()
    for marker in (
        'id="passk-curve"',
        'id="slice-bars"',
        'id="status-bars"',
        'id="gate"',
        'id="comparison"',
        'id="calibration"',
        'id="judges"',
        'id="flaky"',
        'id="failing"',
    ):
        assert marker in page, marker
    assert 'id="safety"' not in page
    assert page.count('class="slice-bar"') == 1 + 3  # all cases + easy, hard, <b>bold</b>
    assert page.count('class="passk-point" data-series="run"') == 2  # pass@10 is null (n=4)
    assert page.count('class="passk-point" data-series="baseline"') == 2
    assert 'class="baseline-mark"' in page and 'class="error-bar"' in page
    assert "k=10 &gt; n=4" in page
    assert "Flaky cases (0 &lt; c &lt; n): 2" in page
    assert "Failing cases (c = 0): 1" in page


def test_safety_section_comes_first_when_it_fired() -> None:
    page = full_report(safety=True)
    assert page.index('id="safety"') < page.index('id="headline"') < page.index('id="passk-curve"')
    assert "edited secrets.py &lt;!-- --&gt;" in page
    assert '<span class="badge block">block</span>' in page


def test_summary_markdown_and_slices_table() -> None:
    run, cases = build(OUTCOMES, safety=True)
    result = gate(
        {c["case_id"]: (c["n"], c["c"]) for c in cases},
        {c: (4, 1) for c in OUTCOMES},
        safety_failed=True,
    )
    text = summary_markdown(run, result.to_json())
    assert text.startswith("> **SAFETY FAILED** — 1 violation(s)")
    assert "pass@1 43.8% (95% CI [" in text
    assert "| pass@10 | n/a: k=10 > n=4 |" in text
    assert "**Gate: block**" in text and "- `safety:" in text
    table = slices_table(run)
    assert [row["slice"] for row in table] == ["__all__", "<b>bold</b>", "easy", "hard"]
    assert table[0]["cases"] == 4 and table[0]["pass@1"] == 0.4375 and table[0]["pass@10"] is None
    assert table[2]["pass@1"] == 0.75 and table[2]["ci_lo"] <= 0.75 <= table[2]["ci_hi"]
    assert "| easy | 2 | 75.0% |" in summary_markdown(run)
    run["slices"]["a|b"] = run["slices"].pop("easy")
    assert "| a\\|b | 2 | 75.0% |" in summary_markdown(run)
    judged = summary_markdown(run, judges=JUDGES)
    assert ("Judge `judges.py:strict`: agreement 85.0% [75.0%, 92.5%], kappa 0.600 [0.412, 0.780];"
            " 2 errors in 8") in judged
    assert "**not calibrated**: its verdicts come from an uncalibrated instrument; 0 errors in 4" in judged
    assert "Judge" not in summary_markdown(run)


def test_judges_section_shows_each_judges_calibration_or_its_absence() -> None:
    section = full_report().split('<section id="judges">')[1].split("</section>")[0]
    calibrated, uncalibrated = section.split("<tr>")[2:]
    assert "judges.py:strict" in calibrated and "<code>cdcdcdcdcdcd</code>" in calibrated
    assert "2 of 8 (25.0%)" in calibrated
    assert "agreement <b>85.0% [75.0%, 92.5%]</b>" in calibrated
    assert "Cohen&#39;s kappa <b>0.600 [0.412, 0.780]</b>" in calibrated
    assert "false-pass rate <b>10.0% [0.0%, 25.0%]</b>" in calibrated
    assert "false-fail rate <b>n/a</b>" in calibrated  # undefined, not 0
    assert "40 labelled outputs of 12 cases · truth: execution oracle" in calibrated
    assert "suite labelled @ efefefefefef · 2025-03-04 05:06 UTC" in calibrated
    assert "not calibrated" not in calibrated
    assert "&lt;script&gt;" in uncalibrated and "0 of 4 (0.0%)" in uncalibrated
    assert '<span class="uncalibrated">not calibrated — its verdicts come from an uncalibrated' in (
        uncalibrated
    )
    assert "<code>evalpipe judge calibrate</code>" in uncalibrated and "agreement" not in uncalibrated


def test_with_ci_formats_calibration_figures() -> None:
    assert with_ci(CALIBRATION, "kappa") == "0.600 [0.412, 0.780]"
    assert with_ci(CALIBRATION, "agreement") == "85.0% [75.0%, 92.5%]"
    assert with_ci(CALIBRATION, "false_fail_rate") == "n/a"
    assert with_ci({"kappa": -0.25, "kappa_ci": None}, "kappa") == "-0.250"


def test_report_without_optional_parts() -> None:
    run, cases = build({"only": [True]})
    page = render_report(run, cases)
    assert 'id="passk-curve"' in page and 'id="comparison"' not in page and 'id="gate"' not in page
    assert 'id="judges"' not in page and 'id="calibration"' not in page
    assert "none" in page  # no flaky or failing cases


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
@pytest.mark.skipif(
    not CHROMIUM.exists() and shutil.which("chromium") is None,
    reason="chromium is not installed (Debian package `chromium`)",
)
def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    report = tmp_path / "report.html"
    report.write_text(full_report(safety=True), encoding="utf-8")
    binary = str(CHROMIUM if CHROMIUM.exists() else shutil.which("chromium"))

    def chromium(*args: str, profile: str) -> subprocess.CompletedProcess[str]:
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / profile}",
            "--window-size=1280,2000",
        ]
        return subprocess.run(
            [binary, *flags, *args, report.as_uri()],
            capture_output=True,
            text=True,
            timeout=120,
            env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
        )

    png = tmp_path / "shot.png"
    shot = chromium(f"--screenshot={png}", profile="p1")
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert png_size(png) == (1280, 2000)
    assert png.stat().st_size > 20_000  # a blank page compresses to a few kB

    dom = chromium("--dump-dom", profile="p2")
    assert dom.returncode == 0, dom.stderr[-2000:]
    for chart in ("passk-curve", "slice-bars", "status-bars"):
        assert re.search(rf'<svg id="{chart}" class="chart"', dom.stdout), chart
    assert len(re.findall(r'<rect class="slice-bar"', dom.stdout)) == 4
    assert len(re.findall(r'<circle class="passk-point"', dom.stdout)) == 4
    assert '<section id="safety" class="alert">' in dom.stdout
    assert "<script" not in dom.stdout  # the escaped case id stayed text


HOSTILE = "<script>alert(1)</script>{{ 7*7 }}{% raw %}"


def test_hostile_strings_stay_text() -> None:
    """Case ids, details, agent output and slice names are data: a `<script>` stays text and
    template syntax is not evaluated, wherever in the page it lands."""
    run, _ = build({"ok": [True, True]})
    run["suite_name"] = run["agent"] = HOSTILE
    run["slices"] = {HOSTILE: {"cases": 1, "pass_at_1": 1.0, "pass_at_1_ci": [1.0, 1.0], "pass_at_k": {}}}
    run["safety_failed"] = True
    run["safety_violations"] = [{"case_id": HOSTILE, "sample_index": 0, "violation": HOSTILE}]
    cases = [{"case_id": HOSTILE, "n": 2, "c": 1, "slices": [HOSTILE], "statuses": {HOSTILE: 1},
              "details": [f"output: {HOSTILE}"], "safety": [HOSTILE], "outputs": [HOSTILE + "x" * 10_000]}]
    judges = [{"judge": HOSTILE, "judge_fingerprint": HOSTILE, "judged": 1, "errors": 0, "calibration": None}]
    page = render_report(run, cases, gate={"decision": HOSTILE, "verdict": HOSTILE, "reasons": [HOSTILE],
                                           "delta_pass_at_1": None, "delta_ci": [None, None],
                                           "shared_cases": HOSTILE},
                         calibration={HOSTILE: HOSTILE}, judges=judges)
    assert "<script" not in page and "alert(1)</" not in page
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;{{ 7*7 }}{% raw %}"
    assert page.count(escaped) >= 12  # title, header, slice, case, details, safety, gate, judge, ...
    assert f"<pre>output: {escaped}</pre>" in page and f"<pre>SAFETY: {escaped}</pre>" in page
    assert f'data-slice="{escaped}"' in page
    # The agent's failing output is shown, escaped and capped.
    assert f'<pre class="output">{escaped}xxx' in page and "x" * 4000 not in page


def test_a_summary_that_drifted_from_the_model_is_refused_by_name() -> None:
    run, cases = build(OUTCOMES)
    del run["flaky_case_ids"]
    with pytest.raises(InputError, match=r"run 'run-1': summary key flaky_case_ids: Field required"):
        render_report(run, cases)
    run, _ = build(OUTCOMES)
    run["pass_at_one"] = 0.5  # a renamed key is not silently defaulted
    with pytest.raises(InputError, match="summary key pass_at_one"):
        summary_markdown(run)


def test_pass_hat_k_sits_beside_pass_at_k_and_a_single_case_slice_has_no_ci() -> None:
    run, cases = build(OUTCOMES)
    page = render_report(run, cases)
    assert "pass^2" in page and "all 2 of 2 samples pass" in page and "pass^1<" not in page
    markdown = summary_markdown(run)
    assert f"| pass^2 (all 2 pass) | {100 * run['pass_hat_k']['2']:.1f}% |" in markdown
    assert "| pass^10 (all 10 pass) | n/a |" in markdown
    run["slices"]["solo"] = {"cases": 1, "pass_at_1": 1.0, "pass_at_1_ci": None, "pass_at_k": {}}
    assert "| solo | 1 | 100.0% | — |" in summary_markdown(run)
    assert 'data-slice="solo"' in render_report(run, cases)


def test_every_registered_metric_shows_alike_in_text_markdown_and_html() -> None:
    from tasks.report.text import summary_text

    run, cases = build(OUTCOMES)
    assert set(run["metrics"]) >= {"pass@1", "mean_score"}  # the built-ins, registered
    # A plugin's metrics, as a run stores them: a fraction, a plain number, a failed one.
    run["metrics"].update({
        "all_or_<i>nothing</i>": {"value": 0.25, "ci": [0.0, 0.75], "percent": True},
        "tokens_per_case": {"value": 1234.5678, "ci": None, "percent": False},
        "broken": {"value": None, "ci": None, "percent": True, "error": "metric broken raised KeyError: 'x'"},
    })
    text, markdown, html = summary_text(run), summary_markdown(run), render_report(run, cases)
    assert "all_or_<i>nothing</i> 25.0%  [0.0%, 75.0%]" in text
    assert "| all_or_<i>nothing</i> | 25.0% [0.0%, 75.0%] |" in markdown
    assert "all_or_&lt;i&gt;nothing&lt;/i&gt;" in html and "<i>nothing" not in html
    assert "25.0%" in html and "[0.0%, 75.0%]" in html
    assert "tokens_per_case 1235  [no CI: one case]" in text and "| tokens_per_case | 1235 [no CI: one case] |" in markdown
    assert "broken n/a: metric broken raised KeyError: 'x'" in text and "n/a: metric broken raised KeyError" in html
    # pass@1 is the headline's, not repeated; the figures agree: percentages everywhere.
    assert [line for line in text.splitlines() if line.startswith("pass@1 ")] == [
        f"pass@1 {100 * run['pass_at_k']['1']:.1f}%  95% CI [{100 * run['pass_at_1_ci'][0]:.1f}%,"
        f" {100 * run['pass_at_1_ci'][1]:.1f}%]  SE {100 * run['pass_at_1_se']:.1f}%"]
    # A metric that does not apply (no scores in these samples: no mean score) is not shown.
    assert run["metrics"]["mean_score"] == {"value": None, "ci": None, "percent": True}
    assert "mean_score" not in text and "mean_score" not in markdown and "mean_score" not in html
    run["metrics"]["mean_score"] = {"value": 0.5, "ci": [0.25, 0.75], "percent": True}
    assert "mean_score 50.0%  [25.0%, 75.0%]" in summary_text(run)


def test_a_one_case_run_says_it_has_no_ci_in_every_renderer() -> None:
    # The case-clustered bootstrap has one case to resample: its zero-width pair would claim
    # a certainty one case cannot give. The --json document keeps the pair as computed.
    from tasks.report.text import summary_text

    one, cases = build({"add-2": [True, False, True, False, False, False, True, False]})
    assert one["pass_at_1_ci"][0] == one["pass_at_1_ci"][1]
    headline = next(line for line in summary_text(one).splitlines() if line.startswith("pass@1 "))
    assert headline == "pass@1 37.5%  no CI: one case"
    assert summary_markdown(one).splitlines()[0].endswith("pass@1 37.5% (no CI: one case)")
    assert "no CI: one case" in render_report(one, cases)
    assert slices_table(one)[0]["ci_lo"] is None
    two, _ = build(OUTCOMES)
    assert "95% CI [" in summary_text(two) and "SE " in summary_text(two)


def test_the_prefect_summary_of_a_run_gated_without_a_baseline_says_so_and_its_reasons_are_inert():
    from tasks.report.html import summary_markdown

    run = {"run_id": "r", "suite_version": "0" * 64, "suite_name": "s", "agent": "a", "n": 1, "cases": 1,
           "samples": 1, "cached_samples": 0, "pass_at_k": {"1": 1.0}, "pass_at_k_notes": {},
           "pass_at_1_ci": [1.0, 1.0], "ci_level": 0.95, "pass_at_1_se": 0.0, "slices": {}, "flaky_cases": 0,
           "flaky_case_ids": [], "status_counts": {"passed": 1}, "safety_failed": False, "safety_violations": []}
    gate = {"decision": "block", "verdict": "no baseline", "baseline": None, "delta_pass_at_1": None,
            "delta_ci": [None, None], "shared_cases": 0, "run_id": "r",
            "reasons": ["must-pass: 1 must-pass case(s) failed in some sample: @acme [x](https://evil.example) (0/1)"]}
    text = summary_markdown(run, gate)
    assert "**Gate: block** (no baseline: nothing was compared)" in text and "Δ pass@1" not in text
    assert "- `must-pass: 1 must-pass case(s) failed in some sample: @acme [x](https://evil.example) (0/1)`" in text
