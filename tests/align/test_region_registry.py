"""The region registry (rlalign_verl/request/regions.py): every row points at real things, and the package reads
its region facts from it (names, ``all``, the verify ladder, what ``get_alignment`` checks, what binds itself)."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlalign_verl.align.patch import apply_alignment, get_alignment
from rlalign_verl.base.errors import AlignmentOverriddenError
from rlalign_verl.catalog.families import ModelFamily
from rlalign_verl.catalog.profiles import EngineProfile
from rlalign_verl.request import regions as registry
from rlalign_verl.request.regions import REGISTRY, ladder_rungs, normalize_regions, plans, wrapped_roles
from rlalign_verl.request.spec import AlignmentSpec


def test_every_row_points_at_real_fields_and_functions():
    profile_fields = {f.name for f in dataclasses.fields(EngineProfile)}
    family_fields = {f.name for f in dataclasses.fields(ModelFamily)}
    for row in REGISTRY:
        assert row.profile_field is None or row.profile_field in profile_fields, row
        assert set(row.wraps) <= family_fields, row
        for planner in row.plan:
            module, function = planner.split(":")
            assert callable(getattr(importlib.import_module(module), function)), row


def test_the_names_the_request_accepts_come_from_the_registry():
    # source facts written here: the paper's three regions are the default; the others are opt-in
    assert registry.REGIONS == ("rope", "swiglu", "rmsnorm")
    assert registry.OPT_IN_REGIONS == ("moe", "attention", "lm_head", "tp")
    assert normalize_regions("all") == ("rope", "swiglu", "rmsnorm")
    assert normalize_regions("tp,all") == ("rope", "swiglu", "rmsnorm", "tp")
    assert AlignmentSpec.parse(regions=["tp", "rope"], spelling="python").regions == ("rope", "tp")


def test_the_ladder_comes_from_the_rung_rows():
    assert ladder_rungs(("rope",), 1) == ["none"]  # one region: its pass is the aligned pass itself
    assert ladder_rungs(("rope", "swiglu", "rmsnorm", "attention"), 1) == [
        "none",
        "rope",
        "swiglu",
        "rmsnorm",
    ]
    assert ladder_rungs(("rope", "tp"), 1) == ["none", "rope"]  # tp at TP 1 would repeat `none`
    assert ladder_rungs(("rope", "tp"), 2) == ["none", "rope", "tp"]


def test_a_row_changes_what_the_package_does(monkeypatch):
    """The registry is read, not restated: dropping a row's rung or its wrapped role changes the behaviour."""
    rows = tuple(dataclasses.replace(r, rung=False) if r.name == "swiglu" else r for r in REGISTRY)
    monkeypatch.setattr(registry, "REGISTRY", rows)
    assert ladder_rungs(("rope", "swiglu"), 1) == ["none", "rope"]
    monkeypatch.setattr(registry, "BY_NAME", {r.name: r for r in rows})
    assert wrapped_roles(("rope", "swiglu", "rmsnorm")) == ("attention", "mlp", "decoder_layer")
    assert plans(("swiglu", "moe", "tp")) == (
        "rlalign_verl.align.moe_patch:plan",
        "rlalign_verl.align.regions.tp:plan",
    )
    assert plans(("rope", "rmsnorm", "attention")) == ()


def _tiny() -> Qwen2ForCausalLM:
    cfg = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(torch.bfloat16)


def test_a_planned_region_binds_its_rows_modules():
    model = _tiny()
    apply_alignment(model, regions=["rope", "tp"], engine="vllm-cpu", rollout_tp=2)
    layer = model.model.layers[0]
    assert "forward" in layer.self_attn.o_proj.__dict__ and "forward" in layer.mlp.down_proj.__dict__
    assert "forward" not in layer.self_attn.q_proj.__dict__


def test_get_alignment_checks_the_rows_wrapped_roles():
    model = _tiny()
    apply_alignment(model, regions=["swiglu"], engine="vllm-cpu")
    get_alignment(model)
    mlp = model.model.layers[0].mlp
    mlp.forward = type(mlp).forward.__get__(mlp)  # an instance patch after alignment (as Liger's would be)
    with pytest.raises(AlignmentOverriddenError):
        get_alignment(model)


def test_describe_shows_each_rows_setting(monkeypatch):
    model = _tiny()
    apply_alignment(model, regions=["rope", "lm_head", "tp"], engine="vllm-cpu", rollout_tp=2)
    text = get_alignment(model).describe()
    assert "head_dtype=float32" in text and "rollout_tp=2" in text and "attention=" not in text
    rows = tuple(dataclasses.replace(r, shows=None) if r.name == "tp" else r for r in REGISTRY)
    monkeypatch.setattr(registry, "REGISTRY", rows)
    assert "rollout_tp" not in get_alignment(model).describe()


def test_a_rows_rules_run_where_the_request_is_checked(monkeypatch):
    """The tp row's rules (request, model, start-up) are what the checks run: without them the same request passes."""
    from rlalign_verl.base.errors import AlignmentError, UnsupportedModelError
    from rlalign_verl.request.checks import validate_request
    from rlalign_verl.request.regions import startup_lines

    odd_heads = Qwen2Config(
        num_attention_heads=3, num_key_value_heads=1, hidden_size=48, intermediate_size=128
    )
    at_tp4 = AlignmentSpec.parse(regions=["rope", "tp"], engine="vllm-cpu", rollout_tp=4, spelling="python")
    at_tp2 = at_tp4.replace(rollout_tp=2)
    with pytest.raises(AlignmentError, match="up to TP=2"):
        validate_request(at_tp4)
    with pytest.raises(UnsupportedModelError, match="num_attention_heads=3"):
        validate_request(at_tp2, model_type="qwen2", model_config=odd_heads)
    warned = startup_lines(at_tp2.replace(regions=("rope",)))
    assert len(warned) == 1 and "add tp to alignment.regions" in warned[0]
    rows = tuple(
        dataclasses.replace(r, check=None, check_model=None, startup=None) if r.name == "tp" else r
        for r in REGISTRY
    )
    monkeypatch.setattr(registry, "REGISTRY", rows)
    assert validate_request(at_tp4).name == "vllm-cpu"
    validate_request(at_tp2, model_type="qwen2", model_config=odd_heads)
    assert startup_lines(at_tp2.replace(regions=("rope",))) == []
