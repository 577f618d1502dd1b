#!/usr/bin/env bash
# Build .venv-vllm: a separate virtual environment holding real vLLM (and the CUDA torch it pins),
# used only by the `vllm` conformance suite (tests/vllm). On a machine without a GPU vLLM is only
# imported: its serialisation, input processors, model classes and weight mappers run on CPU, the
# engine does not. gymbridge's own .venv never gets vLLM or its pins (torch==2.14.0, transformers<5.21).
#
#   bash scripts/setup_vllm_venv.sh             # idempotent: a no-op when the venv is up to date
#   VLLM_FORCE=1 bash scripts/setup_vllm_venv.sh   # rebuild from scratch
#
# One install from a full lock: pip install --no-deps -r requirements-vllm.txt (vllm==0.33.0, every
# package of its resolved runtime closure, and gymbridge's base dependencies, so the suite's scripts
# import gymbridge from the repository), then `pip check` must be clean. A stamp file holds
# sha256(requirements-vllm.txt) + the vLLM version; when it matches, nothing is done. When it does
# not, the venv is rebuilt from scratch so no stale package survives a lock change.
#
# On failure it exits non-zero with a "!! vllm venv setup failed" line and records that line in
# .cache/vllm-setup-failed; the vllm suite then skips itself quoting it (scripts/test.sh goes on),
# or fails where GYMBRIDGE_REQUIRE_VLLM=1.
#
# Environment knobs:
#   VLLM_PYTHON        interpreter to build with (default: python3.11; must run, and be 3.11: the lock's)
#   VLLM_VENV          target directory (default: <repo>/.venv-vllm)
#   VLLM_REQUIREMENTS  the lock to install (default: <repo>/requirements-vllm.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VLLM_VERSION=0.33.0
REQ=${VLLM_REQUIREMENTS:-$ROOT/requirements-vllm.txt}
FAILED_NOTE="$ROOT/.cache/vllm-setup-failed"
PY=${VLLM_PYTHON:-python3.11}
VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
STAMP="$VENV/.gymbridge-vllm-stamp"

reported=""
fail() {  # one clear line, on stdout and in the note the vllm suite's skip reason quotes
    reported=1
    mkdir -p "$(dirname "$FAILED_NOTE")"
    echo "!! vllm venv setup failed: $*"
    echo "$(date -u +%FT%TZ) $VENV: $*" > "$FAILED_NOTE"
    exit 1
}
[ -f "$REQ" ] || fail "lock file $REQ not found"
want="$(sha256sum "$REQ" | cut -d' ' -f1) vllm==$VLLM_VERSION"
if [ "${VLLM_FORCE:-0}" != "1" ] && [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
    echo "== vllm venv up to date ($VENV, vllm==$VLLM_VERSION)"
    exit 0
fi
grep -qx "vllm==$VLLM_VERSION" "$REQ" || fail "$(basename "$REQ") does not pin vllm==$VLLM_VERSION"

# Job-local scratch for pip (the wheels unpack to several GB).
JOB_TMP="$ROOT/.cache/vllm-setup-tmp.$$"
mkdir -p "$JOB_TMP"
export TMPDIR="$JOB_TMP"
trap 'rm -rf "$JOB_TMP"' EXIT

# Two concurrent setups (CI + a developer) must not interleave in one venv.
mkdir -p "$(dirname "$VENV")" "$ROOT/.cache"
exec 9>"$ROOT/.cache/vllm-setup.lock"
flock 9
if [ "${VLLM_FORCE:-0}" != "1" ] && [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
    echo "== vllm venv built by a concurrent setup"
    exit 0
fi

t0=$(date +%s)
echo "== building $VENV with $PY (vllm==$VLLM_VERSION)"
# Checked before anything is removed: `command -v` alone is fooled by pyenv shims of versions
# that are not installed.
command -v "$PY" >/dev/null || fail "interpreter $PY not found (install Python 3.11 or set VLLM_PYTHON)"
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
    || fail "interpreter $PY does not run (a pyenv shim of a version not installed? set VLLM_PYTHON)"
[ "$pyver" = "3.11" ] || fail "interpreter $PY is Python $pyver; requirements-vllm.txt is a Python 3.11 lock"
"$PY" -c 'import venv, ensurepip' 2>/dev/null \
    || fail "interpreter $PY lacks venv/ensurepip (e.g. apt-get install python3.11-venv)"
step="creating the venv"
# Any later failure (set -e) is reported as the step it happened in.
trap 'rc=$?; rm -rf "$JOB_TMP"; if [ $rc -ne 0 ] && [ -z "$reported" ]; then fail "$step (exit $rc; output above)"; fi' EXIT
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }

step="pip install --no-deps -r $(basename "$REQ") (a broken or unreachable lock/index)"
echo "== installing the lock ($(basename "$REQ"), --no-deps)"
"${PIP[@]}" install -q --no-deps -r "$REQ" 2>&1 | quiet
step="pip check (the lock does not satisfy vllm's requirements)"
echo "== pip check"
"${PIP[@]}" check
# Fail here rather than in pytest if the modules the suite uses cannot import without a GPU.
step="importing the vLLM modules the suite uses"
(cd "$JOB_TMP" && "$VENV/bin/python" -c "
import vllm, vllm.inputs, vllm.v1.engine.async_llm, vllm.v1.serial_utils, vllm.multimodal
import vllm.model_executor.models.qwen2_vl, vllm.model_executor.models.qwen2_5_omni_thinker
from importlib.metadata import version
assert version('vllm') == '$VLLM_VERSION', version('vllm')
")
echo "$want" > "$STAMP"
rm -f "$FAILED_NOTE"
echo "== vllm venv ready in $(( $(date +%s) - t0 )) s ($(du -sh "$VENV" | cut -f1))"
