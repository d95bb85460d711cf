"""verl overrides, config composers and an entry-point driver shared by the verl config tests (test code,
not shipped).

``tests/support`` is on ``sys.path`` through pytest's ``pythonpath`` setting (pyproject.toml).
"""

from __future__ import annotations

import os
import subprocess
import sys

GRPO_MINIMAL = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=2",
    "trainer.n_gpus_per_node=1",
]
"""The smallest set of overrides that passes verl's own ``validate_config`` (GRPO: no critic)."""

ENTRY_DRIVER = """
import json, runpy, sys
import verl.trainer.constants_ppo as constants

def stop_before_ray(config):  # run_ppo calls this first, before ray.init
    from omegaconf import OmegaConf
    node = OmegaConf.to_container(config.actor_rollout_ref.model.override_config, resolve=True)
    print("REACHED_RUN_PPO " + json.dumps(node), flush=True)
    raise SystemExit(0)

constants.get_ppo_ray_runtime_env = stop_before_ray
for argv in {runs!r}:
    sys.argv = [argv[0] + ".py", *argv[1:]]
    print("=== case", flush=True)
    print("=== case", file=sys.stderr, flush=True)
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        print("EXIT", exc.code, flush=True)
    except Exception as exc:
        print("RAISED", type(exc).__name__, exc, flush=True)
"""
"""Runs each ``[module, *args]`` of ``{runs}`` as ``python -m`` would, stopping where ``run_ppo`` would start
Ray; each run's stdout and stderr begin with a ``=== case`` line (:func:`cases`)."""


def run_driver(script: str, runs: list[list[str]], **env: str | None) -> subprocess.CompletedProcess[str]:
    """``script`` (its ``{runs!r}`` slot filled) in one fresh interpreter, offline and on CPU; must exit 0.

    ``env``: further variables for the child (``None`` removes one). One interpreter for all the runs pays
    verl's import (torch, tensordict) once.
    """
    child = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")
    for key, value in env.items():
        if value is None:
            child.pop(key, None)
        else:
            child[key] = value
    out = subprocess.run(
        [sys.executable, "-c", script.format(runs=runs)],
        capture_output=True,
        text=True,
        env=child,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def cases(text: str) -> list[str]:
    """``text`` (a driver's stdout or stderr) cut into the runs' sections."""
    return text.split("=== case\n")[1:]


def compose_ours(*overrides: str):
    """Our primary config (verl's ppo_trainer + alignment group), as rlalign_verl.main_ppo composes it."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="rlalign_verl.configs", version_base=None):
        return compose("rlalign_ppo_trainer", overrides=list(overrides))


def compose_verl(*overrides: str):
    """verl's own ppo_trainer with our group added through hydra.searchpath, as verl's main_ppo does."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(
            "ppo_trainer",
            overrides=["hydra.searchpath=[pkg://rlalign_verl.configs]", "+alignment=default", *overrides],
        )


def resolved(cfg) -> dict:
    """``cfg`` as a plain dict, interpolations resolved."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def valid_config(qwen2_path: str, *extra: str):
    """A config that passes driver validation (regions rope+swiglu, vllm rollout, the tiny Qwen2), plus ``extra``."""
    return compose_ours(
        "alignment.regions=[rope,swiglu]",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.model.path={qwen2_path}",
        *extra,
    )
