"""A case's task text, as an `openai:` agent, a workspace `cmd:` agent's `{task}` and a judge's
`{prompt}` read it (`PROMPT_FIELDS`): a mined or SWE-bench case's `problem_statement` is its
text, never the inputs as JSON."""

from __future__ import annotations

from tasks.agents.chat import chat_messages
from tasks.graders.judge import render
from tasks.models import EvalCase

MINED = {"problem_statement": "Fix sub: it added (fixes #7)", "repo": "mined"}


def test_a_mined_case_s_problem_statement_is_its_task_text():
    assert chat_messages(MINED) == [{"role": "user", "content": "Fix sub: it added (fixes #7)"}]
    case = EvalCase(id="c", inputs=MINED, reference="", grader={"kind": "exact"})
    assert render("Task: {prompt}", case) == "Task: Fix sub: it added (fixes #7)"
    # An earlier field still wins, and a case with none of them is shown as its inputs.
    assert chat_messages({**MINED, "issue": "the issue"})[0]["content"] == "the issue"
    assert chat_messages({"repo": "mined"})[0]["content"] == '{"repo":"mined"}'
