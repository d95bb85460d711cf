"""Start-up confounder checks for OpenRLHF: its flags that make the train-vs-rollout gap something other than rounding.

The verl checks (:mod:`rlalign_verl.verl.doctor_config`) read verl's config; these read the OpenRLHF flags the
launcher passes on, before Ray starts. What OpenRLHF 0.11.2 does (read in ``openrlhf/cli/train_ppo_ray.py``,
``openrlhf/models/actor.py``):

- vLLM reports ``processed_logprobs`` whenever rollout log-probs are collected (IS correction on, or the plugin's
  ``--alignment.collect_rollout_logprobs``): after temperature and after top-p, renormalised over the kept tokens.
- The actor divides its logits by ``--rollout.temperature`` too, so temperatures agree; it applies no top-p.
- ``experience.action_log_probs`` (the PPO old log-probs) are computed in ``--rollout.micro_batch_size`` batches,
  the update's in ``--train.micro_batch_size`` batches (both default 1 in 0.10+).
- ``--train.async_enable`` samples with weights up to ``--train.async_queue_size`` updates old;
  ``--train.partial_rollout_enable`` mixes old and new weights inside one sample.
- ``--train.agent_func_path`` runs multi-turn agent rollouts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..doctor_findings import Finding, raise_or_lines, settle
from .flags import spellings
from .settings import flag_value, rollout_logprobs_requested, switch_on

__all__ = ["confounders", "check"]

ALLOW_FLAG = "--alignment.doctor.allow"


def _number(argv: Sequence[str], setting: str) -> tuple[float | None, str | None]:
    """``(value, the spelling given)`` of a numeric flag; ``(None, None)`` when absent or not a number."""
    names = spellings(setting)
    value = flag_value(argv, names)
    given = next((n for n in names if any(a == n or a.startswith(n + "=") for a in argv)), None)
    try:
        return (float(value), given) if isinstance(value, str) else (None, given)
    except ValueError:
        return None, given  # OpenRLHF's own parser names a malformed number


def _micro_batches(argv: Sequence[str]) -> list[Finding]:
    (rollout, r_flag), (train, t_flag) = (
        _number(argv, "rollout_micro_batch_size"),
        _number(argv, "train_micro_batch_size"),
    )
    if r_flag is None and t_flag is None:
        return []
    # a flag left out takes OpenRLHF 0.10+'s default (1) when the other is spelled the dotted way; older releases
    # (flat spellings) had other defaults, so there both must be given
    dotted = (r_flag or t_flag or "").startswith("--rollout.") or (r_flag or t_flag or "").startswith(
        "--train."
    )
    r_flag, t_flag = (
        r_flag or spellings("rollout_micro_batch_size")[0],
        t_flag or spellings("train_micro_batch_size")[0],
    )
    rollout = rollout if rollout is not None or not dotted else 1.0
    train = train if train is not None or not dotted else 1.0
    if rollout is None or train is None or rollout == train:
        return []
    return [Finding("micro_batch", "warn", f"{r_flag}={rollout:g} but {t_flag}={train:g}: the PPO old log-probs are "
                    "computed in other batch shapes than the update's log-probs, so batch-dependent kernels make "
                    "pi/pi_old != 1 before any update (a gap beside the rollout's: it shows in the PPO KL, not in "
                    "mismatch/*); fix: give both the same value")]  # fmt: skip


def confounders(
    argv: Sequence[str], *, collect_rollout_logprobs: bool, allow: Iterable[str] | None = ()
) -> list[Finding]:
    """Every confounder in OpenRLHF's ``argv``; errors whose key is in ``allow`` become warnings."""
    found: list[Finding] = []
    corrected = rollout_logprobs_requested(argv)  # the rollout log-probs enter the loss (IS correction)
    top_p, top_p_flag = _number(argv, "top_p")
    if top_p is not None and top_p < 1 and (corrected or collect_rollout_logprobs):
        effect = ("the IS correction (--algo.advantage.is_correction_level) feeds that offset into the loss"
                  if corrected else "the loss is unchanged (measure-only), so only mismatch/* shows it")  # fmt: skip
        found.append(Finding("top_p_top_k", "error" if corrected else "warn", f"{top_p_flag}={top_p:g}: vLLM reports "
                             "processed log-probs renormalised over the kept tokens, so every train/rollout ratio is "
                             f"offset by log(kept mass) <= 0 (mismatch/doctor/bias < 0); {effect}; fix: "
                             f"{top_p_flag}=1 for training rollouts"))  # fmt: skip
    found += _micro_batches(argv)
    if switch_on(argv, spellings("async_enable")):
        partial = switch_on(argv, spellings("partial_rollout_enable"))
        detail = ", and partial rollouts mix old and new weights inside one sample" if partial else ""
        found.append(Finding("async_staleness", "warn", f"{spellings('async_enable')[0]}: rollouts are sampled with "
                             f"weights up to --train.async_queue_size updates old{detail}, so Δ holds the policy change "
                             "as well as rounding (mean Δ near -KL, mismatch/doctor/gap_growth); fix: synchronous "
                             "training to measure numerics alone"))  # fmt: skip
    agent = flag_value(argv, spellings("agent_func_path"))
    if isinstance(agent, str):
        found.append(Finding("multi_turn", "warn", f"{spellings('agent_func_path')[0]}={agent}: multi-turn agent "
                             "rollouts; a history the agent re-tokenises gives the trainer ids or a context the engine "
                             "never sampled, which shows in later rounds (mismatch/round_{k}/share_above_1) or as "
                             "mismatch/doctor/token_id_mismatch, not as rounding; fix: keep the engine's token ids for "
                             "the whole conversation"))  # fmt: skip
    return settle(found, allow, ALLOW_FLAG, ALLOW_FLAG + " {key}")


def check(
    argv: Sequence[str], *, collect_rollout_logprobs: bool, allow: Iterable[str] | None = ()
) -> list[str]:
    """Raise :class:`~rlalign_verl.doctor_findings.DoctorConfigError` for an unacknowledged error; else the warnings."""
    return raise_or_lines(confounders(argv, collect_rollout_logprobs=collect_rollout_logprobs, allow=allow))
