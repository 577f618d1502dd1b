#!/usr/bin/env bash
# Regenerate requirements-test.txt, the lock of gymbridge's own test venv (.venv).
#
#   bash scripts/lock.sh            # writes requirements-test.txt (a few minutes; review the diff, commit it)
#
# How: a scratch venv (Python 3.11, LOCK_PYTHON to override) gets
#   pip install -e ".[dev,ray,train,trl]" torch==2.13.0
# with nothing else constraining it, so pip resolves the newest releases pyproject.toml's ranges allow
# on the day it runs (torch: the CPU wheel, scripts/deps.sh). `pip check` must be clean; then
# `pip freeze --all --exclude-editable` is the lock, less pip and wheel (the venv's own tools), with
# torch's local label dropped (`torch==2.13.0` admits the CPU build here and a CUDA build elsewhere).
# scripts/test.sh installs .venv with this file as pip constraints and reinstalls when it changes (the
# install stamp holds its hash). Before committing a new lock, run `GYMBRIDGE_DEPS=latest bash
# scripts/test.sh` (the same releases today) and record it in docs/compatibility.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
# shellcheck source=scripts/deps.sh
source scripts/deps.sh
PY=${LOCK_PYTHON:-python3.11}
OUT=${LOCK_OUTPUT:-$ROOT/$TEST_LOCK}
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
    || { echo "!! $PY does not run (set LOCK_PYTHON)"; exit 1; }
[ "$pyver" = "3.11" ] || { echo "!! $PY is Python $pyver; the lock is for Python 3.11 (set LOCK_PYTHON)"; exit 1; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$PY" -m venv "$scratch/venv"
PIP=("$scratch/venv/bin/python" -m pip --disable-pip-version-check)
echo "== resolving gymbridge[$TEST_EXTRAS] $TORCH_CPU in a scratch venv"
"${PIP[@]}" install -q -e ".[$TEST_EXTRAS]" "$TORCH_CPU" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
"${PIP[@]}" check
{
    echo "# Lock of gymbridge's own test venv (.venv): gymbridge[$TEST_EXTRAS] with $TORCH_CPU, Python 3.11."
    echo "# Written by scripts/lock.sh on $(date -u +%F) (how: see that script); scripts/test.sh installs .venv"
    echo "# with this file as pip constraints. pyproject.toml's ranges are what users get; this is what CI tests."
    "${PIP[@]}" freeze --all --exclude-editable \
        | grep -v -E '^(pip|wheel)==' \
        | sed -E 's/^torch==([^+]*)\+.*/torch==\1/' \
        | LC_ALL=C sort -f
} >"$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "== wrote $OUT ($(grep -c '==' "$OUT") pins)"
