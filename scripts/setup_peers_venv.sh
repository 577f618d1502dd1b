#!/usr/bin/env bash
# Build .venv-peers: a separate virtual environment holding verl 0.9.1 and TRL 1.16.0, used only by the
# `peers` suite (tests/peers: gymbridge's objective against verl's and TRL's own loss, KL, advantage and
# lr-schedule functions). gymbridge's own .venv never gets them (verl pins transformers<5.11).
#
#   bash scripts/setup_peers_venv.sh            # idempotent: a no-op when the venv is up to date
#   PEERS_FORCE=1 bash scripts/setup_peers_venv.sh   # rebuild from scratch
#
# Two steps: pip install -r requirements-peers.txt (TRL with its dependencies, torch==2.13.0, and what
# verl's objective modules import), then pip install --no-deps verl==0.9.1 (its full requirement list
# pulls wandb, hydra, peft, ...; only its pure functions run here). `pip check` would list exactly those
# absent extras, so the check is an import of every module the suite calls instead.
# A stamp holds sha256(requirements-peers.txt) + the two versions; when it matches, nothing is done.
# On failure: a "!! peers venv setup failed" line, recorded in .cache/peers-setup-failed; the peers
# suite then skips itself quoting it (GYMBRIDGE_REQUIRE_PEERS=1 makes that a failure).
#
# Environment knobs: PEERS_PYTHON (default python3.11), PEERS_VENV (default <repo>/.venv-peers),
# PEERS_REQUIREMENTS (default <repo>/requirements-peers.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VERL_VERSION=0.9.1
TRL_VERSION=1.16.0
REQ=${PEERS_REQUIREMENTS:-$ROOT/requirements-peers.txt}
FAILED_NOTE="$ROOT/.cache/peers-setup-failed"
PY=${PEERS_PYTHON:-python3.11}
VENV=${PEERS_VENV:-$ROOT/.venv-peers}
STAMP="$VENV/.gymbridge-peers-stamp"

reported=""
fail() {  # one clear line, on stdout and in the note the peers suite's skip reason quotes
    reported=1
    mkdir -p "$(dirname "$FAILED_NOTE")"
    echo "!! peers venv setup failed: $*"
    echo "$(date -u +%FT%TZ) $VENV: $*" > "$FAILED_NOTE"
    exit 1
}
[ -f "$REQ" ] || fail "lock file $REQ not found"
want="$(sha256sum "$REQ" | cut -d' ' -f1) verl==$VERL_VERSION trl==$TRL_VERSION"
up_to_date() { [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; }
if [ "${PEERS_FORCE:-0}" != "1" ] && up_to_date; then
    echo "== peers venv up to date ($VENV)"
    exit 0
fi

JOB_TMP="$ROOT/.cache/peers-setup-tmp.$$"
mkdir -p "$JOB_TMP"
export TMPDIR="$JOB_TMP" RAY_TMPDIR="$JOB_TMP"
trap 'rm -rf "$JOB_TMP"' EXIT
exec 9>"$ROOT/.cache/peers-setup.lock"  # two concurrent setups must not interleave in one venv
flock 9
if [ "${PEERS_FORCE:-0}" != "1" ] && up_to_date; then
    echo "== peers venv built by a concurrent setup"
    exit 0
fi

t0=$(date +%s)
echo "== building $VENV with $PY (verl==$VERL_VERSION, trl==$TRL_VERSION)"
command -v "$PY" >/dev/null || fail "interpreter $PY not found (install Python 3.11 or set PEERS_PYTHON)"
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
    || fail "interpreter $PY does not run (set PEERS_PYTHON)"
[ "$pyver" = "3.11" ] || fail "interpreter $PY is Python $pyver; requirements-peers.txt is a Python 3.11 lock"
step="creating the venv"
trap 'rc=$?; rm -rf "$JOB_TMP"; if [ $rc -ne 0 ] && [ -z "$reported" ]; then fail "$step (exit $rc; output above)"; fi' EXIT
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }

step="step 1: pip install -r $(basename "$REQ")"
echo "== step 1: TRL and the modules verl's objective imports ($(basename "$REQ"))"
"${PIP[@]}" install -q -r "$REQ" 2>&1 | quiet
step="step 2: verl==$VERL_VERSION --no-deps"
echo "== step 2: verl==$VERL_VERSION (--no-deps)"
"${PIP[@]}" install -q --no-deps "verl==$VERL_VERSION" 2>&1 | quiet
step="importing the functions the peers suite calls"
(cd "$JOB_TMP" && VERL_USE_EXTERNAL_PLUGINS=none "$VENV/bin/python" -c "
import trl, verl
from trl import GRPOTrainer
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, compute_policy_loss_vanilla, kl_penalty
from verl.utils.torch_functional import get_cosine_schedule_with_warmup
assert (trl.__version__, verl.__version__) == ('$TRL_VERSION', '$VERL_VERSION'), (trl.__version__, verl.__version__)
")
echo "$want" > "$STAMP"
rm -f "$FAILED_NOTE"
echo "== peers venv ready in $(( $(date +%s) - t0 )) s ($(du -sh "$VENV" | cut -f1))"
