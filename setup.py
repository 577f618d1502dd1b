"""Package layout only; every other setting is in pyproject.toml.

The example environments live in the repository folder ``environments/`` but install as
``gymbridge_envs``: nemo-gym ships a top-level ``environments`` package, and both must install
into one venv without sharing files. The package list is computed, so a new subpackage of
either tree is packaged without editing a list.
"""

from setuptools import find_packages, setup

ENVS_FOLDER, ENVS_PACKAGE = "environments", "gymbridge_envs"

envs = [ENVS_PACKAGE + name[len(ENVS_FOLDER) :] for name in find_packages(include=[f"{ENVS_FOLDER}*"])]
setup(
    packages=find_packages(include=["gymbridge*"]) + envs,
    package_dir={ENVS_PACKAGE: ENVS_FOLDER},
    package_data={
        "gymbridge": ["py.typed", "run/viewer.html", "configs/*.yaml"],
        ENVS_PACKAGE: ["*/tests/*.json"],
    },
)
