"""Markdown code fences around what a model writes: a patch, a JSON answer, a judge's reply.

Each reader is as lenient as its format needs, so there are three readings, side by side:
a patch is read line by line (any fence line, ``` or ~~~, indented or with an info
string); a JSON answer must be exactly one ``` block; a judge's reply is JSON or a verdict
word, often in prose, so a fence at either end is simply dropped. The other way, a
candidate's text put before a model has its chat-template tokens broken (`inert_tokens`).
"""

from __future__ import annotations

import re

_FENCE_LINE = re.compile(r"^\s*(```|~~~)")
_FENCED_BLOCK = re.compile(r"```[\w-]*[ \t]*\n(.*?)\n?```", re.DOTALL)
# Chat templates' special tokens as a text may spell them: ChatML and Llama 3 (`<|im_start|>`,
# `<|eot_id|>`), DeepSeek's full-width bars (`<｜end▁of▁sentence｜>`), Gemma's turns, Llama 2
# and Mistral (`[INST]`, `<<SYS>>`, `</s>`). Matched at their first character.
_SPECIAL_TOKEN = re.compile(
    r"<(?=[|｜][^\s<>]{1,64}[|｜]>|/?(?:s|start_of_turn|end_of_turn)>|</?SYS>>)|\[(?=/?INST\])", re.IGNORECASE)


def is_fence_line(line: str) -> bool:
    """A line that opens or closes a fence: ``` or ~~~, maybe indented, maybe with more after."""
    return _FENCE_LINE.match(line) is not None


def unwrap_fenced_lines(text: str) -> str:
    """The lines between the first and the last when both are fence lines, else `text`."""
    lines = text.strip("\n").split("\n")
    if len(lines) >= 2 and is_fence_line(lines[0]) and is_fence_line(lines[-1]):
        return "\n".join(lines[1:-1]) + "\n"
    return text


def fenced_body(text: str) -> str | None:
    """The body when `text` is exactly one ``` block (an optional language tag), else None."""
    match = _FENCED_BLOCK.fullmatch(text)
    return match.group(1) if match else None


def strip_fence_ends(text: str) -> str:
    """`text` without an opening fence at its start or a closing fence at its end (each
    dropped on its own, with the white space beside it). Linear in `text`: a reply is the
    judge's, but it may quote a candidate's text of any shape."""
    if text.startswith("```"):
        tag = 3
        while tag < len(text) and (text[tag].isalnum() or text[tag] == "_"):
            tag += 1
        text = text[tag:].lstrip()
    if text.endswith("```"):
        text = text[:-3].rstrip()
    return text


def inert_tokens(text: str) -> str:
    """`text` with each chat-template special token broken at its first character (`<` as
    `&lt;`, `[` as `&#91;`): an endpoint's tokenizer reads it as text, never as a turn of
    the conversation (a candidate's `<|im_start|>system` is no system message)."""
    return _SPECIAL_TOKEN.sub(lambda m: "&lt;" if m[0] == "<" else "&#91;", text)
