#!/bin/sh
# A scripted coding agent for `--workspace` (docs/agents.md, "Coding agents"): it fixes the
# add-bug of the calc example the way a developer would, in its own checkout:
#
#   evalpipe run examples/coding/calc.yaml --agent cmd:examples/coding/calc_fixer.sh --workspace
#
# It edits calc.py and commits that edit, then writes a new file it leaves uncommitted, and
# runs the tests with the case's interpreter. evalpipe grades the whole change against the
# base commit, committed or not. Each step is a JSON line in $EVALPIPE_TRAJECTORY.
set -eu
cd "$EVALPIPE_WORKSPACE"
step() { printf '{"tool": "bash", "input": "%s", "why": "%s"}\n' "$2" "$1" >> "$EVALPIPE_TRAJECTORY"; }

cat > /dev/null  # the case JSON; this agent knows its one task
step read "grep -n 'def add' -A2 calc.py"
grep -n 'def add' -A2 calc.py

step edit "sed -i 's/return abs(a) + b/return a + b/' calc.py"
sed -i 's/return abs(a) + b/return a + b/' calc.py
step commit "git commit -am 'calc: add keeps the sign of a'"
git commit -q -am "calc: add keeps the sign of a"

step create "printf ... > CHANGES.md"
printf '# Changes\n\n- `add` keeps the sign of its first argument.\n' > CHANGES.md

step test "\$EVALPIPE_PYTHON -m pytest -q -p no:cacheprovider test_calc.py"
"$EVALPIPE_PYTHON" -m pytest -q -p no:cacheprovider test_calc.py
