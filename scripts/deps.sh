# Sourced by scripts/test.sh and scripts/lock.sh: what gymbridge's own test venv installs, in one place.
#   TEST_EXTRAS  the extras of the editable install (.venv and .venv-latest)
#   TORCH_CPU    the torch release of the CPU test venvs (the CPU wheel on these machines); the lock
#                pins it too, and pyproject.toml keeps its own range open for GPU users
#   TEST_LOCK    the lock of .venv: every package with its version, written by scripts/lock.sh and
#                used by scripts/test.sh as pip constraints
# shellcheck shell=bash disable=SC2034
TEST_EXTRAS="dev,ray,train,trl"
TORCH_CPU="torch==2.13.0"
TEST_LOCK="requirements-test.txt"
