#!/usr/bin/env bash
# The one test command: set up (idempotently) and run the whole suite.
#   bash scripts/test.sh                          # lint + types + default tests, on the locked set-up
#   bash scripts/test.sh -k media                 # extra args go to pytest
#   GYMBRIDGE_DEPS=latest bash scripts/test.sh    # the same suite on the newest releases pyproject.toml allows
# The locked set-up (default, and CI): .venv installs gymbridge[dev,ray,train,trl] with
# requirements-test.txt (scripts/lock.sh writes it) as pip constraints, so every package has the
# version the lock names whatever PyPI serves that day; it reinstalls only when pyproject.toml,
# setup.py or the lock changed (the install stamp holds their hash). GYMBRIDGE_DEPS=latest builds
# .venv-latest instead, upgraded on every run to the newest releases the ranges allow (torch stays
# the CPU wheel), prints which versions differ from the lock, and runs the same suite in it: not part
# of CI; docs/compatibility.md records its last run. The genuine
# nemo-gym venv (.venv-gym), the real vLLM venv (.venv-vllm, scripts/setup_vllm_venv.sh) and the verl
# venv (.venv-verl, scripts/setup_verl_venv.sh: verl 0.9.1 pins transformers<5.11) are built in the
# background meanwhile from their own locks (their logs are printed before their tests;
# GYMBRIDGE_SKIP_VLLM=1 / GYMBRIDGE_SKIP_VERL=1 skip them).
# The plain command runs the default tests on GYMBRIDGE_TEST_WORKERS pytest-xdist workers (default:
# the CPU count, at most 4; 1 = serial), one test file per worker; with arguments, pytest runs
# exactly them (add `-n 2` for parallel). The learning tests (-m learning) come last, on 2 workers.
# pytest includes tests/packaging: it builds a torch-free venv (the base install, constrained by the
# lock on the locked set-up) and a venv with gymbridge beside nemo-gym 0.7.0 (over .venv-gym), each in
# a temporary folder (~1 min together).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
# shellcheck source=scripts/deps.sh
source scripts/deps.sh
DEPS=${GYMBRIDGE_DEPS:-locked}
case "$DEPS" in
    locked) VENV="$ROOT/.venv" ;;
    latest) VENV="$ROOT/.venv-latest" ;;
    *) echo "!! GYMBRIDGE_DEPS=$DEPS: expected locked (the default) or latest"; exit 2 ;;
esac
[ -f "$TEST_LOCK" ] || { echo "!! $TEST_LOCK is missing (bash scripts/lock.sh writes it)"; exit 2; }
STAMP="$VENV/.gymbridge-install-stamp"
want=$(cat pyproject.toml setup.py "$TEST_LOCK" | sha256sum | cut -d' ' -f1)
[ "$DEPS" = latest ] && want="latest $(date +%s)"  # never up to date: upgraded on every run

# Genuine NeMo Gym venv for the conformance suite (skips itself when up to date), built beside the
# .venv install: the two pip runs are mostly single-threaded, so together they use both cores.
gym_pid=""
GYM_LOG="$ROOT/.cache/gym-setup.log"
if [ -x scripts/setup_gym_venv.sh ] && [ "${GYMBRIDGE_SKIP_GYM:-0}" != "1" ]; then
    mkdir -p "$ROOT/.cache"
    bash scripts/setup_gym_venv.sh >"$GYM_LOG" 2>&1 &
    gym_pid=$!
fi
# Real vLLM venv for the vllm conformance suite (tests/vllm; skips itself when up to date), also
# built in the background: mostly unpacking vLLM's CUDA torch and kernels (several GB).
vllm_pid=""
VLLM_LOG="$ROOT/.cache/vllm-setup.log"
if [ -x scripts/setup_vllm_venv.sh ] && [ "${GYMBRIDGE_SKIP_VLLM:-0}" != "1" ]; then
    mkdir -p "$ROOT/.cache"
    bash scripts/setup_vllm_venv.sh >"$VLLM_LOG" 2>&1 &
    vllm_pid=$!
fi
# verl venv (verl 0.9.1 + TRL 1.16.0) for the verl agent-loop tests and tests/peers, same way.
verl_pid=""
VERL_LOG="$ROOT/.cache/verl-setup.log"
if [ -x scripts/setup_verl_venv.sh ] && [ "${GYMBRIDGE_SKIP_VERL:-0}" != "1" ]; then
    mkdir -p "$ROOT/.cache"
    bash scripts/setup_verl_venv.sh >"$VERL_LOG" 2>&1 &
    verl_pid=$!
fi
VERL_TESTS=(tests/integrations/test_verl_agent_loop.py tests/peers)  # both run in .venv-verl
# an early exit (a failed install, lint) waits for them rather than leaving them building alone
trap 'for p in $gym_pid $vllm_pid $verl_pid; do wait "$p" 2>/dev/null || true; done' EXIT

if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PY" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    echo "== installing gymbridge[$TEST_EXTRAS] ($DEPS) into $VENV"
    t0=$(date +%s)
    # torch: an installed torch of any build (CPU, CUDA, ROCm) is kept; a GPU machine lets pip pick
    # a CUDA build in the project's range; elsewhere the CPU wheel is pinned (an unpinned torch
    # from PyPI is the CUDA build). GYMBRIDGE_TORCH_INDEX_URL installs torch from that index first
    # (e.g. https://download.pytorch.org/whl/cpu off this machine). A kept torch replaces the lock's
    # torch pin (the lock pins the CPU release), and no upgrade moves it; pip's CUDA pick has no pin.
    torch_pin="$TORCH_CPU"
    torch_keep=""
    if torch_keep=$("$VENV/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null); then
        torch_pin=""
        echo "   keeping the installed torch $torch_keep"
    elif [ -n "${GYMBRIDGE_TORCH_INDEX_URL:-}" ]; then
        "$VENV/bin/pip" install -q --disable-pip-version-check "torch>=2.4,<3" --index-url "$GYMBRIDGE_TORCH_INDEX_URL"
        torch_pin=""
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        torch_pin=""
    fi
    constraints="$ROOT/.cache/constraints-$DEPS.txt"
    mkdir -p "$ROOT/.cache"
    : >"$constraints"
    [ "$DEPS" = locked ] && grep -v '^torch==' "$TEST_LOCK" >>"$constraints"
    if [ -n "$torch_pin" ]; then
        [ "$DEPS" = locked ] && grep '^torch==' "$TEST_LOCK" >>"$constraints"
    elif [ -n "$torch_keep" ]; then
        echo "torch==${torch_keep%%+*}" >>"$constraints"
    fi
    deps_args=(-c "$constraints")
    [ "$DEPS" = latest ] && deps_args+=(--upgrade --upgrade-strategy eager)
    log="$VENV/.gymbridge-install.log"
    set +e
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install -q --disable-pip-version-check "${deps_args[@]}" -e ".[$TEST_EXTRAS]" $torch_pin >"$log" 2>&1
    rc=$?
    set -e
    grep -v "is ignored: it is neither a file nor a directory" "$log" || true
    if [ $rc -ne 0 ]; then echo "!! pip install failed (exit $rc); nothing was stamped"; exit $rc; fi
    "$VENV/bin/python" -c "import gymbridge, gymbridge_envs, torch, transformers, trl" # fail here, not in pytest
    echo "$want" > "$STAMP"
    echo "== installed in $(( $(date +%s) - t0 )) s"
fi
if [ "$DEPS" = latest ]; then
    echo "== the newest releases against $TEST_LOCK"
    "$VENV/bin/pip" freeze --all --exclude-editable --disable-pip-version-check 2>/dev/null \
        | "$VENV/bin/python" scripts/lock_diff.py "$TEST_LOCK" | tee "$ROOT/.cache/latest-vs-lock.txt"
else
    # the packaging tests' torch-free venv installs under the same lock
    export GYMBRIDGE_TEST_CONSTRAINTS="$ROOT/$TEST_LOCK"
fi

# Headless Chromium for the run viewer test (a Debian package); installed once, never upgraded.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    echo "== installing chromium (viewer test)"
    as_root=""
    [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && as_root="sudo -n"
    if ! { $as_root apt-get install -y -q chromium >/dev/null 2>&1 \
        || { $as_root apt-get update -q >/dev/null 2>&1 && $as_root apt-get install -y -q chromium >/dev/null 2>&1; }; }; then
        echo "!! chromium could not be installed: the viewer test fails where GYMBRIDGE_REQUIRE_CHROMIUM=1"
    fi
fi

echo "== ruff"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
echo "== mypy --strict gymbridge"
"$VENV/bin/mypy" gymbridge
if [ -n "$gym_pid" ]; then
    gym_rc=0
    wait "$gym_pid" || gym_rc=$?
    cat "$GYM_LOG"
    [ $gym_rc -eq 0 ] || echo "!! gym venv setup failed: the gym suite will be skipped"
    gym_pid=""
fi
wait_vllm() {  # the vLLM venv's build goes on while the default and learning tests run
    if [ -n "$vllm_pid" ]; then
        vllm_rc=0
        wait "$vllm_pid" || vllm_rc=$?
        cat "$VLLM_LOG"
        [ $vllm_rc -eq 0 ] || echo "!! vllm venv setup failed: the vllm suite will be skipped"
        vllm_pid=""
    fi
}
wait_verl() {  # likewise the verl venv's build, for the verl tests that run after them
    if [ -n "$verl_pid" ]; then
        verl_rc=0
        wait "$verl_pid" || verl_rc=$?
        cat "$VERL_LOG"
        [ $verl_rc -eq 0 ] || echo "!! verl venv setup failed: the verl tests will be skipped"
        verl_pid=""
    fi
}
parallel=()
workers=${GYMBRIDGE_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}
case "$workers" in '' | *[!0-9]*) echo "!! GYMBRIDGE_TEST_WORKERS=$workers is not a number"; exit 2 ;; esac
[ "$workers" -le 4 ] || [ -n "${GYMBRIDGE_TEST_WORKERS:-}" ] || workers=4
if [ $# -eq 0 ] && [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
# The plain command leaves tests/vllm and the verl tests for last (their venvs may still be building);
# with arguments, pytest runs exactly them (after both venvs are ready).
if [ $# -eq 0 ]; then default=(--ignore=tests/vllm --ignore="${VERL_TESTS[0]}" --ignore="${VERL_TESTS[1]}"); else default=(); wait_vllm; wait_verl; fi
echo "== pytest${parallel[*]:+ ${parallel[*]}} ${default[*]}"
set +e
"$VENV/bin/python" -m pytest ${parallel[@]+"${parallel[@]}"} ${default[@]+"${default[@]}"} "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests"; fi
# The learning runs (minutes each): run by the plain command (CI), not when pytest args are given.
# The default smoke learns, the multi-turn variant learns, the controls stay at
# chance; each pins one torch thread, so two workers give the same numbers as one.
if [ $rc -eq 0 ] && [ $# -eq 0 ]; then
    echo "== pytest -m learning -n 2 (the default smoke and the multi-turn variant learn; the controls stay at chance)"
    set +e
    "$VENV/bin/python" -m pytest -m learning -n 2 --dist load
    rc=$?
    set -e
fi
if [ $rc -eq 0 ] && [ $# -eq 0 ]; then
    wait_verl
    echo "== pytest ${VERL_TESTS[*]} (verl 0.9.1's agent-loop post-processing; the objective beside verl's and TRL's, in .venv-verl)"
    set +e
    "$VENV/bin/python" -m pytest "${VERL_TESTS[@]}"
    rc=$?
    set -e
fi
if [ $rc -eq 0 ] && [ $# -eq 0 ]; then
    wait_vllm
    echo "== pytest tests/vllm -n 2 (gymbridge's vLLM backend against real vLLM, on CPU)"
    set +e
    "$VENV/bin/python" -m pytest tests/vllm -n 2 --dist load
    rc=$?
    set -e
fi
exit $rc
