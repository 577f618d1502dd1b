#!/usr/bin/env bash
# Build .venv-gym: a separate virtual environment holding genuine nemo-gym 0.7.0, used only by the
# `gym` conformance suite (tests/gym) and benchmarks/gym_bench.py. gymbridge's own .venv never gets
# nemo-gym or its pins (openai==2.44.0, ray, mlflow, wandb).
#
#   bash scripts/setup_gym_venv.sh          # idempotent: a no-op when the venv is up to date
#   GYM_FORCE=1 bash scripts/setup_gym_venv.sh   # rebuild from scratch
#
# Two-step install (the wheel says Requires-Python >=3.13.14 but runs on 3.11):
#   1. pip install -r requirements-gym.txt   (full lock of the wheel's runtime Requires-Dist, no extras)
#   2. pip install --no-deps --ignore-requires-python nemo-gym==0.7.0
# then `pip check` must be clean. A stamp file holds sha256(requirements-gym.txt) + the nemo-gym
# version; when it matches, nothing is done. When it does not, the venv is rebuilt from scratch so
# no stale package survives a lock change.
#
# On failure it exits non-zero with a "!! gym venv setup failed" line and records that line in
# .cache/gym-setup-failed; the gym suite then skips itself quoting it (scripts/test.sh goes on).
#
# Environment knobs:
#   GYM_PYTHON     interpreter to build with (default: python3.11; must run, and be 3.11 — the lock's)
#   GYM_VENV       target directory (default: <repo>/.venv-gym)
#   GYM_REQUIREMENTS  the lock to install (default: <repo>/requirements-gym.txt)
#   GYM_WHEEL_DIR  folder holding a pre-downloaded nemo_gym-0.7.0 wheel (default: /tmp/ngwheel when it
#                  exists); otherwise the wheel comes from the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
NEMO_GYM_VERSION=0.7.0
REQ=${GYM_REQUIREMENTS:-$ROOT/requirements-gym.txt}
FAILED_NOTE="$ROOT/.cache/gym-setup-failed"
PY=${GYM_PYTHON:-python3.11}
VENV=${GYM_VENV:-$ROOT/.venv-gym}
STAMP="$VENV/.gymbridge-gym-stamp"
WHEEL_DIR=${GYM_WHEEL_DIR:-/tmp/ngwheel}
WHEEL="$WHEEL_DIR/nemo_gym-$NEMO_GYM_VERSION-py3-none-any.whl"

reported=""
fail() {  # one clear line, on stdout and in the note the gym suite's skip reason quotes
    reported=1
    mkdir -p "$(dirname "$FAILED_NOTE")"
    echo "!! gym venv setup failed: $*"
    echo "$(date -u +%FT%TZ) $VENV: $*" > "$FAILED_NOTE"
    exit 1
}
[ -f "$REQ" ] || fail "lock file $REQ not found"
want="$(sha256sum "$REQ" | cut -d' ' -f1) nemo-gym==$NEMO_GYM_VERSION"
if [ "${GYM_FORCE:-0}" != "1" ] && [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
    echo "== gym venv up to date ($VENV, nemo-gym==$NEMO_GYM_VERSION)"
    exit 0
fi

# Job-local scratch for pip and for anything the install starts (Ray reads RAY_TMPDIR).
JOB_TMP="$ROOT/.cache/gym-setup-tmp.$$"
mkdir -p "$JOB_TMP"
export TMPDIR="$JOB_TMP" RAY_TMPDIR="$JOB_TMP"
trap 'rm -rf "$JOB_TMP"' EXIT

# Two concurrent setups (CI + a developer) must not interleave in one venv.
mkdir -p "$(dirname "$VENV")"
mkdir -p "$ROOT/.cache"
exec 9>"$ROOT/.cache/gym-setup.lock"
flock 9
if [ "${GYM_FORCE:-0}" != "1" ] && [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
    echo "== gym venv built by a concurrent setup"
    exit 0
fi

t0=$(date +%s)
echo "== building $VENV with $PY (nemo-gym==$NEMO_GYM_VERSION)"
# Checked before anything is removed: `command -v` alone is fooled by pyenv shims of versions
# that are not installed.
command -v "$PY" >/dev/null || fail "interpreter $PY not found (install Python 3.11 or set GYM_PYTHON)"
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
    || fail "interpreter $PY does not run (a pyenv shim of a version not installed? set GYM_PYTHON)"
[ "$pyver" = "3.11" ] || fail "interpreter $PY is Python $pyver; requirements-gym.txt is a Python 3.11 lock"
"$PY" -c 'import venv, ensurepip' 2>/dev/null \
    || fail "interpreter $PY lacks venv/ensurepip (e.g. apt-get install python3.11-venv)"
step="creating the venv"
# Any later failure (set -e) is reported as the step it happened in.
trap 'rc=$?; rm -rf "$JOB_TMP"; if [ $rc -ne 0 ] && [ -z "$reported" ]; then fail "$step (exit $rc; output above)"; fi' EXIT
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }

step="step 1: pip install -r $(basename "$REQ") (a broken or unreachable lock/index)"
echo "== step 1: runtime dependencies ($(basename "$REQ"))"
"${PIP[@]}" install -q -r "$REQ" 2>&1 | quiet
step="step 2: nemo-gym==$NEMO_GYM_VERSION"
echo "== step 2: nemo-gym==$NEMO_GYM_VERSION (--no-deps --ignore-requires-python)"
if [ -f "$WHEEL" ]; then
    "${PIP[@]}" install -q --no-deps --ignore-requires-python "$WHEEL" 2>&1 | quiet
elif ! "${PIP[@]}" install -q --no-deps --ignore-requires-python "nemo-gym==$NEMO_GYM_VERSION" 2>&1 | quiet; then
    fail "nemo-gym==$NEMO_GYM_VERSION is not on the configured package index; put" \
        "nemo_gym-$NEMO_GYM_VERSION-py3-none-any.whl in a folder and set GYM_WHEEL_DIR to it"
fi
step="pip check (the lock does not satisfy nemo-gym's requirements)"
echo "== pip check"
"${PIP[@]}" check
# Fail here rather than in pytest if the servers the suite starts cannot import.
step="importing the genuine servers the suite starts"
(cd "$JOB_TMP" && "$VENV/bin/python" -c "
import nemo_gym, nemo_gym.server_utils
import resources_servers.example_session_state_mgmt.app, resources_servers.circle_click.app
import responses_api_agents.simple_agent.app, responses_api_agents.gymnasium_agent.app
import environment_servers.legacy_agent.app
from importlib.metadata import version
assert version('nemo-gym') == '$NEMO_GYM_VERSION', version('nemo-gym')
")
echo "$want" > "$STAMP"
rm -f "$FAILED_NOTE"
echo "== gym venv ready in $(( $(date +%s) - t0 )) s ($(du -sh "$VENV" | cut -f1))"
