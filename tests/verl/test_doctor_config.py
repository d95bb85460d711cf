"""Start-up confounder checks on verl's real composed config: each confounder found with its one line, the
default config clean, ``allow`` downgrading errors."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from omegaconf import OmegaConf  # noqa: E402
from verl_configs import GRPO_MINIMAL, compose_ours, compose_verl  # noqa: E402

from rlalign_verl.base.errors import AlignmentError  # noqa: E402
from rlalign_verl.measure.doctor import diagnose_signature  # noqa: E402
from rlalign_verl.verl.doctor_config import (  # noqa: E402
    FINDING_KEYS,
    DoctorConfigError,
    check,
    confounders,
    doctor_context,
)

pytestmark = pytest.mark.verl

R = "actor_rollout_ref.rollout"
IS_ON = "algorithm.rollout_correction.rollout_is=token"


def config(*overrides: str):
    return compose_ours(*GRPO_MINIMAL, f"{R}.name=vllm", *overrides)


def found(*overrides: str) -> dict[str, tuple[str, str]]:
    findings = confounders(config(*overrides))
    out = {f.key: (f.severity, f.line) for f in findings}
    assert len(out) == len(findings)  # one finding per key
    return out


def test_default_configs_are_clean():
    assert confounders(config()) == [] and check(config()) == []
    # verl's own defaults (no micro-batch sizes set, no alignment group): nothing of severity error
    plain = compose_verl(f"{R}.name=vllm")
    assert [f for f in confounders(plain) if f.severity == "error"] == []
    assert doctor_context(config()) == {
        "rollout": "vllm",
        "top_p": 1.0,
        "top_k": -1.0,
        "temperature": 1.0,
        "logprobs_mode": "processed_logprobs",  # verl 0.9.1's default
        "multi_turn": False,
        "trainer_mode": "sync",
    }


CASES = [
    ([f"{R}.top_p=0.8"], "top_p_top_k", "warn", ["top_p=0.8 with logprobs_mode=processed_logprobs", "log(kept mass)",
                                                  "only mismatch/*"]),
    ([f"{R}.top_p=0.8", IS_ON], "top_p_top_k", "error", ["rollout_is=token feeds that offset into the loss",
                                                          "alignment.doctor.allow=[top_p_top_k]"]),
    ([f"{R}.top_k=20", "algorithm.rollout_correction.bypass_mode=True"], "top_p_top_k", "error",
     ["top_k=20", "bypass_mode=True (the rollout log-probs are the PPO old log-probs)"]),
    ([f"{R}.top_p=0.9", f"{R}.logprobs_mode=raw_logprobs"], "top_p_top_k", "warn", ["1/kept mass", "raw_logprobs"]),
    ([f"{R}.top_p=0.9", f"{R}.name=sglang"], "top_p_top_k", "warn", ["SGLang reports probabilities before"]),
    ([f"{R}.temperature=0.7", f"{R}.logprobs_mode=raw_logprobs"], "temperature", "warn",
     ["temperature=0.7 with logprobs_mode=raw_logprobs", "log softmax(z/T) - log softmax(z)"]),
    ([f"{R}.temperature=0.7", f"{R}.logprobs_mode=raw_logprobs", "algorithm.rollout_correction.rollout_rs=token_k1"],
     "temperature", "error", ["fed into the loss by algorithm.rollout_correction.rollout_rs=token_k1"]),
    ([f"{R}.logprobs_mode=processed_logits"], "logprobs_mode", "error", ["logits, not log-probs"]),
    ([f"{R}.log_prob_micro_batch_size_per_gpu=4"], "micro_batch", "warn",
     ["log_prob_micro_batch_size_per_gpu=4 but actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]),
    (["actor_rollout_ref.actor.use_dynamic_bsz=True", f"{R}.log_prob_use_dynamic_bsz=True",
      f"{R}.log_prob_max_token_len_per_gpu=8192"], "micro_batch", "warn",
     ["log_prob_max_token_len_per_gpu=8192 but actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384"]),
    ([f"{R}.calculate_log_probs=False"], "calculate_log_probs", "warn", ["no train/rollout mismatch can be measured"]),
    ([f"{R}.calculate_log_probs=False", IS_ON], "calculate_log_probs", "error", ["nothing to divide by"]),
    (["trainer.v1.trainer_mode=separate_async"], "async_staleness", "warn",
     ["up to 8 versions old, synced every 4 steps", "gap_growth"]),
    ([f"{R}.agent.default_agent_loop=my_react_agent"], "multi_turn", "warn",
     ["default_agent_loop=my_react_agent is not one of verl's agent loops (single_turn_agent, tool_agent)",
      "mismatch/round_{k}/share_above_1"]),
    ([f"{R}.agent.agent_loop_config_path=loops.yaml"], "multi_turn", "warn", ["agent_loop_config_path=loops.yaml"]),
    ([f"{R}.enable_rollout_routing_replay=True"], "routing_replay", "warn", ["does not replay them"]),
    ([f"{R}.dtype=float16"], "dtype", "warn", ["dtype=float16 but the actor computes in bf16"]),
    ([f"{R}.quantization=fp8"], "quantization", "warn", ["quantized weights"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "overrides,key,severity,needles", CASES, ids=[f"{c[1]}-{c[2]}-{i}" for i, c in enumerate(CASES)]
)
def test_each_confounder_is_found(overrides, key, severity, needles):
    out = found(*overrides)
    assert out[key][0] == severity
    for needle in needles:
        assert needle in out[key][1]
    assert "\n" not in out[key][1] and "fix:" in out[key][1]
    assert set(out) == {key}  # nothing else fires on these settings


def test_consistent_temperature_is_not_a_confounder(monkeypatch):
    """verl passes rollout.temperature to the trainer; vLLM's processed and SGLang's log-probs include it."""
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    assert found(f"{R}.temperature=0.7") == {}
    assert found(f"{R}.temperature=0.7", f"{R}.name=sglang") == {}
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")  # SGLang then reports pre-temperature log-probs
    assert found(f"{R}.temperature=0.7", f"{R}.name=sglang")["temperature"][0] == "warn"


def test_verls_own_multi_turn_loop_is_not_a_confounder():
    """verl 0.9.1's tool agent appends each turn's token ids (token in, token out): nothing to warn about, but the
    verdicts know the run is multi-turn."""
    on = (f"{R}.agent.default_agent_loop=tool_agent", f"{R}.multi_turn.enable=True")
    assert found(*on) == {}
    assert doctor_context(config(*on))["multi_turn"] is True
    assert doctor_context(config(f"{R}.agent.default_agent_loop=tool_agent"))["multi_turn"] is True


def test_r3_without_recorded_routes_on_the_megatron_config():
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(
            "ppo_megatron_trainer",
            overrides=[f"{R}.name=vllm", "actor_rollout_ref.actor.megatron.router_replay.mode=R3"],
        )
    [finding] = confounders(cfg)
    assert (finding.key, finding.severity) == ("routing_replay", "error")
    cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay = True
    assert confounders(cfg) == []


def test_check_raises_one_line_and_allow_downgrades():
    cfg = config(f"{R}.top_p=0.8", IS_ON, f"{R}.log_prob_micro_batch_size_per_gpu=4")
    with pytest.raises(DoctorConfigError) as err:
        check(cfg)
    assert isinstance(err.value, AlignmentError) and "\n" not in str(err.value)
    assert "top_p=0.8" in str(err.value) and "alignment.doctor.allow=[top_p_top_k]" in str(err.value)
    lines = check(cfg, allow=OmegaConf.create(["top_p_top_k"]))  # the group's list arrives as a ListConfig
    assert len(lines) == 2 and "(acknowledged in alignment.doctor.allow)" in lines[0]
    assert [f.severity for f in confounders(cfg, ("top_p_top_k",))] == ["warn", "warn"]
    with pytest.raises(DoctorConfigError, match="not finding keys"):
        check(cfg, allow=("top_p",))
    with pytest.raises(DoctorConfigError, match="give a list"):
        check(cfg, allow="top_p_top_k")
    assert set(FINDING_KEYS) >= {k for _, k, _, _ in CASES} | {"routing_replay"}


def test_context_names_the_cause_in_the_verdict():
    ctx = doctor_context(config(f"{R}.top_p=0.8", f"{R}.multi_turn.enable=True"))
    assert ctx["top_p"] == 0.8 and ctx["multi_turn"] is True
    sig = {"num_tokens": 5000.0, "num_seqs": 64.0, "abs_mean": 0.2, "bias": -0.2, "bias_lo": -0.21,
           "bias_hi": -0.19, "bias_share": 1.0, "corr_logprob": 0.6, "share_above_1": 0.0}  # fmt: skip
    [line] = diagnose_signature(sig, context=ctx)
    assert "top_p=0.8 in this run" in line


def test_plain_mapping_config():
    cfg = {"actor_rollout_ref": {"rollout": {"name": "vllm", "top_p": 0.8}}, "algorithm": {
        "rollout_correction": {"rollout_is": "sequence"}}}  # fmt: skip
    [finding] = confounders(cfg)
    assert (finding.key, finding.severity) == ("top_p_top_k", "error")


def test_the_docs_name_every_finding_key():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "reading-a-mismatch.md").read_text()
    assert [k for k in FINDING_KEYS if f"`{k}`" not in doc] == []
