"""Start-up confounder checks for OpenRLHF: its flags that make the train-vs-rollout gap something other than rounding.

The verl checks (:mod:`rlalign_verl.verl.doctor_config`) read verl's config; these read the OpenRLHF flags the
launcher passes on, before Ray starts. What OpenRLHF 0.11.2 does (read in ``openrlhf/cli/train_ppo_ray.py``,
``openrlhf/models/actor.py``):

- vLLM reports ``processed_logprobs`` whenever rollout log-probs are collected (IS correction on, or the plugin's
  ``--alignment.collect_rollout_logprobs``): after temperature and after top-p, renormalised over the kept tokens.
- The actor divides its logits by ``--rollout.temperature`` too, so temperatures agree; it applies no top-p.
- ``experience.action_log_probs`` (the PPO old log-probs) are computed in ``--rollout.micro_batch_size`` batches,
  the update's in ``--train.micro_batch_size`` batches (both default 1 in 0.10+); with ``--train.dynamic_batch_enable``
  in token budgets ``--rollout.max_tokens_per_gpu`` (default: the update's) and ``--train.max_tokens_per_gpu``.
- ``--train.async_enable`` samples with weights up to ``--train.async_queue_size`` updates old;
  ``--train.partial_rollout_enable`` mixes old and new weights inside one sample.
- ``--train.agent_func_path`` runs multi-turn agent rollouts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rlalign_verl.openrlhf.flags import spellings
from rlalign_verl.openrlhf.settings import flag_value, rollout_logprobs_requested, switch_on
from rlalign_verl.request.findings import Finding, raise_or_lines, settle

__all__ = ["confounders", "check"]

ALLOW_FLAG = "--alignment.doctor.allow"


_MALFORMED = object()
"""A flag given with a value that is not a number: OpenRLHF's own parser names it; the check says nothing."""


def _number(argv: Sequence[str], setting: str) -> tuple[Any, str | None]:
    """``(value, the spelling given)`` of a numeric flag: ``(None, None)`` when absent, :data:`_MALFORMED` when not
    a number."""
    names = spellings(setting)
    value = flag_value(argv, names)
    given = next((n for n in names if any(a == n or a.startswith(n + "=") for a in argv)), None)
    if given is None:
        return None, None
    try:
        return float(value), given  # a bare flag (value True) is malformed too
    except (TypeError, ValueError):
        return _MALFORMED, given


def _sizes(argv: Sequence[str]) -> tuple[Any, str, Any, str] | None:
    """``(recompute value, its flag, update value, its flag)`` of the batch shapes the two passes use, or ``None``.

    Fixed micro-batches: ``--rollout.micro_batch_size`` vs ``--train.micro_batch_size`` (0.10+ default 1 each).
    Dynamic batching (``--train.dynamic_batch_enable``): token budgets ``--rollout.max_tokens_per_gpu`` (default: the
    update's) vs ``--train.max_tokens_per_gpu`` (default 16192). A flag left out takes that default only when the
    given one is spelled the dotted way; older releases (flat spellings) had other defaults, so there both are needed.
    """
    dynamic = switch_on(argv, spellings("dynamic_batch_enable"))
    names = ("rollout_max_tokens_per_gpu", "train_max_tokens_per_gpu") if dynamic else (
        "rollout_micro_batch_size", "train_micro_batch_size")  # fmt: skip
    (a, a_flag), (b, b_flag) = _number(argv, names[0]), _number(argv, names[1])
    if a is _MALFORMED or b is _MALFORMED or (a_flag is None and b_flag is None and not dynamic):
        return None
    dotted = all(f is None or not f.startswith("--") or "." in f[2:] for f in (a_flag, b_flag))
    if dotted:
        b = b if b is not None else (16192.0 if dynamic else 1.0)
        a = a if a is not None else (b if dynamic else 1.0)
    return a, a_flag or spellings(names[0])[0], b, b_flag or spellings(names[1])[0]


def _micro_batches(argv: Sequence[str]) -> list[Finding]:
    sizes = _sizes(argv)
    if sizes is None or sizes[0] is None or sizes[2] is None or sizes[0] == sizes[2]:
        return []
    rollout, r_flag, train, t_flag = sizes
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
    if isinstance(top_p, float) and top_p < 1 and (corrected or collect_rollout_logprobs):
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
    """Raise :class:`~rlalign_verl.request.findings.DoctorConfigError` for an unacknowledged error; else the warnings."""
    return raise_or_lines(confounders(argv, collect_rollout_logprobs=collect_rollout_logprobs, allow=allow))
