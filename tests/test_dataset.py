"""Content addressing (docs/contract.md §1.1) and suite-file validation (docs/contract.md §3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.models import EvalCase, EvalSuite, Verdict, canonical_json
from tasks.suites.dataset import SuiteError, build_suite, diff_suites, load_suite

ROOT = Path(__file__).resolve().parent.parent

json_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=12) | st.floats(
    allow_nan=False, allow_infinity=False, width=32
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
labels = st.lists(st.text(alphabet="abcdefgh", min_size=1, max_size=5), max_size=3, unique=True)
case_dicts = st.builds(
    lambda inputs, ref, norm, slices, tags: {
        "inputs": inputs,
        "reference": ref,
        "grader": {"kind": "exact", "normalize": norm},
        "slices": slices,
        "tags": tags,
    },
    st.dictionaries(st.text(alphabet="xyz", min_size=1, max_size=4), json_values, max_size=3),
    json_values,
    st.booleans(),
    labels,
    labels,
)
suites = st.lists(case_dicts, min_size=1, max_size=6).map(
    lambda cases: [{"id": f"c{i}", **c} for i, c in enumerate(cases)]
)


def make(cases: list[dict]) -> EvalSuite:
    return build_suite("s", [(f"case #{i}", c) for i, c in enumerate(cases)], {}, source="t")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(suites, st.randoms())
def test_version_ignores_order_and_key_order(cases, rnd):
    shuffled = [dict(reversed(list(c.items()))) for c in cases]
    rnd.shuffle(shuffled)
    for c in shuffled:
        rnd.shuffle(c["slices"])
        rnd.shuffle(c["tags"])
    assert make(shuffled).version == make(cases).version


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(suites, st.data())
def test_any_content_change_moves_the_version(cases, data):
    original = make(cases)
    i = data.draw(st.integers(0, len(cases) - 1))
    field = data.draw(st.sampled_from(["inputs", "reference", "grader", "slices", "tags"]))
    changed = json.loads(json.dumps(cases))
    target = changed[i]
    if field == "inputs":
        target["inputs"] = {**target["inputs"], "__extra": data.draw(json_values)}
    elif field == "reference":
        target["reference"] = {"was": target["reference"]}
    elif field == "grader":
        target["grader"]["normalize"] = not target["grader"]["normalize"]
    else:
        target[field] = [*target[field], "zzz-new"]
    new = make(changed)
    assert new.version != original.version
    assert diff_suites(original, new).changed == [f"c{i}"]


def test_reformatted_yaml_and_equivalent_jsonl_hash_alike(tmp_path: Path):
    cases = [
        {"id": "b", "inputs": {"q": "2+2?", "n": 1.0}, "reference": 4, "grader": {"kind": "numeric"}},
        {"id": "a", "inputs": {"q": "yes?"}, "reference": "yes", "grader": {"kind": "exact"}, "slices": ["x", "y"]},
    ]
    flow = tmp_path / "flow.yaml"
    flow.write_text(yaml.safe_dump({"name": "s", "cases": cases}, default_flow_style=True))
    block = tmp_path / "block.yaml"
    block.write_text(
        "name: s\ncases:\n"
        "  - id: a\n    slices: [y, x]\n    grader: {kind: exact}\n    reference: yes\n    inputs: {q: 'yes?'}\n"
        "  - {id: b, reference: 4.0, grader: {kind: numeric}, inputs: {n: 1, q: '2+2?'}}\n"
    )
    jsonl = tmp_path / "s.jsonl"
    jsonl.write_text("".join(json.dumps(c) + "\n" for c in reversed(cases)))
    versions = {load_suite(p).version for p in (flow, block, jsonl)}
    assert len(versions) == 1
    # YAML 1.1 would have read the bare `yes` as True; we read it as the string, like JSON.
    assert load_suite(block).case("a").reference == "yes"


def test_suite_level_safety_is_part_of_each_case(tmp_path: Path):
    base = "name: s\ncases:\n  - {id: a, grader: {kind: exact}, reference: x}\n"
    plain = tmp_path / "plain.yaml"
    plain.write_text(base)
    safe = tmp_path / "safe.yaml"
    safe.write_text("safety: {forbidden_patterns: [SECRET]}\n" + base)
    assert load_suite(safe).case("a").safety == {"forbidden_patterns": ["SECRET"]}
    assert load_suite(safe).version != load_suite(plain).version


def test_canonical_json_is_compact_sorted_utf8():
    assert canonical_json({"b": [1.0, 2.5], "a": "é"}) == '{"a":"é","b":[1,2.5]}'.encode()
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


BAD = {
    "malformed.yaml": ("name: s\ncases: [\n", "malformed YAML"),
    "dup.yaml": (
        "name: s\ncases:\n  - {id: a, grader: {kind: exact}}\n  - {id: a, grader: {kind: exact}}\n",
        "duplicate case id 'a'",
    ),
    "noid.yaml": ("name: s\ncases:\n  - {grader: {kind: exact}}\n", "case #1: missing 'id'"),
    "nograder.yaml": ("name: s\ncases:\n  - {id: a}\n", "(id 'a'): missing 'grader'"),
    "kind.yaml": ("name: s\ncases:\n  - {id: a, grader: {kind: telepathy}}\n", "unknown grader kind 'telepathy'"),
    "types.yaml": ("name: s\ncases:\n  - {id: a, grader: {kind: exact}, slices: 7}\n", "slices"),
    "inputs.yaml": ("name: s\ncases:\n  - {id: a, grader: {kind: exact}, inputs: [1]}\n", "inputs"),
    "nan.yaml": ("name: s\ncases:\n  - {id: a, grader: {kind: exact}, reference: .nan}\n", "not JSON compliant"),
    "bad.jsonl": ('{"id": "a", "grader": {"kind": "exact"}}\n{"id": \n', "line 2: malformed JSON"),
    "empty.yaml": ("name: s\ncases: []\n", "no cases"),
    "deep.yaml": ("name: s\ncases: [{id: a, grader: {kind: exact}, reference: " + "[" * 5000 + "}]\n",
                  "line 2: nested deeper than 100 levels"),
    "deepblock.yaml": ("name: s\ncases:\n" + "".join("  " * i + "-\n" for i in range(1, 300)),
                       "nested deeper than 100 levels"),
    "deep.jsonl": ('{"id": "a", "grader": {"kind": "exact"}, "reference": ' + "[" * 50 + "]" * 50 + "}\n"
                   + '{"id": "b", "grader": {"kind": "exact"}, "reference": ' + "[" * 100_000 + "]" * 100_000
                   + "}\n", "line 2: nested deeper than 100 levels"),
    "shallowbutdeep.jsonl": ('{"id": "a", "grader": {"kind": "exact"}, "reference": ' + "[" * 500 + "]" * 500
                             + "}\n", "line 1: nested deeper than 100 levels"),
    "bigint.jsonl": ('{"id": "a", "grader": {"kind": "exact"}, "reference": ' + "7" * 5000 + "}\n",
                     "line 1: an integer with more than 4300 digits"),
    "bigint.yaml": ("name: s\ncases:\n  - {id: a, grader: {kind: exact}, reference: " + "7" * 5000 + "}\n",
                    "line 3: an integer with more than 4300 digits"),
    "recursive.yaml": ("name: s\ncases: [{id: a, grader: {kind: exact}, reference: &r [*r]}]\n",
                       "an alias refers to a node that contains it"),
    "suite.txt": ("whatever", "unknown suite format"),
    # (#45 item 2) a URL id was forwarded to the sandboxed agent as a host port
    "urlid.yaml": ("name: s\ncases:\n  - {id: 'http://127.0.0.1:18944/', grader: {kind: exact}}\n", "'://'"),
    "escapeid.jsonl": ('{"id": "a\\u001b[2Jb", "grader": {"kind": "exact"}}\n', "control character (U+001B)"),
    "bidiid.jsonl": ('{"id": "a\\u202eb", "grader": {"kind": "exact"}}\n', "control character (U+202E)"),
    "newlineid.yaml": ('name: s\ncases:\n  - {id: "a\\nb", grader: {kind: exact}}\n', "control character (U+000A)"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_names_the_problem(tmp_path: Path, name: str):
    text, expected = BAD[name]
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    message = str(err.value)
    assert expected in message and str(path) in message and "\n" not in message


def test_aliases_and_nesting_within_the_limits_load(tmp_path: Path):
    # An anchor reused by every case, and a reference nested just inside the depth limit
    # (the document, the case list, the case and its key add 3 levels above it).
    cases = "".join(f"  - {{id: c{i}, grader: *g, reference: {'[' * 97}{']' * 97}}}\n" for i in range(40))
    path = tmp_path / "ok.yaml"
    path.write_text("name: s\ngrader_defaults: &g {kind: exact}\ncases:\n" + cases)
    suite = load_suite(path)
    assert len(suite.cases) == 40 and suite.case("c7").grader["kind"] == "exact"


def test_verdict_passed_agrees_with_status():
    assert Verdict.ok().passed
    with pytest.raises(ValueError):
        Verdict(passed=True, score=1.0, status="failed")
    with pytest.raises(ValueError):
        EvalCase(id="x", grader={"kind": "exact"}).__setattr__("id", "y")


def test_resolve_suite_pins_what_it_read(home, tmp_path, monkeypatch):
    from storage.store import Store
    from storage.suites import resolve_suite

    monkeypatch.chdir(ROOT)
    store = Store(home)
    suite, pinned = resolve_suite("examples/qa.yaml", store.snapshots)
    assert pinned == str(ROOT / "examples/qa.yaml")
    store.snapshots.write(suite)
    stored, pinned_version = resolve_suite(suite.version[:10], store.snapshots)
    assert stored == suite and pinned_version == suite.version
    # Each pinned form names the same suite when given back.
    assert resolve_suite(pinned, store.snapshots)[0] == resolve_suite(pinned_version, store.snapshots)[0] == suite
    with pytest.raises(SuiteError, match="nope.yaml: no such suite file"):
        resolve_suite("nope.yaml", store.snapshots)
    with pytest.raises(SuiteError, match="neither a suite file, a git URL#PATH nor a stored suite version"):
        resolve_suite("abcdef123", store.snapshots)


def _dumped(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@settings(max_examples=400, deadline=None)
@given(st.lists(st.none() | st.booleans() | st.integers() | st.text(alphabet=st.characters(exclude_categories=("Cs",))),
                max_size=6), st.booleans())
def test_flat_keys_are_written_as_json_dumps_writes_them(items, as_tuple):
    # The direct path for flat lists (every sample's keys) must not change one byte of a key.
    value = tuple(items) if as_tuple else items
    assert canonical_json(value) == _dumped(items)


def test_canonical_json_refuses_a_lone_surrogate_on_the_direct_path_too():
    with pytest.raises(UnicodeEncodeError):
        canonical_json(["\ud800"])
    with pytest.raises(UnicodeEncodeError):
        canonical_json({"k": "\ud800"})
