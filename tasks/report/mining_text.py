"""The terminal's text of `evalpipe suite mine`: what was walked, kept and dropped, and why."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def mining_text(report: Mapping[str, Any]) -> str:
    lines = [f"{report['commits']} commits walked, {report['candidates']} candidates (change code and tests),"
             f" {report['kept']} kept" + (f" -> {report['out']} (version {report['version']})"
                                          if report.get("out") else ": no suite written")]
    for reason, count in sorted(report["skipped"].items(), key=lambda item: -item[1]):
        lines.append(f"  not a candidate ({count}): {reason}")
    for case in report["cases"]:
        lines.append(f"  kept    {case['commit'][:12]}: {case['fail_to_pass']} FAIL_TO_PASS,"
                     f" {case['pass_to_pass']} PASS_TO_PASS")
    lines.extend(f"  dropped {d['commit'][:12]}: {d['reason'][:300]}" for d in report["dropped"])
    for env in report["environments"]:
        what = f"failed: {env['failed'][:300]}" if "failed" in env else (
            f"built in {env['build_s']:.1f}s" if env.get("built") else "reused")
        lines.append(f"  environment {env.get('name', env['fingerprint'][:12])} ({env['candidates']} candidates): {what}")
    issues = report["issues"]
    if issues["linked"]:
        lines.append(f"  linked issues of the kept: {issues['linked']}, text fetched for {issues['fetched']}")
        lines.extend(f"    not fetched {i['commit'][:12]} {i['issue']}: {i['not_fetched'][:300]}"
                     for i in issues["not_fetched"])
    per = report.get("seconds_per_candidate")
    lines.append(f"{report['seconds']:.1f}s in all; "
                 + (f"{per:.1f}s per candidate run" if per is not None else "no candidate run")
                 + (f", {report['reused']} reused from an earlier mine" if report["reused"] else ""))
    return "\n".join(lines)
