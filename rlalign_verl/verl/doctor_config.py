"""Start-up confounder checks: verl settings that make the train-vs-rollout gap something other than rounding.

Run on the driver before Ray starts, over the composed verl trainer config (an OmegaConf ``DictConfig`` or a
plain mapping). Each :class:`Finding` names what is set, what it does to the ratio
``pi_train / pi_rollout`` of the sampled tokens, and the fix, in one line.

What verl 0.9.1 + vLLM do (read in their code, see docs/reading-a-mismatch.md):

- verl starts vLLM with ``logprobs_mode=actor_rollout_ref.rollout.logprobs_mode``, default ``processed_logprobs``
  (``workers/rollout/vllm_rollout/vllm_async_server.py``). vLLM's processed log-probs are taken after temperature
  *and* top-k/top-p: ``log_softmax`` of the filtered logits, i.e. renormalised over the kept tokens
  (``vllm/v1/sample/ops/topk_topp_sampler.py``); ``raw_logprobs`` are before temperature and filters.
- verl's trainer divides the logits by ``actor_rollout_ref.rollout.temperature`` when it recomputes
  ``old_log_probs`` (``meta_info["temperature"]``) and applies no top-k/top-p.
- So with ``processed_logprobs`` the temperatures agree and every filtered token carries ``Δ = log(kept mass)``;
  with ``raw_logprobs`` the filters vanish from the log-probs but a temperature other than 1 does not.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from rlalign_verl.base.options import option_bool
from rlalign_verl.request.findings import FINDING_KEYS, DoctorConfigError, Finding, raise_or_lines, settle
from rlalign_verl.verl.config_access import select

__all__ = ["Finding", "FINDING_KEYS", "DoctorConfigError", "confounders", "check", "doctor_context"]

ROLLOUT, ACTOR, CORRECTION = (
    "actor_rollout_ref.rollout",
    "actor_rollout_ref.actor",
    "algorithm.rollout_correction",
)
ALLOW_KEY = "alignment.doctor.allow"


def _num(config: Any, key: str, default: float | None = None) -> float | None:
    value = select(config, key)
    if value is None or isinstance(value, bool):
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        return default  # verl's own validation names a malformed number


def _flag(config: Any, key: str, default: bool) -> bool:
    return option_bool(select(config, key), name=key, default=default)


def _text(config: Any, key: str, default: str = "") -> str:
    value = select(config, key)
    return default if value is None else str(value).strip().lower()


def _corrections(config: Any) -> list[str]:
    """The rollout-correction settings that make the rollout log-probs enter the loss."""
    on = []
    for key in ("rollout_is", "rollout_rs"):
        value = select(config, f"{CORRECTION}.{key}")
        if value not in (None, "", False):
            on.append(f"{CORRECTION}.{key}={value}")
    if _flag(config, f"{CORRECTION}.bypass_mode", False):
        on.append(f"{CORRECTION}.bypass_mode=True (the rollout log-probs are the PPO old log-probs)")
    return on


def doctor_context(config: Any) -> dict[str, Any]:
    """The sampling settings :func:`rlalign_verl.measure.doctor.diagnose_signature` uses to name a cause."""
    return {
        "rollout": _text(config, f"{ROLLOUT}.name"),
        "top_p": _num(config, f"{ROLLOUT}.top_p", 1.0),
        "top_k": _num(config, f"{ROLLOUT}.top_k", -1.0),
        "temperature": _num(config, f"{ROLLOUT}.temperature", 1.0),
        "logprobs_mode": _text(config, f"{ROLLOUT}.logprobs_mode", "processed_logprobs"),
        "multi_turn": _agent_loop(config) != SINGLE_TURN
        or _flag(config, f"{ROLLOUT}.multi_turn.enable", False),
        "trainer_mode": _text(config, "trainer.v1.trainer_mode", "sync"),
    }


SINGLE_TURN = "single_turn_agent"
VERL_AGENT_LOOPS = (SINGLE_TURN, "tool_agent")
"""verl 0.9.1's own agent loops (``experimental/agent_loop``): both keep the conversation as token ids (their
Continuous Token builder appends each turn's ids), so the trainer scores the ids the engine sampled after."""


def _agent_loop(config: Any) -> str:
    """The run's default agent loop; ``"custom"`` when ``agent_loop_config_path`` registers loops of its own."""
    if select(config, f"{ROLLOUT}.agent.agent_loop_config_path") not in (None, ""):
        return "custom"
    name = select(config, f"{ROLLOUT}.agent.default_agent_loop")
    return str(name).strip() if name not in (None, "") else SINGLE_TURN  # registry names are case-sensitive


_LINES = {
    "logits": "{R}.logprobs_mode={mode}: vLLM reports logits, not log-probs, as rollout_log_probs, so every "
    "train/rollout ratio is meaningless (Δ = log-prob - logit); fix: logprobs_mode=processed_logprobs (verl's default)",
    "processed": "{R}.{filters} with logprobs_mode=processed_logprobs: vLLM reports log-probs renormalised over "
    "the kept tokens, so every train/rollout ratio is offset by log(kept mass) <= 0 (mismatch/doctor/bias < 0, "
    "largest where the distribution is flat){effect}; fix: top_p=1 and top_k=-1 for training rollouts (filters "
    "belong in {R}.val_kwargs)",
    "fed": ", and {corr} feeds that offset into the loss (IS weights / PPO ratios shrink by the kept mass)",
    "metrics_only": "; the loss uses the recomputed old_log_probs, so only mismatch/* and "
    "training/rollout_probs_diff_* show it",
    "unfiltered": "{R}.{filters}: {how} probabilities before the top-p/top-k renormalisation while tokens are "
    "sampled after it, so mismatch/* looks clean but the true behaviour probability is higher by 1/kept mass and any "
    "rollout correction under-corrects; fix: top_p=1 and top_k=-1 for training rollouts ({R}.val_kwargs for eval)",
    "raw_temperature": "{R}.temperature={temp:g} with logprobs_mode={mode}: verl divides the trainer's logits by "
    "the temperature but vLLM reports log-probs of the unscaled logits, so Δ = log softmax(z/T) - log softmax(z), one "
    "side sharper (mismatch/doctor/corr_logprob far from 0){effect}; fix: logprobs_mode=processed_logprobs",
    "sglang_temperature": "{R}.temperature={temp:g} with SGLANG_RETURN_ORIGINAL_LOGPROB set: SGLang reports "
    "log-probs before temperature while verl's trainer applies it, so one side is sharper "
    "(mismatch/doctor/corr_logprob); fix: unset SGLANG_RETURN_ORIGINAL_LOGPROB for the rollout servers",
    "micro_batch": "{a_key}={a:g} but {b_key}={b:g}: old_log_probs are computed in other batch shapes than the "
    "update's log-probs, so batch-dependent kernels make pi/pi_old != 1 before any update (a gap beside the "
    "rollout's: it shows in actor/ppo_kl, not in mismatch/*); fix: give both the same value",
    "no_logprobs": "{R}.calculate_log_probs=False: the rollout returns no log-probs, so no train/rollout mismatch "
    "can be measured (no mismatch/*, no doctor) and rollout correction has nothing to divide by; fix: "
    "calculate_log_probs=True",
    "async": "trainer.v1.trainer_mode={mode}: rollouts are sampled with weights{detail}, so Δ holds the policy "
    "change as well as rounding (mean Δ near -KL, mismatch/doctor/gap_growth); fix: trainer_mode=sync to measure "
    "numerics alone",
    "multi_turn": "{what} is not one of verl's agent loops ({ours}), which keep the conversation as token ids: "
    "a loop that re-renders or re-tokenises past turns gives the trainer another history than the engine sampled "
    "in, which shows as heavy tails in the later rounds (mismatch/round_{{k}}/share_above_1), not as rounding; fix: "
    "build each turn's context from the rollout's token ids (AgentLoopBase's Continuous Token builder)",
    "r3_unrecorded": "router_replay.mode=R3 replays the rollout's expert routes but {R}.enable_rollout_routing_replay"
    "=False records none; fix: enable_rollout_routing_replay=True",
    "r3_unreplayed": "{R}.enable_rollout_routing_replay=True records the rollout's expert routes but the actor does "
    "not replay them (router_replay.mode is not R3; the FSDP engine has none), so MoE routing flips stay in Δ as "
    "heavy tails; fix: router_replay.mode=R3 (Megatron/VeOmni actor) or accept the flips",
    "dtype": "{R}.dtype={rollout} but the actor computes in {actor} (fsdp_config.mixed_precision.param_dtype): "
    "the two sides round to different precisions, so Δ is a precision gap that rounding alignment (a bf16 engine "
    "mirror) cannot close; fix: one dtype on both sides",
    "quantization": "{R}.quantization={quant}: the rollout samples with quantized weights, so Δ holds quantization "
    "error (far above bf16 rounding, often heavy-tailed); fix: quantization=null, or read mismatch/* as "
    "quantization + rounding",
}


def _line(name: str, **values: Any) -> str:
    return _LINES[name].format(R=ROLLOUT, **values)


def _sampling(ctx: dict[str, Any], fixes: list[str]) -> list[Finding]:
    """logprobs_mode, top-p/top-k and temperature against the engine's log-prob semantics."""
    out: list[Finding] = []
    name, mode, temp, corr = ctx["rollout"], ctx["logprobs_mode"], ctx["temperature"], "; ".join(fixes)
    if name == "vllm" and mode.endswith("_logits"):
        out.append(Finding("logprobs_mode", "error", _line("logits", mode=mode)))
    parts = [f"top_p={ctx['top_p']:g}"] if ctx["top_p"] < 1 else []
    filters = " and ".join(parts + ([f"top_k={ctx['top_k']:g}"] if ctx["top_k"] > 0 else []))
    if filters and name == "vllm" and mode == "processed_logprobs":
        effect = _line("fed", corr=corr) if corr else _line("metrics_only")
        line = _line("processed", filters=filters, effect=effect)
        out.append(Finding("top_p_top_k", "error" if corr else "warn", line))
    elif filters:
        how = {"vllm": f"logprobs_mode={mode} reports", "sglang": "SGLang reports"}.get(
            name, f"{name!r} may report"
        )
        out.append(Finding("top_p_top_k", "warn", _line("unfiltered", filters=filters, how=how)))
    if temp > 0 and temp != 1 and name == "vllm" and mode.startswith("raw"):
        effect = f", fed into the loss by {corr}" if corr else ""
        line = _line("raw_temperature", temp=temp, mode=mode, effect=effect)
        out.append(Finding("temperature", "error" if corr else "warn", line))
    original = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB")
    if (
        temp != 1
        and name == "sglang"
        and option_bool(original, name="SGLANG_RETURN_ORIGINAL_LOGPROB", default=False)
    ):
        out.append(Finding("temperature", "warn", _line("sglang_temperature", temp=temp)))
    return out


def _batching(config: Any) -> list[Finding]:
    """The log-prob recompute batched differently from the update (token budgets under dynamic batching)."""
    if _flag(config, f"{ACTOR}.use_dynamic_bsz", False):
        a_key, b_key = f"{ROLLOUT}.log_prob_max_token_len_per_gpu", f"{ACTOR}.ppo_max_token_len_per_gpu"
    else:
        a_key, b_key = f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", f"{ACTOR}.ppo_micro_batch_size_per_gpu"
    a, b = _num(config, a_key), _num(config, b_key)
    if a is None or b is None or a == b:
        return []
    return [Finding("micro_batch", "warn", _line("micro_batch", a_key=a_key, a=a, b_key=b_key, b=b))]


def _pipeline(config: Any, ctx: dict[str, Any], fixes: list[str]) -> list[Finding]:
    """Settings that change what the rollout log-probs are compared with: staleness, turns, routes."""
    out: list[Finding] = []
    if not _flag(config, f"{ROLLOUT}.calculate_log_probs", True):
        out.append(Finding("calculate_log_probs", "error" if fixes else "warn", _line("no_logprobs")))
    mode = ctx["trainer_mode"]
    if _flag(config, "trainer.use_v1", True) and mode not in ("", "sync"):
        lag = _num(config, "trainer.v1.sampler.max_off_policy_threshold")
        sync = _num(config, f"trainer.v1.{mode}.parameter_sync_step")
        detail = f" up to {lag:g} versions old" if lag is not None else " of unbounded age"
        detail += f", synced every {sync:g} steps" if sync is not None else ""
        out.append(Finding("async_staleness", "warn", _line("async", mode=mode, detail=detail)))
    loop = _agent_loop(config)
    if loop not in VERL_AGENT_LOOPS:
        key, value = "default_agent_loop", loop
        if loop == "custom":
            key = "agent_loop_config_path"
            value = select(config, f"{ROLLOUT}.agent.{key}")
        line = _line("multi_turn", what=f"{ROLLOUT}.agent.{key}={value}", ours=", ".join(VERL_AGENT_LOOPS))
        out.append(Finding("multi_turn", "warn", line))
    modes = {
        _text(config, f"{ACTOR}.{engine}.router_replay.mode", "disabled") for engine in ("megatron", "veomni")
    }
    recorded = _flag(config, f"{ROLLOUT}.enable_rollout_routing_replay", False)
    if "r3" in modes and not recorded:
        out.append(Finding("routing_replay", "error", _line("r3_unrecorded")))
    elif recorded and "r3" not in modes:
        out.append(Finding("routing_replay", "warn", _line("r3_unreplayed")))
    return out


_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
           "float32": "fp32", "fp32": "fp32", "float": "fp32"}  # fmt: skip


def _weights(config: Any) -> list[Finding]:
    """The rollout's weights in another precision than the actor's compute."""
    out = []
    spelled = _text(config, f"{ROLLOUT}.dtype", "bfloat16")
    rollout = _DTYPES.get(spelled)
    if _text(config, f"{ACTOR}.strategy", "fsdp") in ("fsdp", "fsdp2"):
        actor = _DTYPES.get(_text(config, f"{ACTOR}.fsdp_config.mixed_precision.param_dtype", "bf16"))
        if rollout and actor and rollout != actor:
            out.append(Finding("dtype", "warn", _line("dtype", rollout=spelled, actor=actor)))
    quant = select(config, f"{ROLLOUT}.quantization")
    if quant:
        out.append(Finding("quantization", "warn", _line("quantization", quant=quant)))
    return out


def confounders(config: Any, allow: Iterable[str] = ()) -> list[Finding]:
    """Every confounder in ``config``; errors whose key is in ``allow`` are downgraded to warnings.

    Raises :class:`DoctorConfigError` when ``allow`` names a key that is not in :data:`FINDING_KEYS`.
    """
    ctx = doctor_context(config)
    fixes = _corrections(config)
    found = _sampling(ctx, fixes) + _batching(config) + _pipeline(config, ctx, fixes) + _weights(config)
    return settle(found, allow, ALLOW_KEY, ALLOW_KEY + "=[{key}]")


def check(config: Any, allow: Iterable[str] = ()) -> list[str]:
    """Raise :class:`DoctorConfigError` with the first unacknowledged error's line; else the warning lines."""
    return raise_or_lines(confounders(config, allow))
