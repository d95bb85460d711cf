"""The GRPO recipes compose a config verl accepts, for every recipe x ALIGN value (dry runs, CPU).

Each recipe prints the exact command it would run (``DRY_RUN=print``); its Hydra overrides are then
composed with our primary config (what ``python -m rlalign_verl.main_ppo`` does) and checked with verl's
own ``validate_config`` (which instantiates the actor/rollout/ref dataclasses) and ours. One recipe is also
run end to end with ``DRY_RUN=1`` (``--cfg job --resolve`` in a real subprocess).
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from hydra import compose, initialize_config_module  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from rlalign_verl.catalog.profiles import get_profile  # noqa: E402
from rlalign_verl.request.spec import RESOLVED_KEYS, AlignmentSpec  # noqa: E402
from rlalign_verl.verl.config import read_spec, resolve_spec  # noqa: E402

pytestmark = pytest.mark.verl

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("grpo_*.sh"))
ALIGNS = {"none": [], "rope": ["rope"], "all": ["rope", "swiglu", "rmsnorm"]}


def _env(**knobs: str) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("ALIGN", "ENGINE", "MODEL_SIZE", "NNODES", "DRY_RUN")
    }
    env.update(HF_HUB_OFFLINE="1", PYTHON=sys.executable, **knobs)
    return env


def run_recipe(script: str, *args: str, timeout: int = 60, **knobs: str) -> subprocess.CompletedProcess[str]:
    """``bash recipes/<script> <args>`` with ``knobs`` as its env vars (other knobs of this shell cleared)."""
    return subprocess.run(
        ["bash", str(ROOT / "recipes" / script), *args],
        capture_output=True,
        text=True,
        env=_env(**knobs),
        timeout=timeout,
    )


def recipe_command(recipe: str, **knobs: str) -> list[str]:
    out = run_recipe(recipe, DRY_RUN="print", **knobs)
    assert out.returncode == 0, out.stderr
    return shlex.split(out.stdout)


def compose_recipe(recipe: str, **knobs: str):
    argv = recipe_command(recipe, **knobs)
    assert argv[:3] == [sys.executable, "-m", "rlalign_verl.main_ppo"], argv[:3]
    with initialize_config_module(config_module="rlalign_verl.configs", version_base=None):
        return compose("rlalign_ppo_trainer", overrides=argv[3:])


def verl_accepts(cfg) -> None:
    """verl's own driver-side validation (dataclass instantiation, batch-size arithmetic) + ours."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    cfg = copy.deepcopy(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


def _flat(node, prefix="") -> dict:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_verl_accepts_it(recipe):
    resolved = {}
    for align, regions in ALIGNS.items():
        cfg = compose_recipe(recipe, ALIGN=align)
        plain = OmegaConf.to_container(cfg, resolve=True)
        resolved[align] = plain
        defaults = {k: v for k, v in AlignmentSpec().to_dict().items() if k not in RESOLVED_KEYS}
        assert plain["alignment"] == {**defaults, "regions": regions}
        assert plain["actor_rollout_ref"]["model"]["override_config"]["rlalign_spec"]["regions"] == regions
        assert plain["actor_rollout_ref"]["rollout"]["calculate_log_probs"] is True
        assert plain["algorithm"]["adv_estimator"] == "grpo"
        assert plain["critic"]["model"]["override_config"] == {}
        rollout = plain["actor_rollout_ref"]["rollout"]["name"]
        profile = resolve_spec(cfg, read_spec(cfg), on_cuda=True)[0].engine
        if regions:
            assert get_profile(profile).engine == rollout == "vllm"
            assert profile == "vllm"  # verl's default compiled path on GPUs
        verl_accepts(cfg)
    # baseline and aligned runs differ in exactly one setting (plus names derived from the experiment)
    base, aligned = _flat(resolved["none"]), _flat(resolved["all"])
    assert base.keys() == aligned.keys()
    exp = base["trainer.experiment_name"]
    differing = {
        k for k in base if base[k] != aligned[k] and not (isinstance(base[k], str) and exp in base[k])
    }
    assert differing == {"alignment.regions", "actor_rollout_ref.model.override_config.rlalign_spec.regions"}


def test_recipe_knobs_sglang_multinode_and_sizes():
    cfg = compose_recipe("grpo_qwen2_5_math.sh", ALIGN="all", ENGINE="sglang", NNODES="2", MODEL_SIZE="7B")
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert plain["actor_rollout_ref"]["rollout"]["name"] == "sglang"
    assert plain["trainer"]["nnodes"] == 2
    assert plain["actor_rollout_ref"]["model"]["path"] == "Qwen/Qwen2.5-7B-Instruct"
    assert plain["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"] == 2
    assert resolve_spec(cfg, read_spec(cfg), on_cuda=True)[0].engine == "sglang"
    verl_accepts(cfg)
    cfg = compose_recipe("grpo_qwen3_gsm8k.sh", ALIGN="rope,swiglu", MODEL_SIZE="4B")
    assert OmegaConf.to_container(cfg, resolve=True)["alignment"]["regions"] == ["rope", "swiglu"]
    verl_accepts(cfg)
    bad = run_recipe("grpo_qwen3_gsm8k.sh", DRY_RUN="print", MODEL_SIZE="70B")
    assert bad.returncode == 2 and "MODEL_SIZE must be" in bad.stderr


def test_recipe_dry_run_composes_with_cfg_job():
    """``DRY_RUN=1`` runs the real entry point with ``--cfg job --resolve``: no Ray, no GPU."""
    import yaml

    out = run_recipe("grpo_qwen3_math.sh", timeout=300, DRY_RUN="1", ALIGN="all")
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = yaml.safe_load(out.stdout)
    assert cfg["alignment"]["regions"] == ["rope", "swiglu", "rmsnorm"]
    assert cfg["actor_rollout_ref"]["model"]["path"] == "Qwen/Qwen3-1.7B"
    assert cfg["actor_rollout_ref"]["rollout"]["calculate_log_probs"] is True
    assert "ray init" not in out.stdout + out.stderr


def test_ablation_driver_runs_each_align(tmp_path):
    recipe = str(ROOT / "recipes" / "grpo_qwen2_5_gsm8k.sh")
    out = run_recipe("ablation.sh", recipe, "trainer.total_epochs=1", DRY_RUN="print", OUT_DIR=str(tmp_path))
    assert out.returncode == 0, out.stderr
    commands = [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]
    assert len(commands) == 3
    regions = [next(a for a in c if a.startswith("alignment.regions=")) for c in commands]
    assert regions == [
        "alignment.regions=[]",
        "alignment.regions=[rope]",
        "alignment.regions=[rope,swiglu,rmsnorm]",
    ]
    assert all(c[-1] == "trainer.total_epochs=1" for c in commands)
    assert "dry run: no report" in out.stderr


def test_submit_ray_job_forwards_knobs():
    recipe = str(ROOT / "recipes" / "grpo_qwen3_math.sh")
    out = run_recipe(
        "submit_ray_job.sh", recipe, "trainer.total_epochs=1",
        DRY_RUN="1", RAY_ADDRESS="http://head:8265", ALIGN="all", NNODES="4",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout)
    assert argv[:5] == ["ray", "job", "submit", "--address", "http://head:8265"]
    runtime_env = json.loads(argv[argv.index("--runtime-env-json") + 1])
    assert runtime_env["working_dir"] == str(ROOT)
    assert runtime_env["env_vars"] == {"ALIGN": "all", "NNODES": "4"}
    # the job's driver runs on the head node with the runtime env's python (not a local venv of the submitter)
    tail = ["env", "PYTHON=python", "bash", "recipes/grpo_qwen3_math.sh", "trainer.total_epochs=1"]
    assert argv[argv.index("--") + 1 :] == tail
    assert runtime_env["pip"]["packages"] == ["${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}"]


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        ([], {}, "usage:"),
        (["restart"], {}, "usage:"),
        (["start"], {"BASE_PORT": "80"}, "BASE_PORT=80 must be a number in 1024..65000"),
        (["start"], {"BASE_PORT": "x"}, "BASE_PORT=x must be"),
        (["stop"], {"RAY_TEMP_DIR": "rel/ray"}, "RAY_TEMP_DIR=rel/ray must be an absolute path"),
    ],
)
def test_local_ray_cluster_refuses_bad_arguments_before_starting_anything(args, env, words):
    out = subprocess.run(
        ["bash", str(ROOT / "recipes" / "local_ray_cluster.sh"), *args],
        env=dict(os.environ, RAY="false", **env),  # a ray that fails: nothing may get as far as calling it
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and words in out.stderr, out.stderr


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "recipes").glob("*.sh")))
def test_scripts_parse(script):
    out = subprocess.run(["bash", "-n", str(ROOT / "recipes" / script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_verl_rejection_fails_the_check():
    """The check has teeth: a knob setting verl rejects makes ``verl_accepts`` raise."""
    cfg = compose_recipe(
        "grpo_qwen2_5_gsm8k.sh", ALIGN="rope", TRAIN_BATCH_SIZE="16", PPO_MINI_BATCH_SIZE="64"
    )
    with pytest.raises((AssertionError, ValueError)):
        verl_accepts(cfg)


@pytest.mark.parametrize(
    ("knobs", "words"),
    [
        ({"STEPS": "0"}, "STEPS=0 is not a whole number >= 1"),
        ({"BATCH": "-1"}, "BATCH=-1 is not a whole number >= 1"),
        ({"STEPS": "abc"}, "STEPS=abc"),
        ({"N": "2.5"}, "N=2.5"),
        ({"RESPONSE_LEN": "24x"}, "RESPONSE_LEN=24x"),
        ({"LR": "nan"}, "LR=nan is not a positive number"),
        ({"LR": "-1e-6"}, "LR=-1e-6"),
        ({"LOGGERS": "console,mlflw"}, "LOGGERS has 'mlflw'"),
        ({"TP": "3"}, "TP=3 does not divide BATCH*N=8"),
    ],
)
def test_tiny_cpu_recipe_names_a_bad_knob_before_anything_starts(knobs, words, tmp_path):
    """Checked in the first lines of the script: nothing is built, no Ray starts (a ~40 s wait otherwise)."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable, **knobs)
    out = subprocess.run(["bash", str(ROOT / "recipes" / "grpo_tiny_cpu.sh")], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[rlalign-verl] ERROR") and words in lines[0], out.stderr
    assert not (tmp_path / "out").exists()  # nothing was built
