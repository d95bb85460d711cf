"""The opt-in into unverified profile data (``unverified=("moe",)``) as an option that reaches every worker.

The CUDA profiles' MoE rounding (``CUDA_TRITON_MOE``, ``verified=False``) aligns swiglu/moe of an MoE model
only with the opt-in. Each spelling is checked for: refused without, accepted with (and recorded on the
model's ``AlignmentState``), an unknown value refused with one line listing the valid ones; and the verl and
OpenRLHF drivers carry the resolved opt-in to the worker-side ``apply_alignment``.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from rlalign_verl.errors import ConfigFormatError, UnsupportedModelError
from rlalign_verl.patch import aligned, apply_alignment, get_alignment, remove_alignment
from rlalign_verl.unverified import parse_unverified, resolve_unverified

MOE_REGIONS = ("rope", "swiglu", "rmsnorm", "moe")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("RLALIGN_UNVERIFIED", raising=False)


def _tiny_moe():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=320, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


# value -> parsed tuple, or the fragment of the one-line error
PARSE = {
    "none": (None, ()),
    "empty str": ("", ()),
    "moe": ("moe", ("moe",)),
    "spaced, upper, dup": (" MOE, moe ,", ("moe",)),
    "list": (["moe"], ("moe",)),
    "unknown": ("moe,attn", "unknown value(s) ['attn']; valid: moe"),
    "unknown in list": (["router"], "unknown value(s) ['router']; valid: moe"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PARSE))
def test_parse_unverified(case):
    value, expected = PARSE[case]
    if isinstance(expected, tuple):
        assert parse_unverified(value) == expected
        return
    with pytest.raises(ConfigFormatError, match=re.escape(expected)) as err:
        parse_unverified(value, name="alignment.unverified")
    assert "\n" not in str(err.value) and str(err.value).startswith("alignment.unverified:")


# (unverified argument, RLALIGN_UNVERIFIED, profile, regions) -> accepted?
API = {
    "cuda profile, no opt-in": (None, None, "vllm", MOE_REGIONS, False),
    "cuda profile, swiglu only": ((), None, "vllm-eager", ("swiglu",), False),
    "cuda profile, option": (("moe",), None, "vllm", MOE_REGIONS, True),
    "cuda profile, option as str": ("moe", None, "vllm-eager", ("swiglu",), True),
    "cuda profile, env spelling": (None, "moe", "vllm", MOE_REGIONS, True),
    "cuda profile, dense regions": (None, None, "vllm", ("rope", "rmsnorm"), True),
    "verified cpu data": (None, None, "vllm-cpu", MOE_REGIONS, True),
}  # fmt: skip


@pytest.mark.parametrize("case", list(API))
def test_apply_alignment_opt_in(case, monkeypatch):
    unverified, env, profile, regions, accepted = API[case]
    if env is not None:
        monkeypatch.setenv("RLALIGN_UNVERIFIED", env)
    model = _tiny_moe()
    if not accepted:
        with pytest.raises(UnsupportedModelError, match=r"alignment\.unverified=\[moe\] \(verl\)") as err:
            apply_alignment(model, regions=regions, engine=profile, unverified=unverified)
        msg = str(err.value)
        assert "\n" not in msg and "--alignment.unverified moe" in msg and "RLALIGN_UNVERIFIED=moe" in msg
        assert msg.index("alignment.unverified") < msg.index("RLALIGN_UNVERIFIED")  # the option first
        assert get_alignment(model) is None  # refused before any patching
        return
    apply_alignment(model, regions=regions, engine=profile, unverified=unverified)
    st = get_alignment(model)
    opted = ("moe",) if (unverified or env) else ()
    assert st.regions == tuple(r for r in MOE_REGIONS if r in regions) and st.unverified == opted
    assert ("unverified=moe" in st.describe()) == bool(opted)
    ids = torch.randint(0, 320, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_unknown_value_refused_before_patching():
    model = _tiny_moe()
    with pytest.raises(ConfigFormatError, match=r"unverified: unknown value\(s\) \['mow'\]; valid: moe"):
        apply_alignment(model, regions=MOE_REGIONS, engine="vllm", unverified="mow")
    assert get_alignment(model) is None


def test_aligned_context_restores_the_previous_opt_in():
    model = _tiny_moe()
    apply_alignment(model, regions=MOE_REGIONS, engine="vllm", unverified=("moe",))
    with aligned(model, regions=("rope",), engine="vllm"):
        assert get_alignment(model).unverified == ()
    st = get_alignment(model)
    assert st.regions == MOE_REGIONS and st.profile.name == "vllm" and st.unverified == ("moe",)
    remove_alignment(model)


def test_class_form_carries_the_opt_in():
    try:
        apply_alignment(regions=MOE_REGIONS, engine="vllm", unverified=("moe",))
        assert get_alignment(_tiny_moe()).unverified == ("moe",)
        apply_alignment(regions=MOE_REGIONS, engine="vllm")
        with pytest.raises(UnsupportedModelError, match="UNVERIFIED"):
            _tiny_moe()
    finally:
        remove_alignment()


def test_resolve_joins_the_env_spelling(monkeypatch):
    assert resolve_unverified(None) == ()
    monkeypatch.setenv("RLALIGN_UNVERIFIED", "moe")
    assert resolve_unverified(()) == ("moe",) and resolve_unverified("moe") == ("moe",)
    monkeypatch.setenv("RLALIGN_UNVERIFIED", "typo")
    with pytest.raises(ConfigFormatError, match=r"^RLALIGN_UNVERIFIED: unknown value\(s\) \['typo'\]"):
        resolve_unverified(None)


# --- OpenRLHF: --alignment.unverified, carried in the Settings the workers read back ----------------


def _moe_dir(tmp_path) -> str:
    d = tmp_path / "qwen3_moe"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    return str(d)


# extra launcher argv -> the settings' unverified tuple, or the error fragment
OPENRLHF = {
    "no opt-in": ([], "UNVERIFIED"),
    "flag": (["--alignment.unverified", "moe"], ("moe",)),
    "flag=": (["--alignment.unverified=moe"], ("moe",)),
    "unknown value": (["--alignment.unverified", "moe,x"], "--alignment.unverified: unknown value(s) ['x']"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(OPENRLHF))
def test_openrlhf_flag_reaches_the_workers(case, tmp_path, monkeypatch):
    from rlalign_verl.openrlhf import flags
    from rlalign_verl.openrlhf.settings import Settings, parse_launcher_args
    from rlalign_verl.openrlhf.setup import align_actor

    monkeypatch.setattr(flags, "installed_flags", lambda *a: None)
    extra, expected = OPENRLHF[case]
    argv = ["--alignment.regions", "all,moe", "--actor.model_name_or_path", _moe_dir(tmp_path), *extra]
    if isinstance(expected, str):
        with pytest.raises((UnsupportedModelError, ConfigFormatError)) as err:
            parse_launcher_args(argv)
        assert expected in str(err.value) and "\n" not in str(err.value)
        return
    settings = parse_launcher_args(argv).settings
    assert settings.unverified == expected and "unverified=moe" in settings.describe()
    worker = Settings.from_env(settings.to_env())  # what every Ray worker reads back (runtime_env env_vars)
    assert worker == settings
    actor = type("Actor", (), {"model": _tiny_moe()})()
    assert get_alignment(align_actor(actor, worker, profile="vllm")).unverified == ("moe",)
    no_opt_in = Settings.from_env({**settings.to_env(), "RLALIGN_UNVERIFIED": ""})
    with pytest.raises(UnsupportedModelError, match="UNVERIFIED"):
        align_actor(type("Actor", (), {"model": _tiny_moe()})(), no_opt_in, profile="vllm")
