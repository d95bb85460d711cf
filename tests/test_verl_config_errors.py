"""Every driver-side validation error of the ``alignment`` group (one-line fixes)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from verl_configs import compose_ours, valid_config  # noqa: E402

from rlalign_verl.errors import (  # noqa: E402
    AlignmentError,
    LigerConflictError,
    ProfileMismatchError,
    UnknownProfileError,
    UnknownRegionError,
    UnsupportedModelError,
)
from rlalign_verl.verl.config import validate_config  # noqa: E402

pytestmark = pytest.mark.verl


def test_error_unknown_region(qwen2_path):
    with pytest.raises(UnknownRegionError, match=r"alignment.regions=\[rope\]"):
        validate_config(valid_config(qwen2_path, "alignment.regions=[rope,gelu]"), on_cuda=True)


def test_error_unknown_engine(qwen2_path):
    with pytest.raises(UnknownProfileError, match="alignment.engine"):
        validate_config(valid_config(qwen2_path, "alignment.engine=tensorrt"), on_cuda=True)


def test_error_liger(qwen2_path):
    with pytest.raises(LigerConflictError, match="use_liger=False"):
        validate_config(valid_config(qwen2_path, "actor_rollout_ref.model.use_liger=true"), on_cuda=True)


def test_liger_without_alignment_is_fine(qwen2_path):
    cfg = valid_config(qwen2_path, "actor_rollout_ref.model.use_liger=true", "alignment.regions=[]")
    assert validate_config(cfg, on_cuda=True) == ((), None)


def test_error_unsupported_model(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    cfg = compose_ours(
        "alignment.regions=[rope]",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.model.path={tmp_path}",
    )
    with pytest.raises(UnsupportedModelError, match="alignment.regions=\\[\\]"):
        validate_config(cfg, on_cuda=True)


def test_error_profile_contradicts_rollout(qwen2_path):
    with pytest.raises(ProfileMismatchError, match="rollout.name=sglang"):
        validate_config(
            valid_config(qwen2_path, "alignment.engine=vllm", "actor_rollout_ref.rollout.name=sglang"),
            on_cuda=True,
        )
    with pytest.raises(ProfileMismatchError, match="rollout.name=vllm"):
        validate_config(valid_config(qwen2_path, "alignment.engine=sglang"), on_cuda=True)


def test_error_metrics_without_rollout_log_probs(qwen2_path):
    cfg = valid_config(qwen2_path, "actor_rollout_ref.rollout.calculate_log_probs=false")
    with pytest.raises(AlignmentError, match="calculate_log_probs=True"):
        validate_config(cfg, on_cuda=True)
    cfg = valid_config(
        qwen2_path, "actor_rollout_ref.rollout.calculate_log_probs=false", "alignment.metrics=false"
    )
    assert validate_config(cfg, on_cuda=True) == (("rope", "swiglu"), "vllm")


@pytest.mark.parametrize("policy", ["none", "some_other_plugin"])
def test_error_plugin_disabled_for_workers(qwen2_path, monkeypatch, policy):
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", policy)
    with pytest.raises(AlignmentError, match="add rlalign_verl to the list"):
        validate_config(valid_config(qwen2_path), on_cuda=True)
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "some_other_plugin,rlalign_verl")
    assert validate_config(valid_config(qwen2_path), on_cuda=True)[0] == ("rope", "swiglu")


def test_error_non_fsdp_strategy(qwen2_path):
    with pytest.raises(AlignmentError, match="fsdp or fsdp2"):
        validate_config(valid_config(qwen2_path, "actor_rollout_ref.actor.strategy=megatron"), on_cuda=True)


def test_error_rollout_name_missing_with_auto(qwen2_path):
    cfg = compose_ours("alignment.regions=[rope]", f"actor_rollout_ref.model.path={qwen2_path}")
    with pytest.raises(ProfileMismatchError, match="actor_rollout_ref.rollout.name"):
        validate_config(cfg, on_cuda=True)


@pytest.mark.parametrize(
    "extra, match",
    [
        (("alignment.kernels=cuda",), "use torch"),
        (("alignment.kernels=triton", "alignment.compile=true"), "choose one"),
    ],
)
def test_error_bad_kernels(qwen2_path, extra, match):
    with pytest.raises(AlignmentError, match=match):
        validate_config(valid_config(qwen2_path, *extra), on_cuda=False)


def test_error_hook_target_moved(qwen2_path, monkeypatch):
    from rlalign_verl.verl import model_hook

    monkeypatch.setattr(model_hook, "ENGINE_MODULE", "verl.workers.engine.fsdp.moved_away")
    with pytest.raises(AlignmentError, match=r"install verl==0\.9\.1"):
        validate_config(valid_config(qwen2_path), on_cuda=False)


def test_error_hf_profile_with_a_real_rollout_engine(qwen2_path):
    with pytest.raises(ProfileMismatchError, match="not the vllm rollout engine"):
        validate_config(valid_config(qwen2_path, "alignment.engine=hf"), on_cuda=True)
