"""The doctor's verdicts: which causes other than rounding a signature shows, in plain-language lines.

:func:`findings` / :func:`diagnose_signature` read a signature (:func:`rlalign_verl.measure.doctor.signatures`, or
the same keys from a log) and the run's sampling settings (:func:`check_context`); the thresholds below are
explained in docs/reading-a-mismatch.md. A bias is only named from an interval over at least
:data:`~rlalign_verl.measure.intervals.MIN_UNITS` sequences (the bootstrap's rule, shared with ``verify``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from rlalign_verl.measure.doctor_trend import PREFIX
from rlalign_verl.measure.intervals import MIN_UNITS, enough_units
from rlalign_verl.measure.tensor_inputs import check_bool, check_mapping, check_number, input_error

__all__ = ["findings", "diagnose_signature", "check_context", "sig_values", "judge"]


# Verdict thresholds; docs/reading-a-mismatch.md says where each sits and why.
MIN_TOKENS = 100
MIN_SEQS = MIN_UNITS
"""The bootstrap's rule (:data:`~rlalign_verl.measure.intervals.MIN_UNITS`): fewer sequences carry no interval."""
BIAS_FLOOR = 1e-3
"""nats/token: a smaller bias moves an importance weight by under 0.1% per token."""
BIAS_SHARE, ONE_SIDED_SHARE = 0.5, 0.8
SCALE_CORR = 0.3
HEAVY_SHARE = 0.05
DUP_SHARE = 0.5
GROWTH_REL = 0.5


_SIG_NAMES = ("num_tokens", "num_seqs", "abs_mean", "bias", "bias_lo", "bias_hi", "bias_share", "corr_logprob",
              "share_above_1", "share_above_0p1", "dup_rate", "dup_groups", "gap_growth", "gap_growth_lo",
              "gap_growth_hi", "gap_growth_rel")  # fmt: skip


def sig_values(where: str, sig: Any) -> dict[str, float | None]:
    """The signature's values the verdicts read (``mismatch/doctor/<name>`` or ``<name>``); ``None``: absent or
    not finite. A value that is not a number is refused (a str would otherwise be read or dropped silently)."""
    check_mapping(where, "sig", sig, hint=" of signature keys, as signatures() returns")
    out: dict[str, float | None] = {}
    for name in _SIG_NAMES:
        key = PREFIX + name if PREFIX + name in sig else name
        value = sig.get(key)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            value = value.item()
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise input_error(where, f"sig[{key!r}]={value!r:.40} is a {type(value).__name__}, not a number; "
                              "pass the dict signatures() returns (numbers)")  # fmt: skip
        out[name] = None if value is None else _finite_or_none(value)
    return out


def _finite_or_none(value: numbers.Real) -> float | None:
    """``float(value)`` when finite; ``None`` for NaN/inf and for an int beyond float's range."""
    try:
        out = float(value)
    except OverflowError:
        return None
    return out if math.isfinite(out) else None


_LINES = {
    "bias": "systematic bias {bias:+.3g} nats/token (95% [{bias_lo:+.3g}, {bias_hi:+.3g}], {bias_share:.0%} of mean "
    "|Δ|) — not rounding{why}",
    "two_sided": " (rounding is symmetric): the sides score different distributions; negative (its mean is -KL) fits "
    "rollout weights lagging the trainer (async rollouts, a skipped weight sync: see mismatch/doctor/gap_growth), "
    "positive a penalty or logit processor only the rollout applies",
    "positive": ": the trainer gives nearly every sampled token more probability than the rollout reports, which "
    "neither sampling noise nor a stale policy can do (their expected Δ is -KL <= 0): the rollout's log-probs include "
    "what the trainer does not apply (a repetition/presence penalty, a logit bias or processor)",
    "filters": ": matches sampling with top_p/top_k while the rollout reports processed log-probs, renormalised over "
    "the kept tokens, so Δ = log(kept mass) <= 0 ({filters} in this run){fix}",
    "negative": ": the rollout's log-probs exceed the trainer's on nearly every token: a truncated sampling "
    "distribution (top_p/top_k/min_p) reported as processed log-probs{temp_too}{fix}",
    "fix": "; fix: sample training rollouts with top_p=1, top_k=-1 (filters belong in rollout.val_kwargs), or "
    "acknowledge the truncated behaviour policy",
    "temperature": "one side is sharper: Δ moves with the token's log-prob (corr {corr_logprob:+.2f}, mean |Δ| "
    "{abs_mean:.3g} nats) — not rounding (rounding leaves the spread of log-probs alone): matches a temperature "
    "applied on one side only{temp_here}: the {sharp} side has the sharper distribution (the lower temperature), or "
    "rollout weights lagging a sharpening policy; fix: one temperature on both sides (verl divides the trainer's "
    "logits by actor_rollout_ref.rollout.temperature, so vLLM must report logprobs_mode=processed_logprobs)",
    "tails": "heavy tails: {share_above_1:.1%} of tokens differ by more than 1 nat ({share_above_0p1:.1%} by more "
    "than 0.1; mean |Δ| {abs_mean:.3g}) — not rounding (rounding moves a log-prob by ~1e-2 nats): the trainer scores "
    "other tokens or another model than the rollout sampled with: a one-token shift or a wrong response_mask, a "
    "re-tokenised multi-turn history{multi}, rollout weights not synced (stale, or load_format=dummy), or MoE "
    "routing flips without routing replay",
    "duplicates": "{dup_rate:.0%} of sequences are identical to another of their group{groups} — not numerics: a "
    "fixed per-request sampling seed or greedy decoding (temperature=0, do_sample=False) repeats the group's samples; "
    "give each sample its own seed (ignore this when answers are legitimately short and repeat)",
    "growth": "the gap grows: mean |Δ| rises {gap_growth:+.3g} nats/token per step (95% [{gap_growth_lo:+.3g}, "
    "{gap_growth_hi:+.3g}], {gap_growth_rel:+.0%} over the window) — rounding at a fixed model state does not grow: "
    "rollout weights lag the trainer (async or partial rollouts, a failed or skipped weight sync); if the policy "
    "sharpens fast, compare a step at learning rate 0",
}


_CONTEXT_NUMBERS = {"top_p": (0.0, 1.0), "top_k": (-1.0, None), "temperature": (0.0, None)}
"""The context's numeric settings and their ranges (top_k: -1 or 0 is off)."""


def check_context(where: str, context: Any) -> dict[str, Any]:
    """``context`` as a dict with numbers for ``top_p``/``top_k``/``temperature`` and a bool ``multi_turn``.

    As documented (and as ``doctor_context`` builds it) the settings are numbers: a str such as ``"0.8"`` is
    refused, not read, so a setting is never ignored silently. ``None`` (or a key left out) is the default; other
    keys (``rollout``, ``logprobs_mode``, ...) pass through.
    """
    if context is None:
        return {}
    eg = ' of sampling settings, e.g. {"top_p": 0.8, "temperature": 1.0}'
    ctx = dict(check_mapping(where, "context", context, hint=eg))
    for key, (low, high) in _CONTEXT_NUMBERS.items():
        if ctx.get(key) is not None:
            ctx[key] = check_number(
                where, f"context[{key!r}]", ctx[key], low=low, high=high, hint=f" ({eg[4:]})"
            )
    if ctx.get("top_k") is not None and not float(ctx["top_k"]).is_integer():
        raise input_error(
            where, f"context['top_k']={ctx['top_k']!r} is not a whole number; give e.g. 20 (-1: off)"
        )
    if ctx.get("multi_turn") is not None:
        ctx["multi_turn"] = check_bool(where, "context['multi_turn']", ctx["multi_turn"])
    return ctx


def _context_words(context: dict[str, Any]) -> dict[str, str]:
    """The run-specific fragments of the lines: active filters, a temperature other than 1, multi-turn."""
    num = {k: v for k, v in context.items() if k in _CONTEXT_NUMBERS and v is not None}
    top_p, top_k, temp = num.get("top_p", 1), num.get("top_k", -1), num.get("temperature", 1)
    filters = ", ".join([f"top_p={top_p:g}"] * (top_p < 1) + [f"top_k={top_k:g}"] * (top_k > 0))
    return {
        "filters": filters,
        "fix": _LINES["fix"],
        "temp_too": f", or temperature={temp:g} applied on the rollout's side only" if temp != 1 else "",
        "temp_here": f" (temperature={temp:g} in this run)" if temp != 1 else " (or a logit scale/soft-cap)",
        "multi": " (multi-turn is on in this run)" if context.get("multi_turn") else "",
    }


def findings(sig: dict[str, float], context: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """``(cause, line)`` per cause ``sig`` shows; cause is bias, temperature, tails, duplicates or growth.

    Raises :class:`~rlalign_verl.base.errors.MetricsInputError` on a ``sig`` that is not a mapping of numbers and on a bad ``context``
    (:func:`check_context`)."""
    return judge(sig_values("doctor.findings", sig), check_context("doctor.findings", context))


def judge(v: dict[str, float | None], context: dict[str, Any]) -> list[tuple[str, str]]:
    """:func:`findings` on checked values (:func:`sig_values`) and a checked context."""
    s = {k: 0.0 if x is None else x for k, x in v.items()}
    words, out = _context_words(context), []
    interval = v["bias_lo"] is not None and v["bias_hi"] is not None
    if s["num_tokens"] >= MIN_TOKENS and enough_units(int(s["num_seqs"])) and s["abs_mean"] > 0:
        biased = interval and (s["bias_lo"] > 0 or s["bias_hi"] < 0) and abs(s["bias"]) >= BIAS_FLOOR
        biased = biased and s["bias_share"] >= BIAS_SHARE
        one_sided = biased and s["bias_share"] >= ONE_SIDED_SHARE
        scaled = not one_sided and abs(s["corr_logprob"]) >= SCALE_CORR and s["abs_mean"] >= BIAS_FLOOR
        if one_sided or (biased and not scaled):
            why = "positive" if s["bias"] > 0 else ("filters" if words["filters"] else "negative")
            why = _LINES[why if one_sided else "two_sided"].format(**words)
            out.append(("bias", _LINES["bias"].format(why=why, **s)))
        elif scaled:
            sharp = "trainer's" if s["corr_logprob"] > 0 else "rollout's"
            out.append(("temperature", _LINES["temperature"].format(sharp=sharp, **words, **s)))
        if s["share_above_1"] >= HEAVY_SHARE and not (one_sided or scaled):
            out.append(
                ("tails", _LINES["tails"].format(**words, **s))
            )  # an offset/temperature explains its tails
    if s["dup_rate"] >= DUP_SHARE:
        g = v["dup_groups"]
        groups = (
            "" if g is None else f" ({g:.0%} of groups entirely identical: zero GRPO advantage, no gradient)"
        )
        out.append(("duplicates", _LINES["duplicates"].format(groups=groups, **s)))
    if v["gap_growth_lo"] is not None and s["gap_growth_lo"] > 0 and s["gap_growth_rel"] >= GROWTH_REL:
        out.append(("growth", _LINES["growth"].format(**s)))
    return out


def diagnose_signature(sig: dict[str, float], *, context: dict[str, Any] | None = None) -> list[str]:
    """Plain-language lines, one per cause in ``sig`` that is not rounding; ``[]`` for a rounding signature.

    ``context``: the run's sampling settings, e.g. ``{"top_p": 0.8, "top_k": -1, "temperature": 1.0,
    "multi_turn": False}`` (``rlalign_verl.verl.doctor_config.doctor_context``), used to name the likely cause.
    Raises :class:`~rlalign_verl.base.errors.MetricsInputError` as :func:`findings` does.
    """
    where = "doctor.diagnose_signature"
    return [line for _, line in judge(sig_values(where, sig), check_context(where, context))]
