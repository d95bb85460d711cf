"""The product as users install it: the wheel and the sdist, built from this tree's files, each installed into a
fresh virtual environment with the checkout off the path, run from there.

Each fresh environment gets the package from the built artifact only (``pip install --no-deps``); its
third-party dependencies (torch, transformers, verl, vLLM ...) come from this test environment through a ``.pth``
line, which adds the directory without running its ``.pth`` files, so the editable install of this tree stays
off. What is checked is what a packaging mistake breaks: every module of the tree is in both artifacts and
imports from the installed copy, the CLI starts (``--help``, ``profiles``), verl's plugin entry point loads,
``pkg://rlalign_verl.configs`` composes, and the main job (the default ``rlalign-verl diagnose``) runs from the
wheel. The sdist's installed files are checked equal to the wheel's, so the main job is not run twice.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
TREE_MODULES = sorted(
    p.relative_to(ROOT).as_posix()
    for p in (ROOT / "rlalign_verl").rglob("*.py")
    if "__pycache__" not in p.parts
)
CONFIGS = sorted(p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yaml"))
BUILD = """
import sys
import setuptools.build_meta as backend
kind, out = sys.argv[1], sys.argv[2]
print((backend.build_wheel if kind == "wheel" else backend.build_sdist)(out))
"""
CHECK = """
import importlib, importlib.metadata as md, importlib.util, json, pkgutil, sys
import rlalign_verl
site = sys.argv[1]
mods, failed = [], {}
for info in pkgutil.walk_packages(rlalign_verl.__path__, "rlalign_verl."):
    mods.append(info.name)
    try:  # __main__ runs the CLI when imported: located, not imported
        if info.name.endswith(".__main__"):
            where = importlib.util.find_spec(info.name).origin
        else:
            where = importlib.import_module(info.name).__file__
        assert (where or "").startswith(site), where
    except Exception as err:  # reported, judged by the test
        failed[info.name] = f"{type(err).__name__}: {err}"
eps = [ep for ep in md.entry_points(group="verl.plugins") if ep.name == "rlalign_verl"]
plugin = eps[0].load() if eps else None
print(json.dumps({"file": rlalign_verl.__file__, "modules": sorted(mods), "failed": failed,
                  "plugin": getattr(plugin, "__file__", None)}))
"""
COMPOSE = """
import json, sys
import rlalign_verl.configs
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
with initialize_config_module(config_module="rlalign_verl.configs", version_base=None):
    ours = compose("rlalign_ppo_trainer", overrides=["alignment=all"])
with initialize_config_module(config_module="verl.trainer.config", version_base=None):
    theirs = compose("ppo_trainer", overrides=["hydra.searchpath=[pkg://rlalign_verl.configs]", "+alignment=rope"])
print(json.dumps({"ours": OmegaConf.to_container(ours.alignment, resolve=True)["regions"],
                  "theirs": OmegaConf.to_container(theirs.alignment, resolve=True)["regions"],
                  "configs_dir": list(rlalign_verl.configs.__path__)}))
"""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 600), **kw)
    assert done.returncode == 0, f"{cmd}: rc {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    """The wheel and the sdist, built from a copy of the tree's files (tracked + untracked, not ignored)."""
    src = tmp_path_factory.mktemp("src")
    listed = _run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT).stdout.split()
    for name in listed:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    built = {}
    for kind in ("wheel", "sdist"):
        name = _run([sys.executable, "-c", BUILD, kind, str(out)], cwd=src).stdout.split()[-1]
        built[kind] = out / name
    return built


def _fresh_env(where: Path, artifact: Path) -> tuple[Path, Path]:
    """A new venv with ``artifact`` installed; returns (its bin folder, its site-packages)."""
    # --without-pip: pip and setuptools come with the dependencies (the venv's bundled setuptools is too old to
    # build this project without build isolation, and isolation would download one)
    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(where)])
    py = where / "bin" / "python"
    site = Path(
        _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    )
    # this environment's site folders (an overlay venv's and the one it extends), as plain paths: their .pth
    # files, the editable install's among them, are not run
    deps = [p for p in sys.path if p.rstrip("/").endswith("site-packages")] or [
        sysconfig.get_paths()["purelib"]
    ]
    (site / "_rlalign_test_deps.pth").write_text("\n".join(deps) + "\n")
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", str(artifact)],
         cwd=where)  # fmt: skip
    return where / "bin", site


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # under scripts/as_host_class.sh the machine's class travels on PYTHONPATH (its hook folder holds no package)
    hooks = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p.endswith("host_class")]
    if hooks and os.environ.get("RLALIGN_HOST_CLASS"):
        env["PYTHONPATH"] = os.pathsep.join(hooks)
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", TOKENIZERS_PARALLELISM="false")
    return env


def test_both_artifacts_hold_every_module_and_config_once(artifacts: dict[str, Path]) -> None:
    wheel = zipfile.ZipFile(artifacts["wheel"]).namelist()
    assert sorted(n for n in wheel if n.startswith("rlalign_verl/") and n.endswith(".py")
                  and not n.startswith("rlalign_verl/configs/")) == TREE_MODULES  # fmt: skip
    assert sorted(n.removeprefix("rlalign_verl/configs/") for n in wheel
                  if n.startswith("rlalign_verl/configs/") and n.endswith(".yaml")) == CONFIGS  # fmt: skip
    assert not any(n.startswith("configs/") for n in wheel)  # not a second, top-level copy
    with tarfile.open(artifacts["sdist"]) as tar:
        top = tar.getnames()[0].split("/")[0]
        sdist = {n.removeprefix(top + "/") for n in tar.getnames()}
    assert set(TREE_MODULES) <= sdist and {f"configs/{c}" for c in CONFIGS} <= sdist
    assert {"pyproject.toml", "setup.py", "README.md"} <= sdist


@pytest.fixture(scope="module")
def wheel_env(artifacts, tmp_path_factory) -> tuple[Path, Path]:
    return _fresh_env(tmp_path_factory.mktemp("wheel-env") / "venv", artifacts["wheel"])


@pytest.fixture(scope="module")
def sdist_env(artifacts, tmp_path_factory) -> tuple[Path, Path]:
    return _fresh_env(tmp_path_factory.mktemp("sdist-env") / "venv", artifacts["sdist"])


def _installed_files(site: Path) -> set[str]:
    return {p.relative_to(site).as_posix() for p in (site / "rlalign_verl").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}  # fmt: skip


@pytest.mark.verl  # the config composition needs verl's Hydra configs
@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_installed_apart_every_module_imports_and_the_cli_starts(kind: str, request, tmp_path: Path) -> None:
    bin_dir, site = request.getfixturevalue(f"{kind}_env")
    env = _env()
    got = json.loads(_run([str(bin_dir / "python"), "-c", CHECK, str(site)], cwd=tmp_path, env=env).stdout)
    assert got["file"].startswith(str(site))  # the installed copy, not the checkout
    tree = sorted(m.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for m in TREE_MODULES)
    assert got["modules"] == sorted([m for m in tree if m != "rlalign_verl"] + ["rlalign_verl.configs"])
    # a module may need an optional third-party package this environment lacks; never one of ours
    assert not [e for e in got["failed"].values() if "rlalign_verl" in e], got["failed"]
    assert got["plugin"] and got["plugin"].startswith(str(site))  # verl.plugins entry point
    helped = _run([str(bin_dir / "rlalign-verl"), "--help"], cwd=tmp_path, env=env).stdout
    assert all(cmd in helped for cmd in ("diagnose", "report", "profiles"))
    listed = _run([str(bin_dir / "rlalign-verl"), "profiles"], cwd=tmp_path, env=env).stdout
    assert "vllm-cpu" in listed and "sglang" in listed
    composed = json.loads(
        _run([str(bin_dir / "python"), "-c", COMPOSE], cwd=tmp_path, env=env).stdout.splitlines()[-1]
    )
    assert composed["ours"] == ["rope", "swiglu", "rmsnorm"] and composed["theirs"] == ["rope"]
    assert all(p.startswith(str(site)) for p in composed["configs_dir"])


def test_the_sdist_installs_the_same_files_as_the_wheel(wheel_env, sdist_env) -> None:
    assert _installed_files(sdist_env[1]) == _installed_files(wheel_env[1])


def _is_png(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.engine
def test_the_main_job_runs_from_the_installed_wheel(wheel_env, tmp_path: Path) -> None:
    """The README's main job, ``rlalign-verl diagnose`` on its built-in default, run from the wheel install: the
    compiled engine path, the floor, the op probe and the recommendation (also run by the version matrix)."""
    from rlalign_verl.tools.diagnose.runner import engine_distribution

    if engine_distribution() is None:
        pytest.skip("vLLM is not installed (pip install 'rlalign-verl[engine]')")
    bin_dir, _ = wheel_env
    out = tmp_path / "out"
    text = _run([str(bin_dir / "rlalign-verl"), "diagnose", "--out", str(out)], cwd=tmp_path, env=_env(),
                timeout=1500).stdout  # fmt: skip
    res = json.loads((out / "diagnose.json").read_text())
    eng = res["engine"]
    installed = importlib.metadata.version("vllm-cpu")  # the pin set's 0.31.0, or the version matrix's 0.32.0
    assert (eng["name"], eng["version"], eng["mode"], eng["profile"]) == (
        "vllm-cpu",
        installed,
        "compiled",
        "vllm-cpu",
    )
    assert eng["compilation"]["mode"] == "DYNAMO_TRACE_ONCE"
    assert res["model"]["model_type"] == "qwen2" and res["sampling"]["num_prompts"] == 32
    assert set(res["settings"]) >= {"none", "rope", "swiglu", "rmsnorm", "all"}
    for r in [*res["settings"].values(), res["floor"]]:
        assert all(math.isfinite(v) for k, v in r.items() if k.startswith("mismatch/"))
        assert r["mismatch/num_tokens"] == 32 * 32
    none, full, floor = (x["mismatch/logp_abs_diff_mean"] for x in (res["settings"]["none"], res["settings"]["all"],
                                                                      res["floor"]))  # fmt: skip
    print(f"default run: none {none:.4f} all {full:.4f} floor {floor:.4f}, timing {res['timing']}")
    assert full < none
    # floor <= all: the compiled floor runs the engine's own ops through Inductor; it may differ from our
    # aligned functions only by the variance reduction order (1 fp32 ulp of rsqrt, rarely a bf16 flip),
    # so allow 2% noise on top of the floor.
    assert floor <= full * 1.02
    assert res["floor"]["compiled"] is True
    probe = res["op_probe"]
    assert probe["recommended"] == {"eager": "vllm-cpu-eager", "compiled": "vllm-cpu"}
    for mode, prof in (("eager", "vllm-cpu-eager"), ("compiled", "vllm-cpu")):
        for region, v in probe["modes"][mode][prof].items():
            assert v["identical"] == 1.0 and v["max_ulp"] == 0, (mode, region, v)
    # HF's own rounding is not what the engine does
    assert probe["modes"]["compiled"]["hf"]["rmsnorm"]["identical"] < 0.99
    assert res["recommendation"]["regions"] and "recommendation: align" in text
    assert "floor (engine ops)" in text and f"vllm-cpu {installed}" in text
    assert _is_png(out / "gaps.png") and _is_png(out / "abs_diff.png")
    assert (out / "rollouts.jsonl").is_file()
    assert res["timing"]["total_s"] > 0
