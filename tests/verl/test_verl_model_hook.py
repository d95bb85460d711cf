"""The worker side's per-model gate: ``align_module`` on HF models whose config carries the driver's spec."""

from __future__ import annotations

import logging

import pytest

from rlalign_verl.request.spec import AlignmentSpec


def _hf_model(path: str, spec: dict | None = None, **attrs):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, attn_implementation="sdpa")
    if spec is not None:  # what verl's update_model_config does with override_config.rlalign_spec
        config.rlalign_spec = AlignmentSpec.parse(spec).to_json()
    for key, value in attrs.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype="bfloat16")


def test_align_module_gates_on_the_spec(qwen2_path, caplog):
    from rlalign_verl.align.patch import get_alignment
    from rlalign_verl.verl.log import logger
    from rlalign_verl.verl.model_hook import align_module

    plain = _hf_model(qwen2_path)
    assert align_module(plain, role="critic") is plain and get_alignment(plain) is None
    off = _hf_model(qwen2_path, {"regions": [], "engine": "vllm-cpu"})
    assert get_alignment(align_module(off, role="actor")) is None

    model = _hf_model(qwen2_path, {"regions": ["swiglu", "rope"], "engine": "vllm-cpu-eager"})
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="rlalign_verl.verl"):
            align_module(model, role="actor")
    finally:
        logger.propagate = False
    st = get_alignment(model)
    assert st.regions == ("rope", "swiglu") and st.profile.name == "vllm-cpu-eager" and not st.compiled
    assert "aligned Qwen2ForCausalLM (role=actor): regions=rope,swiglu profile=vllm-cpu-eager" in caplog.text

    compiled = _hf_model(
        qwen2_path, {"regions": ["rope"], "engine": "vllm-cpu", "experimental": {"compile": True}}
    )
    assert get_alignment(align_module(compiled, role="actor")).compiled


def test_old_release_attributes_are_said_and_ignored(qwen2_path, caplog):
    from rlalign_verl.align.patch import get_alignment
    from rlalign_verl.verl.log import logger
    from rlalign_verl.verl.model_hook import align_module

    stale = _hf_model(qwen2_path, rlalign_regions=["rope"], rlalign_engine="vllm")
    logger.propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="rlalign_verl.verl"):
            assert get_alignment(align_module(stale, role="actor")) is None
    finally:
        logger.propagate = False
    assert "older release (rlalign_regions, rlalign_engine)" in caplog.text


def test_align_module_fails_loudly(qwen2_path):
    from rlalign_verl.base.errors import ConfigFormatError
    from rlalign_verl.verl.model_hook import align_module

    model = _hf_model(qwen2_path)
    model.config.rlalign_spec = '{"regions": ["rope"], "engine": "trt"'  # a broken wire value
    with pytest.raises(ConfigFormatError):
        align_module(model, role="actor")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a CPU-only worker")
def test_align_module_checks_the_profile_against_the_worker_device(qwen2_path):
    from rlalign_verl.align.patch import get_alignment
    from rlalign_verl.base.errors import ProfileMismatchError
    from rlalign_verl.verl.model_hook import align_module

    with pytest.raises(ProfileMismatchError, match="CPU-only worker; use alignment.engine=vllm-cpu"):
        align_module(_hf_model(qwen2_path, {"regions": ["rope"], "engine": "vllm"}), role="actor")
    moved = _hf_model(qwen2_path, {"regions": ["rope"], "engine": "vllm-eager", "engine_auto": True})
    assert get_alignment(align_module(moved, role="actor")).profile.name == "vllm-cpu-eager"
    with pytest.raises(ProfileMismatchError, match="not the vllm rollout engine"):
        align_module(_hf_model(qwen2_path, {"regions": ["rope"], "engine": "hf", "rollout": "vllm"}))


def test_the_worker_validates_the_request_once(qwen2_path, monkeypatch):
    """The driver validated and resolved the request; the worker checks it once, with the model's facts."""
    from rlalign_verl.align import patch
    from rlalign_verl.verl.model_hook import align_module

    seen = []
    real = patch.validate_request

    def counting(spec, **facts):
        seen.append(sorted(k for k, v in facts.items() if v is not None))
        return real(spec, **facts)

    monkeypatch.setattr(patch, "validate_request", counting)
    align_module(_hf_model(qwen2_path, {"regions": ["rope"], "engine": "vllm-cpu"}), role="actor")
    assert seen == [["device", "model_config", "model_type", "param_dtype", "spelling"]]
