"""verl: the opt-in ``attention`` and ``lm_head`` regions on the driver (one head dtype on both sides)."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from hydra import compose, initialize_config_module  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from rlalign_verl.regions.attention import AttentionUnsupportedError  # noqa: E402
from rlalign_verl.regions.lm_head import HeadDtypeError  # noqa: E402
from rlalign_verl.verl.config import validate_config  # noqa: E402
from rlalign_verl.verl.model_hook import opt_in_options  # noqa: E402

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


def _override(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)["actor_rollout_ref"]["model"]["override_config"]


def test_lm_head_sets_the_engine_head_dtype(path):
    cfg = _cfg(path, "alignment.regions=[rope,lm_head]")
    validate_config(cfg, on_cuda=False)
    assert OmegaConf.select(cfg, f"{HF_OVERRIDES}.head_dtype") == "float32"
    assert _override(cfg)["rlalign_head_dtype"] == "float32"
    hf_config = type("C", (), {"rlalign_head_dtype": "float32"})()
    assert opt_in_options(hf_config) == {"head_dtype": "float32"}


def test_lm_head_accepts_a_matching_engine_setting(path):
    cfg = _cfg(path, "alignment.regions=[lm_head]", f"+{HF_OVERRIDES}.head_dtype=float32")
    assert validate_config(cfg, on_cuda=False)[0] == ("lm_head",)


def test_sglang_flag_is_set(path):
    cfg = _cfg(path, "alignment.regions=[rope,lm_head]", "actor_rollout_ref.rollout.name=sglang")
    validate_config(cfg, on_cuda=True)
    assert OmegaConf.select(cfg, "actor_rollout_ref.rollout.engine_kwargs.sglang.enable_fp32_lm_head") is True


@pytest.mark.parametrize(
    "extra",
    [
        ("alignment.regions=[rope]", f"+{HF_OVERRIDES}.head_dtype=float32"),  # engine fp32, trainer bf16
        ("alignment.regions=[lm_head]", "alignment.head_dtype=model", f"+{HF_OVERRIDES}.head_dtype=float32"),
        ("alignment.regions=[lm_head]", f"+{HF_OVERRIDES}.head_dtype=bfloat16"),  # engine bf16, trainer fp32
    ],
)
def test_mismatched_heads_are_refused(path, extra):
    with pytest.raises(HeadDtypeError) as e:
        validate_config(_cfg(path, *extra), on_cuda=False)
    assert "\n" not in str(e.value) and "head" in str(e.value)


def test_attention_region_on_the_driver(path):
    cfg = _cfg(path, "alignment.regions=[rope,attention]", "alignment.attention=sdpa-fp32")
    assert validate_config(cfg, on_cuda=False)[1] == "vllm-cpu"
    assert _override(cfg)["rlalign_attention"] == "sdpa-fp32"
    with pytest.raises(AttentionUnsupportedError, match="FlashAttention"):
        validate_config(_cfg(path, "alignment.regions=[rope,attention]"), on_cuda=True)


def test_compiled_norm_on_the_driver(path):
    """alignment.compiled_norm reaches the workers' apply_alignment; refused where the engine compiles no norm."""
    from types import SimpleNamespace

    from rlalign_verl.errors import AlignmentError

    cfg = _cfg(path, "alignment.regions=[rope,rmsnorm]", "alignment.compiled_norm=true")
    assert validate_config(cfg, on_cuda=False)[1] == "vllm-cpu"
    assert _override(cfg)["rlalign_compiled_norm"] is True
    assert opt_in_options(SimpleNamespace(rlalign_compiled_norm=True)) == {"compiled_norm": True}
    assert "rlalign_compiled_norm" not in _override(_cfg(path, "alignment.regions=[rope,rmsnorm]"))
    with pytest.raises(AlignmentError, match="compiled_norm=False") as e:
        validate_config(
            _cfg(path, "alignment.regions=[rmsnorm]", "alignment.compiled_norm=true"), on_cuda=True
        )
    assert "\n" not in str(e.value)


def test_compiled_norm_is_refused_for_moe_on_the_driver(tmp_path):
    """An MoE checkpoint with alignment.compiled_norm=true: one line on the driver, before any worker starts."""
    import json

    from rlalign_verl.errors import AlignmentError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_act": "silu"}))
    ok = _cfg(str(tmp_path), "alignment.regions=[rope,rmsnorm]")
    assert validate_config(ok, on_cuda=False)[1] == "vllm-cpu"
    bad = _cfg(str(tmp_path), "alignment.regions=[rope,rmsnorm]", "alignment.compiled_norm=true")
    with pytest.raises(AlignmentError, match="dense models only") as e:
        validate_config(bad, on_cuda=False)
    assert "\n" not in str(e.value)


def test_moe_variant_on_the_driver(tmp_path, path):
    """alignment.moe_variant=engine-op reaches the workers' apply_alignment (vllm-cpu, swiglu+moe, an MoE
    checkpoint); refused on the driver, one line each, for a CUDA profile, moe without swiglu, a dense model."""
    import json
    from types import SimpleNamespace

    from rlalign_verl.errors import AlignmentError, UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_act": "silu"}))
    moe = str(tmp_path)
    cfg = _cfg(moe, "alignment.regions=[rope,swiglu,rmsnorm,moe]", "alignment.moe_variant=engine-op")
    assert validate_config(cfg, on_cuda=False)[1] == "vllm-cpu"
    assert _override(cfg)["rlalign_moe_variant"] == "engine-op"
    assert opt_in_options(SimpleNamespace(rlalign_moe_variant="engine-op")) == {"moe_variant": "engine-op"}
    assert "rlalign_moe_variant" not in _override(_cfg(moe, "alignment.regions=[rope,swiglu,rmsnorm,moe]"))
    bad = {
        "cuda profile": (
            moe,
            ["alignment.regions=[swiglu,moe]", "alignment.unverified=[moe]"],
            True,
            "vllm-cpu",
        ),
        "moe without swiglu": (moe, ["alignment.regions=[rope,moe]"], False, "add swiglu"),
        "dense model": (path, ["alignment.regions=[swiglu,moe]"], False, "needs an MoE model"),
        "unknown": (
            moe,
            ["alignment.regions=[swiglu,moe]", "alignment.moe_variant=fast"],
            False,
            "use one of",
        ),
    }
    for case, (model, extra, on_cuda, fragment) in bad.items():
        overrides = ["alignment.moe_variant=engine-op", *extra]
        with pytest.raises(AlignmentError) as e:
            validate_config(_cfg(model, *overrides), on_cuda=on_cuda)
        assert "\n" not in str(e.value) and fragment in str(e.value), (case, str(e.value))
    with pytest.raises(UnsupportedModelError):
        validate_config(
            _cfg(path, "alignment.regions=[swiglu,moe]", "alignment.moe_variant=engine-op"), on_cuda=False
        )
