#!/usr/bin/env bash
# Build .venv-verl: a separate virtual environment holding verl 0.9.1, TRL 1.16.0 and gymbridge, used only
# by the verl adapter tests (tests/integrations/test_verl_*.py run scripts inside it as subprocesses) and
# the peers suite (tests/peers: gymbridge's objective beside verl's and TRL's own functions).
# verl pins transformers<5.11 (gymbridge's .venv has a newer one), and its wheel lacks cachetools,
# fastapi and uvicorn, which `verl.experimental.agent_loop` imports; the lock adds them.
#
#   bash scripts/setup_verl_venv.sh            # idempotent: a no-op when the venv is up to date
#   VERL_FORCE=1 bash scripts/setup_verl_venv.sh   # rebuild from scratch
#
# Steps: pip install -r requirements-verl.txt (a full lock: verl 0.9.1, torch==2.13.0, transformers
# 5.10.x and every dependency, --no-deps so nothing else is resolved), then gymbridge itself
# (editable, --no-deps), then `pip check` and an import of everything the tests use. A stamp holds
# sha256(requirements-verl.txt) and sha256(pyproject.toml + setup.py): when both match, nothing is
# done; when only gymbridge's changed, gymbridge is reinstalled and checked again (seconds); when the
# lock changed, the venv is rebuilt from scratch.
#
# On failure it exits non-zero with a "!! verl venv setup failed" line and records that line in
# .cache/verl-setup-failed; the verl tests then skip quoting it (GYMBRIDGE_REQUIRE_VERL=1: fail).
#
# Environment knobs:
#   VERL_PYTHON        interpreter to build with (default: python3.11, the lock's)
#   VERL_VENV          target directory (default: <repo>/.venv-verl)
#   VERL_REQUIREMENTS  the lock to install (default: <repo>/requirements-verl.txt)
#   GYMBRIDGE_TORCH_INDEX_URL  install torch==2.13.0 from this index first (as scripts/test.sh does)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
REQ=${VERL_REQUIREMENTS:-$ROOT/requirements-verl.txt}
FAILED_NOTE="$ROOT/.cache/verl-setup-failed"
PY=${VERL_PYTHON:-python3.11}
VENV=${VERL_VENV:-$ROOT/.venv-verl}
STAMP="$VENV/.gymbridge-verl-stamp"

reported=""
fail() {  # one clear line, on stdout and in the note the verl tests' skip reason quotes
    reported=1
    mkdir -p "$(dirname "$FAILED_NOTE")"
    echo "!! verl venv setup failed: $*"
    echo "$(date -u +%FT%TZ) $VENV: $*" > "$FAILED_NOTE"
    exit 1
}
[ -f "$REQ" ] || fail "lock file $REQ not found"
lock_sha=$(sha256sum "$REQ" | cut -d' ' -f1)
want="$lock_sha $(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1) verl==0.9.1 trl==1.16.0"
if [ "${VERL_FORCE:-0}" != "1" ] && [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
    echo "== verl venv up to date ($VENV)"
    exit 0
fi

JOB_TMP="$ROOT/.cache/verl-setup-tmp.$$"
mkdir -p "$JOB_TMP"
export TMPDIR="$JOB_TMP"
trap 'rm -rf "$JOB_TMP"' EXIT

# Two concurrent setups (CI + a developer) must not interleave in one venv.
mkdir -p "$(dirname "$VENV")" "$ROOT/.cache"
exec 9>"$ROOT/.cache/verl-setup.lock"
flock 9
if [ "${VERL_FORCE:-0}" != "1" ] && [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
    echo "== verl venv built by a concurrent setup"
    exit 0
fi

quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
check() {  # pip check, then import what the verl tests use (fail here rather than in pytest)
    step="pip check (the lock does not satisfy verl's or gymbridge's requirements)"
    echo "== pip check"
    "${PIP[@]}" check
    step="importing what the verl tests use"
    (cd "$JOB_TMP" && "$VENV/bin/python" -c "
import verl, transformers, torch
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopWorker, AgentLoopOutput
import gymbridge.integrations.verl as v; v.GymAgentLoop
from verl.trainer.ppo import core_algos
from trl.trainer.grpo_trainer import GRPOTrainer
from importlib.metadata import version
assert version('verl') == '0.9.1', version('verl')
assert version('trl') == '1.16.0', version('trl')
")
}

t0=$(date +%s)
trap 'rc=$?; rm -rf "$JOB_TMP"; if [ $rc -ne 0 ] && [ -z "$reported" ]; then fail "$step (exit $rc; output above)"; fi' EXIT
if [ "${VERL_FORCE:-0}" != "1" ] && [ -x "$VENV/bin/python" ] && [ "$(cut -d' ' -f1 "$STAMP" 2>/dev/null)" = "$lock_sha" ]; then
    step="reinstalling gymbridge (editable, --no-deps)"
    echo "== the lock is unchanged: reinstalling gymbridge into $VENV"
    "${PIP[@]}" install -q --no-deps -e "$ROOT" 2>&1 | quiet
    check
    echo "$want" > "$STAMP"
    rm -f "$FAILED_NOTE"
    echo "== verl venv ready in $(( $(date +%s) - t0 )) s"
    exit 0
fi
echo "== building $VENV with $PY (verl==0.9.1)"
command -v "$PY" >/dev/null || fail "interpreter $PY not found (install Python 3.11 or set VERL_PYTHON)"
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
    || fail "interpreter $PY does not run (set VERL_PYTHON)"
[ "$pyver" = "3.11" ] || fail "interpreter $PY is Python $pyver; requirements-verl.txt is a Python 3.11 lock"
"$PY" -c 'import venv, ensurepip' 2>/dev/null \
    || fail "interpreter $PY lacks venv/ensurepip (e.g. apt-get install python3.11-venv)"
step="creating the venv"
rm -rf "$VENV"
"$PY" -m venv "$VENV"

step="step 1: pip install -r $(basename "$REQ") (a broken or unreachable lock/index)"
echo "== step 1: the lock ($(basename "$REQ"))"
if [ -n "${GYMBRIDGE_TORCH_INDEX_URL:-}" ]; then  # e.g. the PyTorch CPU index off this machine
    "${PIP[@]}" install -q --no-deps "torch==2.13.0" --index-url "$GYMBRIDGE_TORCH_INDEX_URL" 2>&1 | quiet
fi
"${PIP[@]}" install -q --no-deps -r "$REQ" 2>&1 | quiet
step="step 2: gymbridge (editable, --no-deps)"
echo "== step 2: gymbridge (editable, --no-deps)"
"${PIP[@]}" install -q --no-deps -e "$ROOT" 2>&1 | quiet
check
echo "$want" > "$STAMP"
rm -f "$FAILED_NOTE"
echo "== verl venv ready in $(( $(date +%s) - t0 )) s ($(du -sh "$VENV" | cut -f1))"
