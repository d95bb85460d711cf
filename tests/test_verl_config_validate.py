"""Driver-side validation of the ``alignment`` group: what it writes for the workers, and both entry points."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from verl_configs import ENTRY_DRIVER, GRPO_MINIMAL, cases, compose_ours, resolved, run_driver, valid_config  # noqa: E402

from rlalign_verl.errors import AlignmentError, LigerConflictError, UnsupportedModelError  # noqa: E402
from rlalign_verl.verl.config import validate_config  # noqa: E402

pytestmark = pytest.mark.verl


def test_validate_writes_resolved_settings_for_workers(qwen2_path):
    cfg = valid_config(qwen2_path)
    assert validate_config(cfg, on_cuda=False) == (("rope", "swiglu"), "vllm-cpu")
    override = resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]
    assert override == {
        "rlalign_regions": ["rope", "swiglu"],
        "rlalign_engine": "vllm-cpu",
        "rlalign_engine_auto": True,
        "rlalign_rollout": "vllm",
    }
    assert resolved(cfg)["critic"]["model"]["override_config"] == {}


def test_validate_passes_compile_to_workers_only_when_on(qwen2_path):
    cfg = valid_config(qwen2_path, "alignment.compile=true")
    validate_config(cfg, on_cuda=False)
    override = resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]
    assert override == {"rlalign_regions": ["rope", "swiglu"], "rlalign_engine": "vllm-cpu", "rlalign_compile": True,
                        "rlalign_engine_auto": True, "rlalign_rollout": "vllm"}  # fmt: skip
    cfg = compose_ours(f"actor_rollout_ref.model.path={qwen2_path}", "actor_rollout_ref.rollout.name=vllm",
                       "alignment.compile=true")  # fmt: skip
    validate_config(cfg, on_cuda=False)
    assert "rlalign_compile" not in resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]


def test_validate_off_sends_nothing_to_workers(qwen2_path):
    cfg = compose_ours(f"actor_rollout_ref.model.path={qwen2_path}", "actor_rollout_ref.rollout.name=vllm")
    assert validate_config(cfg, on_cuda=False) == ((), None)
    # an explicit [] (not a missing key) also overrides a stale value in a checkpoint's config.json
    assert resolved(cfg)["actor_rollout_ref"]["model"]["override_config"] == {"rlalign_regions": []}


def test_validate_keeps_user_override_config(qwen2_path):
    cfg = valid_config(qwen2_path, "+actor_rollout_ref.model.override_config.attn_implementation=sdpa")
    validate_config(cfg, on_cuda=True)
    override = resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]
    assert override == {
        "attn_implementation": "sdpa",
        "rlalign_regions": ["rope", "swiglu"],
        "rlalign_engine": "vllm",
        "rlalign_engine_auto": True,
        "rlalign_rollout": "vllm",
    }


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_validate_accepts_moe_and_rejects_expert_parallel(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    args = ("alignment.regions=[rope,swiglu]", "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.model.path={tmp_path}")  # fmt: skip
    assert validate_config(compose_ours(*args), on_cuda=False) == (("rope", "swiglu"), "vllm-cpu")
    with pytest.raises(AlignmentError, match=r"expert_parallel_size=4: .*expert_parallel_size=1") as err:
        validate_config(
            compose_ours(*args, "actor_rollout_ref.rollout.expert_parallel_size=4"), on_cuda=False
        )
    assert "\n" not in str(err.value)


def test_validate_refuses_unverified_cuda_moe_data_without_the_opt_in(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    args = ("alignment.regions=[rope,swiglu]", "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.model.path={tmp_path}")  # fmt: skip
    monkeypatch.delenv("RLALIGN_UNVERIFIED", raising=False)
    with pytest.raises(UnsupportedModelError, match="RLALIGN_UNVERIFIED=moe") as err:
        validate_config(compose_ours(*args), on_cuda=True)  # the vllm profile on CUDA
    assert "\n" not in str(err.value) and "gpu_moe_check.py" in str(err.value)
    monkeypatch.setenv("RLALIGN_UNVERIFIED", "moe")
    assert validate_config(compose_ours(*args), on_cuda=True) == (("rope", "swiglu"), "vllm")


def test_verl_validate_config_runs_ours(qwen2_path):
    """verl's own validate_config (what verl's main_ppo calls) raises our error once the plugin is loaded."""
    import verl.utils.config as verl_config

    import rlalign_verl.verl.plugin  # noqa: F401  (loaded by `import verl` already)

    cfg = valid_config(qwen2_path, "actor_rollout_ref.model.use_liger=true")
    with pytest.raises(LigerConflictError):
        verl_config.validate_config(cfg, use_reference_policy=False, use_critic=False)


def test_entry_points_validate_on_driver_before_ray(qwen2_path):
    """Both entry points run our validation before run_ppo; a bad setting stops the run there."""
    good = [
        "alignment.regions=[rope]",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.enforce_eager=true",
        f"actor_rollout_ref.model.path={qwen2_path}",
        *GRPO_MINIMAL,
    ]
    bad = [*good, "actor_rollout_ref.model.use_liger=true"]
    verl_entry = [
        "verl.trainer.main_ppo",
        "hydra.searchpath=[pkg://rlalign_verl.configs]",
        "+alignment=default",
    ]
    runs = [
        ["rlalign_verl.main_ppo", *good],
        [*verl_entry, *good],
        ["rlalign_verl.main_ppo", *bad],
        [*verl_entry, *bad],
    ]
    out = run_driver(ENTRY_DRIVER, runs, HYDRA_FULL_ERROR="1")
    sections = cases(out.stdout)
    assert len(sections) == 4, out.stdout[-3000:]
    profile = "vllm-eager" if _cuda() else "vllm-cpu-eager"
    for section in sections[:2]:
        line = next(ln for ln in section.splitlines() if ln.startswith("REACHED_RUN_PPO "))
        assert json.loads(line.split(" ", 1)[1]) == {
            "rlalign_regions": ["rope"], "rlalign_engine": profile, "rlalign_engine_auto": True, "rlalign_rollout": "vllm"
        }  # fmt: skip
    for section in sections[2:]:
        assert "REACHED_RUN_PPO" not in section, section
        assert "RAISED LigerConflictError actor_rollout_ref.model.use_liger=True" in section, section
    assert f"alignment regions=rope profile={profile}" in out.stderr


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_validate_passes_triton_kernels_only_when_asked(qwen2_path):
    cfg = valid_config(qwen2_path, "alignment.kernels=triton")
    validate_config(cfg, on_cuda=False)
    assert resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]["rlalign_kernels"] == "triton"
    cfg = valid_config(qwen2_path)  # default: torch, nothing sent (the workers' default is the PyTorch path)
    validate_config(cfg, on_cuda=False)
    assert "rlalign_kernels" not in resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]
