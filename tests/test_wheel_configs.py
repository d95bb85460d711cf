"""The Hydra configs travel in the wheel: built from this tree, installed apart, ``pkg://rlalign_verl.configs``
resolves from it (one source: the top-level ``configs/`` folder, packaged as ``rlalign_verl.configs``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

pytestmark = [pytest.mark.verl, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yaml"))

COMPOSE = """
import json, sys
import rlalign_verl
from hydra import compose, initialize_config_dir, initialize_config_module
from omegaconf import OmegaConf
assert rlalign_verl.__file__.startswith(sys.argv[1]), rlalign_verl.__file__  # the installed wheel, not the tree
with initialize_config_module(config_module="rlalign_verl.configs", version_base=None):
    ours = compose("rlalign_ppo_trainer", overrides=["alignment=all"])
with initialize_config_module(config_module="verl.trainer.config", version_base=None):
    theirs = compose("ppo_trainer", overrides=["hydra.searchpath=[pkg://rlalign_verl.configs]", "+alignment=rope"])
print(json.dumps({"ours": OmegaConf.to_container(ours.alignment, resolve=True)["regions"],
                  "theirs": OmegaConf.to_container(theirs.alignment, resolve=True)["regions"],
                  "configs_dir": list(rlalign_verl.configs.__path__)}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy of the tree's files (tracked + untracked, not ignored): no stale build/ folder leaks in
    src = tmp_path_factory.mktemp("src")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()  # fmt: skip
    for name in listed:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        str(src),
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("rlalign_verl-*.whl")
    return path


def test_the_wheel_holds_every_config_once(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    packaged = sorted(
        n.removeprefix("rlalign_verl/configs/") for n in names if n.startswith("rlalign_verl/configs/")
    )
    assert [n for n in packaged if n.endswith(".yaml")] == CONFIGS
    assert not any(n.startswith("configs/") for n in names)  # not a second, top-level copy
    assert sum(n.endswith("alignment/default.yaml") for n in names) == 1


def test_pkg_configs_resolve_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)]
    done = subprocess.run(install, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=str(site))  # ahead of the editable install of this tree
    run = subprocess.run([sys.executable, "-c", COMPOSE, str(site)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["ours"] == ["rope", "swiglu", "rmsnorm"] and got["theirs"] == ["rope"]
    assert all(p.startswith(str(site)) for p in got["configs_dir"])
