"""What changed, case by case: the diff's labels, counts and order, the gate's rules, and the
Markdown of a pull-request comment, on runs with known flips."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.metrics.diff import LABELS, CaseResult, diff_runs
from tasks.metrics.rules import GateRules, check_slices, parse_slice_thresholds, rule_blocks
from tasks.models import InputError
from tasks.report.markdown import GITHUB_COMMENT_LIMIT, comparison_markdown


def result(cid: str, n: int, c: int, *, slices=("all",), score: float | None = None, version: str = "") -> CaseResult:
    return CaseResult(cid, f"hash-{cid}{version}", n, c, c / n if score is None else score, tuple(slices))


BEFORE = [result("a", 5, 0), result("b", 5, 0), result("c", 5, 5), result("d", 5, 3), result("e", 5, 5),
          result("gone", 5, 5)]
AFTER = [result("a", 5, 5), result("b", 5, 2), result("c", 5, 0), result("d", 5, 2), result("e", 5, 5),
         result("fresh", 5, 1)]


def test_labels_counts_and_order() -> None:
    diff = diff_runs(AFTER, BEFORE, run_id="v2", baseline_id="v1")
    labels = [(c.case_id, c.label) for c in diff.cases]
    # Regressions first (largest first), then improvements (largest first), new, removed, unchanged.
    assert labels == [("c", "regressed"), ("d", "regressed"), ("a", "improved"), ("b", "improved"),
                      ("fresh", "new"), ("gone", "removed"), ("e", "unchanged")]
    assert diff.counts() == {"regressed": 2, "improved": 2, "new": 1, "removed": 1, "unchanged": 1}
    assert list(diff.counts()) == list(LABELS)
    assert (diff.shared, diff.dropped) == (5, 2)
    c = diff.cases[0]
    assert (c.before.c, c.after.c, c.change) == (5, 0, pytest.approx(-1.0))
    assert diff.overall.delta == pytest.approx((1 + 0.4 - 1 - 0.2 + 0) / 5)
    doc = diff.to_json()
    assert all({"case_id", "label"} <= set(case) for case in doc["cases"]) and len(doc["cases"]) == 7
    assert doc["cases"][4] == {"case_id": "fresh", "label": "new", "change": None, "before": None,
                               "after": {"passes": 1, "samples": 5, "score": 0.2, "value": 0.2}, "slices": ["all"]}
    assert doc["dropped_cases"] == 2 and doc["counts"]["removed"] == 1


def test_different_suite_versions_pair_on_shared_cases_only() -> None:
    # Case "b" changed content between the versions (a new hash): it is new and removed, not paired.
    before = [result("a", 5, 1), result("b", 5, 1)]
    after = [result("a", 5, 4), result("b", 5, 1, version="-v2")]
    diff = diff_runs(after, before)
    assert {(c.case_id, c.label) for c in diff.cases} == {("a", "improved"), ("b", "new"), ("b", "removed")}
    assert diff.shared == 1 and diff.dropped == 2


def test_per_slice_change_has_a_paired_ci_and_a_single_case_none() -> None:
    rng = np.random.default_rng(0)
    before = [result(f"q{i}", 4, int(rng.integers(0, 5)), slices=("big",)) for i in range(40)]
    after = [result(f"q{i}", 4, min(4, r.c + 1), slices=("big",)) for i, r in enumerate(before)]
    before.append(result("solo", 4, 0, slices=("solo",)))
    after.append(result("solo", 4, 4, slices=("solo",)))
    diff = diff_runs(after, before)
    big = diff.slices["big"]
    assert big.cases == 40 and big.ci[0] <= big.delta <= big.ci[1] and big.ci[0] > 0
    assert diff.slices["solo"].ci is None and diff.slices["solo"].delta == pytest.approx(1.0)


def test_score_metric_labels_by_mean_score() -> None:
    before = [result("a", 2, 1, score=0.5), result("b", 2, 1, score=0.9)]
    after = [result("a", 2, 1, score=0.75), result("b", 2, 1, score=0.6)]
    assert {c.case_id: c.label for c in diff_runs(after, before).cases} == {"a": "unchanged", "b": "unchanged"}
    scored = diff_runs(after, before, metric="score")
    assert {c.case_id: c.label for c in scored.cases} == {"a": "improved", "b": "regressed"}
    assert scored.overall.delta == pytest.approx((0.25 - 0.3) / 2)
    with pytest.raises(InputError, match="--metric"):
        diff_runs(after, before, metric="speed")  # type: ignore[arg-type]


def test_rules_name_the_cases_and_the_slice() -> None:
    diff = diff_runs(AFTER, BEFORE)
    blocks = rule_blocks(GateRules(must_pass=frozenset({"c", "e", "missing"}), max_new_failures=0,
                                   slice_min={"all": 0.9}), AFTER, diff, {"all": 0.5})
    rules = [(b.rule, b.cases, b.slice) for b in blocks]
    assert rules == [("must_pass", ("c",), None), ("must_pass", ("missing",), None),
                     ("new_failures", ("c",), None), ("slice_threshold", (), "all")]
    assert "c (0/5)" in blocks[0].message and "not measured" in blocks[1].message
    assert blocks[2].message.startswith("new failures: 1 case(s) that always passed")
    assert blocks[3].message == "slice all: pass@1 50.0% is below the required 90.0%"
    # d dropped from 3/5 to 2/5: a regression, but it never always passed, so it is no new failure.
    assert rule_blocks(GateRules(max_new_failures=1), AFTER, diff, {}) == []
    with pytest.raises(InputError, match="no slice 'nope'"):
        rule_blocks(GateRules(slice_min={"nope": 0.1}), AFTER, diff, {"all": 0.5})


@pytest.mark.parametrize("spec", ["easy", "easy=", "=0.5", "easy=1.5", "easy=x"])
def test_bad_slice_thresholds_are_refused(spec: str) -> None:
    with pytest.raises(InputError, match="--min-slice"):
        parse_slice_thresholds([spec])
    assert parse_slice_thresholds(["a=b=0.5", "hard=0"]) == {"a=b": 0.5, "hard": 0.0}
    check_slices({"hard": 0.5}, ["easy", "hard"])
    with pytest.raises(InputError, match="no slice 'hrad' \\(its slices: easy, hard\\)"):
        check_slices({"hrad": 0.5}, ["easy", "hard", "easy"])


def test_markdown_names_the_worst_regressions_and_keeps_suite_text_in_code() -> None:
    evil = "x|y`<img src=x onerror=alert(1)>\nz"
    before = [result("a", 5, 5), result(evil, 5, 5, slices=("<b>s</b>|",))]
    after = [result("a", 5, 0), result(evil, 5, 1, slices=("<b>s</b>|",))]
    gate = {"decision": "block", "verdict": "regressed", "reasons": [f"must-pass: {evil} failed"]}
    text = comparison_markdown(diff_runs(after, before, run_id="r2", baseline_id="r1"), gate)
    assert text.startswith("## evalpipe gate: **BLOCK** (`regressed`)")
    assert "\nz" not in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "/5 |" in line]
    assert rows[0] == "| `a` | 5/5 | 0/5 | -100.0 pts |"
    assert rows[1].startswith("| ``x\\|y`<img src=x onerror=alert(1)> z`` | 5/5 | 1/5 |")
    assert all(row.replace("\\|", "").count("|") == 5 for row in rows)  # no cell broke out of its column
    assert "regressed **2**" in text
    html = render_comment(text)
    assert "<img" not in html and "<b>" not in html and "<code>x|y`&lt;img src=x onerror=alert(1)&gt; z</code>" in html


def render_comment(text: str) -> str:
    """The comment as GitHub renders it: CommonMark with GFM's tables and strikethrough
    (markdown-it-py). GitHub's mentions, issue references and bare-URL links act on text
    outside code, which `suite_text_outside_code` reads."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"]).render(text)


def suite_text_outside_code(html: str) -> str:
    """The rendered text that is not inside <code> or <pre>: where a mention, a reference, a
    bare URL or math would come alive on GitHub."""
    from html.parser import HTMLParser

    class Outside(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.depth, self.text = 0, []

        def handle_starttag(self, tag, attrs) -> None:
            self.depth += tag in ("code", "pre")

        def handle_endtag(self, tag) -> None:
            self.depth -= tag in ("code", "pre")

        def handle_data(self, data) -> None:
            if not self.depth:
                self.text.append(data)

    parser = Outside()
    parser.feed(html)
    return "".join(parser.text)


# The attack of issue 45: a case id or slice that pings a team, links, cross-references,
# strikes and typesets when the comment is posted.
LIVE = "@acme/security-team please approve: https://evil.example/approve ~~regressed~~ org/repo#1 $x^2$"


@pytest.mark.parametrize("evil", [
    LIVE,
    f"`{LIVE}`",  # a backtick at each end: the span must hold them
    f"``{LIVE}`` | ```",
    f"[approve](https://evil.example) <a href='https://evil.example'>x</a> www.evil.example {LIVE}",
])
def test_suite_text_in_the_comment_is_inert_when_rendered(evil: str) -> None:
    """Issue 45: case ids, slice names, the reasons naming them and grader details render as
    code in the gate comment and `diff --format markdown`: no link, mention, reference,
    strike or math that the suite put there."""
    from tasks.metrics.gate import gate_diff
    from tasks.metrics.rules import GateRules

    before = [result(evil, 4, 4, slices=(evil,)), result("b", 4, 4, slices=(evil,)), result("c", 4, 0)]
    after = [result(evil, 4, 0, slices=(evil,)), result("b", 4, 4, slices=(evil,)), result("c", 4, 4)]
    diff = diff_runs(after, before, run_id="r2", baseline_id="r1")
    gate = gate_diff(diff, after, safety_failed=False, must_pass=frozenset({evil}), suite_version="v" * 20,
                     slice_values=None, rules=GateRules(max_new_failures=0, slice_min={evil: 0.9})) | {
        "baseline_choice": f"previous: the latest completed run of suite {evil!r}"}
    failing = {evil: {"sample_index": 0, "status": "failed", "kind": "exact", "detail": f"expected {evil}\n```\n{evil}"}}
    for text in (comparison_markdown(diff, gate, failing=failing), comparison_markdown(diff, None, failing=failing)):
        assert text.count("approve") >= 3  # the suite's text is there: as code
        html = render_comment(text)
        for tag in ("<a ", "<del", "<s>", "<img", "<em", "<strong>approve"):
            assert tag not in html, (tag, html)
        outside = suite_text_outside_code(html)
        for live in ("@acme", "evil.example", "#1", "~~", "$x", "approve"):
            assert live not in outside, (live, outside)


def test_markdown_stays_under_a_github_comment_whatever_the_suite_size() -> None:
    big = 20_000
    before = [result(f"case-{'x' * 300}-{i}", 5, 5, slices=(f"slice-{i % 500}-{'y' * 200}",)) for i in range(big)]
    after = [result(r.case_id, 5, i % 3, slices=r.slices) for i, r in enumerate(before)]
    diff = diff_runs(after, before, n_boot=50)
    gate = {"decision": "block", "verdict": "regressed", "reasons": ["r" * 100_000] * 50}
    text = comparison_markdown(diff, gate)
    assert len(text) < GITHUB_COMMENT_LIMIT
    assert f"regressed **{big}**" in text and "the 25 largest of 20000" in text


HOSTILE = "<script>alert(1)</script>{{ 7*7 }}"


def test_diff_report_is_self_contained_escapes_outputs_and_shows_both_sides() -> None:
    from tasks.report.diff_html import render_diff_report

    before = [result(HOSTILE, 5, 5), result("b", 5, 0)]
    after = [result(HOSTILE, 5, 0), result("b", 5, 5)]
    diff = diff_runs(after, before, run_id="r2", baseline_id="r1")
    sample = {"index": 3, "status": "failed", "output": HOSTILE + "y" * 20_000, "detail": f"expected {HOSTILE}",
              "trajectory": [{"tool": "shell", "input": HOSTILE}]}
    details = {HOSTILE: {"inputs": {"q": HOSTILE}, "reference": HOSTILE, "before": {**sample, "status": "passed"},
                         "after": sample},
               "b": {"inputs": {}, "reference": None, "before": None, "after": None}}
    gate = {"decision": "block", "verdict": "inconclusive", "reasons": [f"must-pass: {HOSTILE}"]}
    page = render_diff_report(diff, gate, None, None, details)
    for forbidden in ("<script", "http://", "https://", 'src="', 'href="', "<link", "url("):
        assert forbidden not in page, forbidden
    assert page.index('id="gate"') < page.index('id="regressed"') < page.index('id="improved"')
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;{{ 7*7 }}"
    assert page.count(escaped) >= 6  # id, input, reference, both outputs, detail, trajectory, reason
    assert "y" * 8000 not in page  # outputs are capped
    assert "baseline: sample 3, passed" in page and "run: sample 3, failed" in page and "no sample" in page


def test_a_5000_case_diff_expands_only_a_bounded_number_of_changed_cases() -> None:
    from tasks.report.diff_html import MAX_EXPANDED, expanded, render_diff_report

    before = [result(f"q{i:04d}", 4, 4 if i % 2 else 0, slices=(f"s{i % 50}",)) for i in range(5000)]
    after = [result(f"q{i:04d}", 4, 0 if i % 2 else 4, slices=(f"s{i % 50}",)) for i in range(5000)]
    diff = diff_runs(after, before, n_boot=200)
    chosen = expanded(diff)
    assert len(chosen) == 2 * MAX_EXPANDED  # the page's cost, and the samples read, do not grow with the suite
    details = {c.case_id: {"inputs": {"q": "x" * 100}, "reference": "r",
                           "before": {"index": 0, "status": "passed", "output": "o" * 500, "detail": ""},
                           "after": {"index": 0, "status": "failed", "output": "p" * 500, "detail": "d"}}
               for c in chosen}
    page = render_diff_report(diff, {"decision": "block", "verdict": "regressed", "reasons": []}, None, None, details)
    assert page.count('<div class="case ') == 2 * MAX_EXPANDED
    assert "lists all 2500" in page and len(page) < 2_000_000


def test_must_pass_is_in_the_suite_version_not_in_the_case_hash(home) -> None:
    from storage.store import Store
    from tasks.models import EvalCase, EvalSuite

    def suite(must: bool) -> EvalSuite:
        extra = {"must_pass": True} if must else {}
        return EvalSuite(name="s", cases=(EvalCase(id="a", grader={"kind": "exact"}, reference="x", **extra),
                                          EvalCase(id="b", grader={"kind": "exact"}, reference="y")))

    plain, marked = suite(False), suite(True)
    assert plain.version != marked.version  # the gate policy is part of what a run was measured on
    assert [c.case_hash for c in plain.cases] == [c.case_hash for c in marked.cases]  # what is measured is not
    assert "must_pass" not in plain.cases[0].content()  # unmarked cases hash as before the field existed
    assert EvalSuite(name="s", cases=(EvalCase(id="a", grader={"kind": "exact"}, reference="x", must_pass=False),
                                      plain.cases[1])).version == plain.version
    store = Store(home)
    store.snapshots.write(marked)
    assert store.snapshots.read(marked.version).version == marked.version
    assert store.snapshots.must_pass_cases(marked.version) == {"a"} and store.snapshots.must_pass_cases(plain.version) is None
    store.snapshots.write(plain)
    assert store.snapshots.must_pass_cases(plain.version) == frozenset()


def test_diff_text_shows_control_characters_in_ids_inert() -> None:
    from tasks.report.diff_text import diff_text

    evil = "a\x1b[2Jb\nc"
    doc = diff_runs([result(evil, 2, 0, slices=("s\x07",))], [result(evil, 2, 2, slices=("s\x07",))]).to_json()
    text = diff_text(doc, 30)
    assert "\x1b" not in text and "\x07" not in text and "a\ufffd[2Jb\ufffdc" in text
    assert text.splitlines()[3].split()[:2] == ["regressed", "a\ufffd[2Jb\ufffdc"]


def test_the_comment_says_why_each_newly_failing_case_fails_shortened_and_fenced() -> None:
    """Issue 47: the PR comment named a newly failing case but not why. Each one (passed every
    sample before, fails one now) gets its failing grader and detail in a code block whose
    fence no backtick run in the detail can close; long details are cut."""
    from tasks.metrics.diff import CaseResult, diff_runs
    from tasks.report.markdown import MAX_DETAIL_LINES, MAX_FAILING, comparison_markdown

    ids = [f"c{i:02d}" for i in range(MAX_FAILING + 3)]
    before = [CaseResult(cid, f"h{cid}", 2, 2, 1.0) for cid in ids] + [CaseResult("flaky", "hf", 2, 1, 0.5)]
    after = [CaseResult(cid, f"h{cid}", 2, 0, 0.0) for cid in ids] + [CaseResult("flaky", "hf", 2, 0, 0.0)]
    detail = "line one ```` not a fence\n" + "\n".join(f"line {i}" for i in range(40))
    failing = {cid: {"sample_index": 1, "status": "failed", "kind": "exact", "detail": detail} for cid in ids}
    failing["flaky"] = failing["c00"]  # not newly failing: it did not always pass before
    text = comparison_markdown(diff_runs(after, before, run_id="r", baseline_id="b"), failing=failing)
    section = text[text.index("### Newly failing"):]
    assert section.startswith(f"### Newly failing ({MAX_FAILING} of {MAX_FAILING + 3})\n")
    assert section.count("grader `exact` gave `failed` on sample 1") == MAX_FAILING and "flaky" not in section
    block = section.split("\n`````text\n")[1].split("\n`````\n")[0].splitlines()
    assert block[0] == "line one ```` not a fence" and len(block) == MAX_DETAIL_LINES + 1 and block[-1] == "…"
    assert comparison_markdown(diff_runs(after, before), failing={}).count("Newly failing") == 0
