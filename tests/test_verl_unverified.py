"""verl: ``alignment.unverified=[moe]`` validated on the driver and carried to the actor/ref workers.

The driver resolves the option (with ``RLALIGN_UNVERIFIED`` on the driver as an equivalent spelling), refuses
unverified MoE data without it before Ray, and writes the resolved opt-in into ``override_config``; the worker
hook (``model_hook.align_module``) passes it to ``apply_alignment``. An unknown value or a misspelt key is
refused with one line.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("hydra")

from hydra import compose, initialize_config_module  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from rlalign_verl.errors import ConfigFormatError, UnsupportedModelError  # noqa: E402
from rlalign_verl.patch import get_alignment  # noqa: E402
from rlalign_verl.verl import model_hook  # noqa: E402
from rlalign_verl.verl.config import validate_config  # noqa: E402

pytestmark = pytest.mark.verl
KEY = "rlalign_unverified"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("RLALIGN_UNVERIFIED", raising=False)


def _cfg(tmp_path, *overrides: str):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with initialize_config_module(config_module="rlalign_verl.configs", version_base=None):
        return compose("rlalign_ppo_trainer", overrides=[
            "alignment.regions=[rope,swiglu,rmsnorm,moe]", "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.model.path={tmp_path}", *overrides,
        ])  # fmt: skip


def _worker_flags(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)["actor_rollout_ref"]["model"]["override_config"]


# overrides (+ driver env) -> the opt-in written for the workers, or (error type, fragment)
DRIVER = {
    "no opt-in": ((), None, (UnsupportedModelError, "opt in with alignment.unverified=[moe] (verl)")),
    "list": (("alignment.unverified=[moe]",), None, ["moe"]),
    "string": (("alignment.unverified=moe",), None, ["moe"]),
    "driver env spelling": ((), "moe", ["moe"]),
    "alignment off": (("alignment.regions=[]", "alignment.unverified=[moe]"), None, None),
    "unknown value": (("alignment.unverified=[moe,rope]",), None,
                      (ConfigFormatError, "alignment.unverified: unknown value(s) ['rope']; valid: moe")),
    "unknown value, alignment off": (("alignment.regions=[]", "alignment.unverified=[x]"), None,
                                     (ConfigFormatError, "alignment.unverified: unknown value(s) ['x']")),
    "sglang, no opt-in": (("alignment.engine=sglang", "actor_rollout_ref.rollout.name=sglang"), None,
                          (UnsupportedModelError, "profile sglang's MoE rounding is read from source and UNVERIFIED")),
    "sglang with opt-in": (("alignment.engine=sglang", "actor_rollout_ref.rollout.name=sglang",
                            "alignment.unverified=[moe]"), None, ["moe"]),
    "misspelt key": (("+alignment.unverfied=[moe]",), None,
                     (ConfigFormatError, "did you mean alignment.unverified?")),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DRIVER))
def test_driver_validates_and_writes_the_opt_in(case, tmp_path, monkeypatch):
    overrides, env, expected = DRIVER[case]
    if env is not None:
        monkeypatch.setenv("RLALIGN_UNVERIFIED", env)
    cfg = _cfg(tmp_path, *overrides)
    if isinstance(expected, tuple):
        with pytest.raises(expected[0]) as err:
            validate_config(cfg, on_cuda=True)
        assert expected[1] in str(err.value) and "\n" not in str(err.value)
        return
    validate_config(cfg, on_cuda=True)
    assert _worker_flags(cfg).get(KEY) == expected


def test_driver_refuses_a_profile_without_moe_data(tmp_path, monkeypatch):
    """Every built-in profile has MoE data now; one without it (sglang's, emptied) is refused before Ray."""
    import dataclasses

    from rlalign_verl.profiles import PROFILES

    monkeypatch.setitem(PROFILES, "sglang", dataclasses.replace(PROFILES["sglang"], moe=None))
    cfg = _cfg(
        tmp_path,
        "alignment.engine=sglang",
        "actor_rollout_ref.rollout.name=sglang",
        "alignment.unverified=[moe]",
    )
    with pytest.raises(
        UnsupportedModelError, match="profile sglang has no MoE expert/router rounding"
    ) as err:
        validate_config(cfg, on_cuda=True)
    assert "\n" not in str(err.value)


def _tiny_moe(**flags):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=320, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    for key, value in flags.items():  # what verl's update_model_config does with override_config
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("opt_in", [True, False])
def test_worker_apply_gets_the_opt_in(opt_in, tmp_path, monkeypatch):
    # the CUDA profile on this CPU-only machine: placement is not what is checked here
    monkeypatch.setattr(model_hook, "_placed_profile", lambda module, engine: engine)
    cfg = _cfg(tmp_path, *(["alignment.unverified=[moe]"] if opt_in else []), "alignment.engine=vllm")
    if opt_in:
        validate_config(cfg, on_cuda=True)
    else:  # as if the driver check had been skipped: the worker still refuses
        cfg.actor_rollout_ref.model.override_config.rlalign_engine = "vllm"
    flags = {k: v for k, v in _worker_flags(cfg).items() if k.startswith("rlalign_")}
    assert (KEY in flags) == opt_in
    model = _tiny_moe(**flags)
    if not opt_in:
        with pytest.raises(UnsupportedModelError, match="UNVERIFIED"):
            model_hook.align_module(model, role="actor")
        return
    model_hook.align_module(model, role="actor")
    st = get_alignment(model)
    assert st.profile.name == "vllm" and "moe" in st.regions and st.unverified == ("moe",)
    model_hook.strip_flags(model.config)
    assert not hasattr(model.config, KEY)  # never saved into a checkpoint
