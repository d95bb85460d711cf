"""verl: the ``lm_head`` region sets the rollout engine's head dtype (one head dtype on both sides)."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from hydra import compose, initialize_config_module  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from rlalign_verl.request.checks import AttentionUnsupportedError, HeadDtypeError  # noqa: E402
from rlalign_verl.request.spec import AlignmentSpec  # noqa: E402
from rlalign_verl.verl.config import validate_config  # noqa: E402

pytestmark = pytest.mark.verl
HF_OVERRIDES = "actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides"


def _cfg(path, *overrides: str):
    with initialize_config_module(config_module="rlalign_verl.configs", version_base=None):
        return compose("rlalign_ppo_trainer", overrides=[
            "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.model.path={path}", *overrides,
        ])  # fmt: skip


@pytest.fixture
def path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("qwen2"))


def _worker_spec(cfg) -> AlignmentSpec:
    override = OmegaConf.to_container(cfg, resolve=True)["actor_rollout_ref"]["model"]["override_config"]
    return AlignmentSpec.from_json(override["rlalign_spec"])


def test_lm_head_sets_the_engine_head_dtype(path):
    cfg = _cfg(path, "alignment.regions=[rope,lm_head]")
    validate_config(cfg, on_cuda=False)
    assert OmegaConf.select(cfg, f"{HF_OVERRIDES}.head_dtype") == "float32"
    assert _worker_spec(cfg).experimental.head_dtype == "float32"


def test_lm_head_accepts_a_matching_engine_setting(path):
    cfg = _cfg(path, "alignment.regions=[lm_head]", f"+{HF_OVERRIDES}.head_dtype=float32")
    assert validate_config(cfg, on_cuda=False).regions == ("lm_head",)


def test_sglang_flag_is_set(path):
    cfg = _cfg(path, "alignment.regions=[rope,lm_head]", "actor_rollout_ref.rollout.name=sglang")
    validate_config(cfg, on_cuda=True)
    assert OmegaConf.select(cfg, "actor_rollout_ref.rollout.engine_kwargs.sglang.enable_fp32_lm_head") is True


@pytest.mark.parametrize(
    "extra",
    [
        ("alignment.regions=[rope]", f"+{HF_OVERRIDES}.head_dtype=float32"),  # engine fp32, trainer bf16
        (
            "alignment.regions=[lm_head]",
            "alignment.experimental.head_dtype=model",
            f"+{HF_OVERRIDES}.head_dtype=float32",
        ),  # fmt: skip
        ("alignment.regions=[lm_head]", f"+{HF_OVERRIDES}.head_dtype=bfloat16"),  # engine bf16, trainer fp32
    ],
)
def test_mismatched_heads_are_refused(path, extra):
    with pytest.raises(HeadDtypeError) as e:
        validate_config(_cfg(path, *extra), on_cuda=False)
    assert "\n" not in str(e.value) and "head" in str(e.value)


def test_opt_in_switches_reach_the_workers_in_the_spec(path):
    """The experimental switches travel inside the one spec (their checks: tests/request/test_spec.py)."""
    cfg = _cfg(path, "alignment.regions=[rope,attention]", "alignment.experimental.attention=sdpa-fp32")
    assert validate_config(cfg, on_cuda=False).engine == "vllm-cpu"
    assert _worker_spec(cfg).experimental.attention == "sdpa-fp32"
    with pytest.raises(AttentionUnsupportedError, match="FlashAttention"):
        validate_config(_cfg(path, "alignment.regions=[rope,attention]"), on_cuda=True)
