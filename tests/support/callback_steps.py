"""One RL step's batches and their expected mismatch metrics, shared by the trainer-callback tests.

Helpers (imported) and fixtures (``pytest_plugins = ["callback_steps"]`` in the test module): ``base_config``,
``warnings_log``, ``trainer_modules``. Imported only after ``pytest.importorskip("verl")``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from rlalign_verl.measure.metrics import COUNT_NAMES, METRIC_NAMES
from rlalign_verl.verl import trainer_callback as tc

ALL_KEYS = {f"mismatch/{k}" for k in METRIC_NAMES + COUNT_NAMES}
VERL_CONFIG_DIR = os.path.join(os.path.dirname(importlib.import_module("verl").__file__), "trainer", "config")


def verl_config(*overrides: str, alignment: str | None = "default"):
    """verl's real ppo_trainer config (hydra compose), with our alignment config group."""
    extra = ["hydra.searchpath=[pkg://rlalign_verl.configs]"]
    if alignment:
        extra.append(f"+alignment={alignment}")
    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        return compose("ppo_trainer", overrides=extra + list(overrides))


@pytest.fixture(scope="module")
def base_config():
    """verl's ppo_trainer config with the default alignment group and ``clip_ratio_high=0.28``."""
    return verl_config("actor_rollout_ref.actor.clip_ratio_high=0.28")


@pytest.fixture
def warnings_log(caplog):
    """Records of the plugin's logger (it does not propagate to the root logger caplog listens on)."""
    plugin_logger = logging.getLogger("rlalign_verl.verl")
    plugin_logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.INFO)
    yield caplog
    plugin_logger.removeHandler(caplog.handler)


@pytest.fixture
def trainer_modules():
    """verl's v1 and legacy trainer modules, the callback installed on both (before and after the test)."""
    v1 = importlib.import_module("verl.trainer.ppo.v1.trainer_base")
    legacy = importlib.import_module("verl.trainer.ppo.ray_trainer")
    for module in (v1, legacy):
        assert tc.install_trainer_callback(module)
    yield v1, legacy
    for module in (v1, legacy):  # leave them installed, as the plugin does on import
        assert tc.install_trainer_callback(module)


def step_tensors(seed: int, n: int = 6, prompt_len: int = 3, resp_len: int = 8) -> dict[str, torch.Tensor]:
    """Rollout output of one step: ragged responses (right padded), log-probs of the sampled tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, resp_len + 1, (n,), generator=g)
    lengths[0] = resp_len
    response_mask = (torch.arange(resp_len)[None, :] < lengths[:, None]).long()
    # log-probs in [-3.4, -0.4): the trainer's perturbation (at most +0.3) keeps them log-probs (<= 0)
    rollout = -(0.4 + torch.rand(n, resp_len, generator=g) * 3) * response_mask
    prompts = torch.randint(3, 50, (n, prompt_len), generator=g)
    responses = torch.randint(3, 50, (n, resp_len), generator=g) * response_mask
    attention_mask = torch.cat([torch.ones(n, prompt_len, dtype=torch.long), response_mask], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "rollout_log_probs": rollout,
        "rm_scores": torch.zeros(n, resp_len).scatter_(
            1, (lengths - 1)[:, None], torch.rand(n, 1, generator=g)
        ),
    }


def train_log_probs(rollout: torch.Tensor, seed: int) -> torch.Tensor:
    """The trainer's recomputation: the rollout's plus a known perturbation (ratios 0.7..1.35)."""
    g = torch.Generator().manual_seed(1000 + seed)
    return rollout + (torch.rand(rollout.shape, generator=g) * 0.65 - 0.35)


def expected(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, low=0.2, high=0.28) -> dict:
    """A few metrics in numpy, independently of rlalign_verl.measure.metrics."""
    m = mask.numpy().astype(bool)
    d = train.double().numpy()[m] - rollout.double().numpy()[m]
    r = np.exp(d)
    seq = np.abs(((train.double() - rollout.double()) * mask).sum(-1).numpy())
    return {
        "mismatch/num_tokens": int(m.sum()),
        "mismatch/logp_abs_diff_mean": float(np.abs(d).mean()),
        "mismatch/kl_k3": float(np.mean(r - 1 - d)),
        "mismatch/ratio_clip_frac": float(np.mean((r < 1 - low) | (r > 1 + high))),
        "mismatch/ratio_max": float(r.max()),
        "mismatch/seq_log_ratio_abs_max": float(seq.max()),
    }


def assert_matches(logged: dict, want: dict) -> None:
    for key, value in want.items():
        assert logged[key] == pytest.approx(value, rel=1e-6), key


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def logged_fit_steps(path, outputs: list[dict]) -> list[dict]:
    """A 3-step fit's logged metrics; each step's mismatch/* checked against :func:`expected` on its batch."""
    rows = read_jsonl(path)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row, data in zip(rows, outputs, strict=True):
        logged = row["data"]
        assert ALL_KEYS <= set(logged), sorted(ALL_KEYS - set(logged))
        assert_matches(
            logged, expected(data["old_log_probs"], data["rollout_log_probs"], data["response_mask"])
        )
    return [row["data"] for row in rows]
