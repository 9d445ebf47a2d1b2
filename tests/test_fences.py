"""The three readings of markdown code fences, each as lenient as its reader needs."""

from __future__ import annotations

from tasks.fences import fenced_body, is_fence_line, strip_fence_ends, unwrap_fenced_lines


def test_fence_lines_are_backticks_or_tildes_maybe_indented():
    assert is_fence_line("```diff") and is_fence_line("  ~~~ patch") and is_fence_line("```")
    assert not is_fence_line("a ```") and not is_fence_line("``")


def test_a_patch_wrapped_in_fence_lines_is_the_lines_inside():
    assert unwrap_fenced_lines("\n~~~ diff\n--- a/f\n+++ b/f\n```\n") == "--- a/f\n+++ b/f\n"
    assert unwrap_fenced_lines("--- a/f\n```") == "--- a/f\n```"


def test_a_fenced_body_is_one_whole_backtick_block():
    assert fenced_body('```json\n{"a": 1}\n```') == '{"a": 1}'
    assert fenced_body('```json\n{"a": 1}```') == '{"a": 1}'
    assert fenced_body("~~~\n{}\n~~~") is None
    assert fenced_body('say ```json\n{}\n```') is None


def test_fence_ends_are_dropped_each_on_its_own():
    assert strip_fence_ends('```json {"a": 1}\n```') == '{"a": 1}'
    assert strip_fence_ends("```\nPASS") == "PASS"
    assert strip_fence_ends("FAIL: see ``` here") == "FAIL: see ``` here"
