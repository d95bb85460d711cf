"""In-run verification: is the aligned trainer closer to the user's rollout engine than the unaligned one?

At a verify step the actor recomputes the same sequences twice — aligned (the run's setting) and with alignment
switched off — and both are compared with the rollout engine's log-probs of the sampled tokens. The comparison
is *paired* (same tokens, same micro-batching), per token ``|Δ_unaligned| - |Δ_aligned|``, with a bootstrap over
sequences (tokens of one response are not independent):

- ``mismatch/verify/aligned`` / ``unaligned``: mean |Δlogp| (nats per token) of each pass against the rollout;
- ``aligned_exact`` / ``unaligned_exact``: the share of tokens with Δlogp exactly 0;
- ``paired_diff`` (+ ``_lo``/``_hi``, 95%): mean of ``|Δ_unaligned| - |Δ_aligned|`` (> 0: alignment helps);
- ``gain`` (+ ``_lo``/``_hi``, 95%): ``unaligned / aligned`` (capped at :data:`GAIN_CAP` when aligned is 0);
- ``verdict``: +1 better, 0 within noise, -1 worse — decided on the :data:`DECISION_LEVEL` interval of the
  paired difference, not the 95% one, so that a verdict that stops a run is not a 1-in-40 accident;
- ``num_seqs`` / ``num_tokens``: the sample.

Fewer than :data:`~rlalign_verl.measure.intervals.MIN_UNITS` sequences with a valid token carry no interval (the
doctor's rule, :mod:`rlalign_verl.measure.intervals`): the intervals are ``None`` (their keys left out), the verdict
is 0 and the line says the sample is too small, so one sequence can never stop a run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.measure.intervals import (
    MIN_UNITS,
    check_n_boot,
    check_seed,
    enough_units,
    percentile_interval,
    resampled_sums,
)
from rlalign_verl.measure.tensor_inputs import (
    check_log_probs,
    check_mapping,
    check_step,
    check_str,
    input_error,
)
from rlalign_verl.request.regions import ladder_rungs as rungs_of

PREFIX = "mismatch/verify/"
REPORT_LEVEL = 0.95
DECISION_LEVEL = 0.999
"""Two-sided level of the interval a verdict is decided on."""
N_BOOT = 5000
"""Draws: the fewest a :data:`DECISION_LEVEL` interval can be read from
(:func:`~rlalign_verl.measure.intervals.min_draws`)."""
GAIN_CAP = 1e6
"""``gain`` when the aligned gap is exactly 0 and the unaligned one is not."""
VERDICT_WORDS = {1: "better", 0: "within noise", -1: "WORSE"}


class VerifyFailedError(AlignmentError):
    """Alignment made the trainer measurably farther from the rollout engine than no alignment."""


@dataclass(frozen=True)
class VerifyResult:
    """One verify step's comparison (see the module docstring for each field)."""

    aligned: float
    unaligned: float
    aligned_exact: float
    unaligned_exact: float
    paired_diff: float
    paired_diff_ci: tuple[float, float] | None
    """``None`` (as ``decision_ci`` and ``gain_ci``): fewer sequences than an interval needs."""
    decision_ci: tuple[float, float] | None
    gain: float
    gain_ci: tuple[float, float] | None
    verdict: int
    num_seqs: int
    num_tokens: int

    def metrics(self) -> dict[str, float]:
        """The ``mismatch/verify/*`` keys, finite floats (no ``_lo``/``_hi`` without an interval)."""
        no = (math.nan, math.nan)
        out = {
            "aligned": self.aligned,
            "unaligned": self.unaligned,
            "aligned_exact": self.aligned_exact,
            "unaligned_exact": self.unaligned_exact,
            "paired_diff": self.paired_diff,
            "paired_diff_lo": (self.paired_diff_ci or no)[0],
            "paired_diff_hi": (self.paired_diff_ci or no)[1],
            "gain": self.gain,
            "gain_lo": (self.gain_ci or no)[0],
            "gain_hi": (self.gain_ci or no)[1],
            "verdict": float(self.verdict),
            "num_seqs": float(self.num_seqs),
            "num_tokens": float(self.num_tokens),
        }
        return finite({PREFIX + k: float(v) for k, v in out.items()})

    def line(self, step: int, profile: str) -> str:
        """One readable log line."""
        step, profile = (
            check_step("VerifyResult.line", step),
            check_str("VerifyResult.line", "profile", profile),
        )
        what = {
            1: f"profile {profile} brings the trainer closer to this engine",
            0: "no difference outside the noise (the engine may already round like the trainer, or these regions "
            "do not matter for this model)",
            -1: f"profile {profile} moves the trainer AWAY from this engine",
        }[self.verdict]
        if self.gain_ci is None:
            bracket, rule = (
                "with no interval",
                f"too few sequences to separate: a verdict needs >= {MIN_UNITS}",
            )
            what = f"{self.num_seqs} sequence(s) cannot tell alignment from noise; verify more sequences"
        else:
            lo, hi = self.gain_ci
            bracket = f"[{_fmt_gain(lo)}, {_fmt_gain(hi)}]"
            rule = f"verdicts use the {DECISION_LEVEL:.1%} interval, the bracket is 95%"
        return (
            f"verify step {step}: mean |Δlogp| aligned {self.aligned:.4g} vs unaligned {self.unaligned:.4g} nats/token, "
            f"gain {_fmt_gain(self.gain)}x {bracket} ({self.num_seqs} seqs, {self.num_tokens} tokens; exact "
            f"{self.aligned_exact:.1%} vs {self.unaligned_exact:.1%}): {VERDICT_WORDS[self.verdict]} ({rule}) — {what}"
        )


def _fmt_gain(g: float) -> str:
    return f"{g:.3g}" if g < GAIN_CAP else f">{GAIN_CAP:.0e}"


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` with x/0 -> :data:`GAIN_CAP` (x > 0) or 1 (0/0: both exactly equal to the rollout)."""
    out = torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, GAIN_CAP, 1.0))
    return out.clamp(max=GAIN_CAP)


def compare(
    aligned: torch.Tensor,
    unaligned: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    *,
    seed: int = 0,
    n_boot: int = N_BOOT,
) -> VerifyResult:
    """Paired comparison of two ``[B, T]`` trainer log-prob passes with the rollout's, over ``mask`` tokens.

    Tokens where any of the three is not finite are left out; with fewer than
    :data:`~rlalign_verl.measure.intervals.MIN_UNITS` sequences left there is no interval and the verdict is 0.
    ``seed``: an int; ``n_boot``: an int of at least ``min_draws(DECISION_LEVEL)`` (5000, the default). Raises
    :class:`~rlalign_verl.base.errors.MetricsInputError` (a ``ValueError``) on malformed inputs
    (:func:`~rlalign_verl.measure.tensor_inputs.check_log_probs`), a bad ``seed``/``n_boot`` and when no valid token
    is left.
    """
    where = "verify.compare"
    seed = check_seed(where, seed)
    n_boot = check_n_boot(where, n_boot, DECISION_LEVEL, default=N_BOOT)
    logp = {"aligned": aligned, "unaligned": unaligned, "rollout": rollout}
    check_log_probs(where, logp, "mask", mask)
    a, u, r = (t.detach().to("cpu", torch.float64) for t in (aligned, unaligned, rollout))
    valid = (mask.detach().to("cpu") > 0) & torch.isfinite(a) & torch.isfinite(u) & torch.isfinite(r)
    d_a = torch.where(valid, (a - r).abs(), 0.0)
    d_u = torch.where(valid, (u - r).abs(), 0.0)
    counts = valid.sum(1).double()
    keep = counts > 0
    if not bool(keep.any()):
        raise input_error(
            where,
            "no valid response token (mask empty or every log-prob non-finite); "
            "pass the step's response_mask and log-probs of at least one response token",
        )
    s_a, s_u, n = d_a.sum(1)[keep], d_u.sum(1)[keep], counts[keep]
    tokens = n.sum()
    exact_a = ((d_a == 0) & valid).sum() / tokens
    exact_u = ((d_u == 0) & valid).sum() / tokens

    diff = float((s_u.sum() - s_a.sum()) / tokens)
    diff_ci = decision = gain_ci = None
    verdict = 0
    if enough_units(int(n.numel())):
        su_b, sa_b, nb = resampled_sums(torch.stack([s_u, s_a, n]), seed=seed, n_boot=n_boot)
        diff_b = (su_b - sa_b) / nb
        diff_ci = percentile_interval(diff_b, REPORT_LEVEL)
        gain_ci = percentile_interval(_ratio(su_b, sa_b), REPORT_LEVEL)
        decision = percentile_interval(diff_b, DECISION_LEVEL)
        verdict = 1 if decision[0] > 0 else (-1 if decision[1] < 0 else 0)
    return VerifyResult(
        aligned=float(s_a.sum() / tokens),
        unaligned=float(s_u.sum() / tokens),
        aligned_exact=float(exact_a),
        unaligned_exact=float(exact_u),
        paired_diff=diff,
        paired_diff_ci=diff_ci,
        decision_ci=decision,
        gain=float(_ratio(s_u.sum(), s_a.sum())),
        gain_ci=gain_ci,
        verdict=verdict,
        num_seqs=int(n.numel()),
        num_tokens=int(tokens),
    )


def ladder_metrics(
    passes: dict[str, torch.Tensor], rollout: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """``mismatch/verify/ladder/<rung>``: mean |Δlogp| of each rung's pass (same sequences) against the rollout.

    Tokens where the pass or the rollout is not finite are left out (as in :func:`compare`). Raises
    :class:`~rlalign_verl.base.errors.MetricsInputError` on malformed inputs
    (:func:`~rlalign_verl.measure.tensor_inputs.check_log_probs`).
    """
    where = "verify.ladder_metrics"
    check_mapping(where, "passes", passes, hint=" rung -> [B, T] log-probs")
    for rung in passes:
        check_str(where, "a rung name of passes", rung, hint=" (a metric key: 'none', 'rope', 'all', ...)")
    logp = {**{f"passes[{rung!r}]": lp for rung, lp in passes.items()}, "rollout": rollout}
    check_log_probs(where, logp, "mask", mask)
    valid = (mask > 0) & torch.isfinite(rollout)
    out = {}
    for rung, lp in passes.items():
        ok = valid & torch.isfinite(lp)
        total = ok.sum()
        if total > 0:
            # where, not "* ok": a NaN/inf left out (in padding or on a response token) times 0 would be NaN
            gap = torch.where(ok, (lp.double() - rollout.double()).abs(), 0.0).sum() / total
            out[f"{PREFIX}ladder/{rung}"] = float(gap)
    return out


def ladder_rungs(spec) -> list[str]:
    """The rungs to recompute for ``spec`` (:func:`rlalign_verl.request.regions.ladder_rungs`)."""
    return rungs_of(spec.regions, spec.rollout_tp)


def finite(metrics: dict[str, float]) -> dict[str, float]:
    """Only the finite entries (a metrics problem must never reach a tracking backend as NaN)."""
    return {k: v for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v)}
