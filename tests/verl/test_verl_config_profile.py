"""The automatic profile choice (``alignment.engine=auto``) from verl's rollout settings, and the banner naming it."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from verl_configs import compose_ours  # noqa: E402

from rlalign_verl.base.errors import ProfileMismatchError  # noqa: E402
from rlalign_verl.verl.config import choose_profile, read_spec, resolve_spec, would_use_profile  # noqa: E402

pytestmark = pytest.mark.verl


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(rollout_name="vllm", on_cuda=True), "vllm"),
        (dict(rollout_name="vllm", enforce_eager=True, on_cuda=True), "vllm-eager"),
        (dict(rollout_name="vllm", on_cuda=False), "vllm-cpu"),
        (dict(rollout_name="vllm", enforce_eager=True, on_cuda=False), "vllm-cpu-eager"),
        (dict(rollout_name="sglang", on_cuda=True), "sglang"),
        (dict(rollout_name="vllm", compilation_config={"custom_ops": ["all"]}, on_cuda=True), "vllm-eager"),
        (dict(rollout_name="vllm", compilation_config={"custom_ops": ["none"]}, on_cuda=True), "vllm"),
        (
            dict(
                rollout_name="vllm",
                compilation_config='{"custom_ops": ["+rms_norm", "+silu_and_mul", "+rotary_embedding"]}',
                on_cuda=True,
            ),
            "vllm-eager",
        ),
        (dict(rollout_name="vllm", compilation_config={"mode": 0}, on_cuda=True), "vllm-eager"),
        (
            dict(
                rollout_name="vllm",
                compilation_config={"custom_ops": ["all", "-rms_norm", "-silu_and_mul", "-rotary_embedding"]},
                on_cuda=True,
            ),
            "vllm",
        ),
    ],
)
def test_choose_profile(kwargs, expected):
    name, reason = choose_profile(**kwargs)
    assert name == expected
    assert "vllm" in reason or "sglang" in reason


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rollout_name=None),
        dict(rollout_name="trtllm"),
        dict(rollout_name="vllm", compilation_config={"custom_ops": ["+rms_norm"]}),
    ],
)
def test_choose_profile_errors(kwargs):
    with pytest.raises(ProfileMismatchError, match="alignment.engine"):
        choose_profile(**kwargs)


def _resolved(cfg, on_cuda: bool):
    spec, reason = resolve_spec(cfg, read_spec(cfg), on_cuda=on_cuda)
    return spec.regions, spec.engine, reason


def test_resolve_from_config_auto_and_explicit():
    cfg = compose_ours(
        "alignment.regions=[rope]",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.enforce_eager=true",
    )
    regions, profile, reason = _resolved(cfg, on_cuda=True)
    assert (regions, profile) == (("rope",), "vllm-eager")
    assert "enforce_eager=True" in reason
    cfg = compose_ours(
        "alignment.regions=[rope]",
        "actor_rollout_ref.rollout.name=vllm",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config={custom_ops:[all]}",
    )
    assert _resolved(cfg, on_cuda=False)[1] == "vllm-cpu-eager"
    cfg = compose_ours("alignment.regions=[swiglu]", "actor_rollout_ref.rollout.name=sglang")
    assert _resolved(cfg, on_cuda=True)[:2] == (("swiglu",), "sglang")
    cfg = compose_ours(
        "alignment.regions=[rmsnorm]", "alignment.engine=vllm-eager", "actor_rollout_ref.rollout.name=vllm"
    )
    assert _resolved(cfg, on_cuda=False)[1] == "vllm-eager"
    # a baseline run still names the profile the workers would use (not "auto")
    vllm = "actor_rollout_ref.rollout.name=vllm"
    assert would_use_profile(compose_ours(vllm), on_cuda=True) == "vllm"
    assert would_use_profile(compose_ours(vllm), on_cuda=False) == "vllm-cpu"


def test_baseline_banner_names_the_resolved_profile(monkeypatch):
    """regions=[]: the trainer's start-up line names the profile the workers would use, never `auto`."""
    from rlalign_verl.verl import trainer_callback

    lines = []
    monkeypatch.setattr(trainer_callback.logger, "info", lambda msg, *a: lines.append(msg % a))
    monkeypatch.setattr("rlalign_verl.verl.config.cuda_available", lambda: False)
    trainer = type("Trainer", (), {"config": compose_ours("actor_rollout_ref.rollout.name=vllm")})()
    trainer_callback._start_run(trainer, legacy=False)
    assert lines == ["alignment regions=none (baseline) profile=vllm-cpu; mismatch metrics (mismatch/*) on"]
    eager = compose_ours(
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=True"
    )
    assert would_use_profile(eager, on_cuda=True) == "vllm-eager"
    unresolved = would_use_profile(compose_ours("actor_rollout_ref.rollout.name=trtllm"), on_cuda=False)
    assert unresolved.startswith("auto (unresolved: ") and "alignment.engine" in unresolved
