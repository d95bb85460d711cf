"""Packages are found, never listed by hand: every package under ``rlalign_verl/``, plus the top-level
``configs/`` folder installed as ``rlalign_verl.configs`` (so ``pkg://rlalign_verl.configs`` resolves from a
wheel, an sdist and an editable install alike). Everything else lives in ``pyproject.toml``."""

from setuptools import find_packages, setup

CONFIGS = {"rlalign_verl.configs": "configs"}

setup(
    packages=[
        *find_packages(include=["rlalign_verl", "rlalign_verl.*"]),
        *CONFIGS,
        *(f"rlalign_verl.configs.{p}" for p in find_packages(where="configs")),
    ],
    package_dir=CONFIGS,
)
