"""Is it rounding or a bug? Per-step signatures of the train-vs-rollout gap, and verdicts that name the cause.

With ``Δ = logp_train - logp_rollout`` per valid response token, :func:`signatures` returns
``mismatch/doctor/<name>``:

- ``bias`` (+ ``bias_lo``/``bias_hi``, 95% bootstrap over sequences; the interval only from
  :data:`~rlalign_verl.measure.intervals.MIN_UNITS` sequences on): mean signed Δ, nats per token;
- ``abs_mean``: mean |Δ|; ``bias_share``: ``|bias| / abs_mean`` (rounding: near 0; a one-sided offset: 1);
- ``share_above_0p1`` / ``share_above_1``: share of tokens with |Δ| above 0.1 / 1 nat; ``exact_share``: Δ == 0;
- ``pos_share``: share of Δ > 0 among nonzero Δ (rounding: about 0.5);
- ``corr_prob``: Pearson correlation of Δ with the rollout probability ``exp(logp_rollout)``;
  ``abs_corr_prob``: of |Δ| with it (rounding: |Δ| larger where the distribution is flat); ``corr_logprob``:
  of Δ with the mean log-prob ``(logp_train + logp_rollout) / 2``, i.e. ``(Var train - Var rollout)``
  normalised: one side sharper than the other (a temperature), 0 for rounding and for a shifted token;
  each absent when one side is constant;
- ``dup_rate`` / ``dup_groups`` (given ``uid`` and ``responses``): share of sequences identical to another of
  their group, share of groups (of 2 or more) whose sequences are all identical;
- ``num_tokens``, ``num_seqs``, ``nonfinite_tokens``: the sample (only these when no token is valid).

:class:`GapTrend` adds ``gap_growth`` (+ ``_lo``/``_hi``, ``gap_growth_rel``); :func:`diagnose_signature` turns a
signature into plain-language lines, one per cause that is *not* rounding; :class:`Doctor` does both per step and
adds the multi-turn and token-identity checks of :mod:`rlalign_verl.measure.turns`.
Precision: every sum runs in float64 (float32 on MPS, which has no float64), over row chunks so that memory
stays bounded for ``[4096, 8192]`` batches; the raw moments behind a correlation lose about
``log10(mean^2 / var)`` of float64's 16 digits, and a variance below 1e-12 of the second moment counts as 0.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlalign_verl.base.errors import MetricsInputError
from rlalign_verl.measure.doctor_trend import MIN_POINTS, PREFIX, GapTrend
from rlalign_verl.measure.doctor_verdicts import (
    BIAS_FLOOR,
    BIAS_SHARE,
    DUP_SHARE,
    GROWTH_REL,
    HEAVY_SHARE,
    MIN_SEQS,
    MIN_TOKENS,
    ONE_SIDED_SHARE,
    SCALE_CORR,
    check_context,
    diagnose_signature,
    findings,
    judge,
    sig_values,
)
from rlalign_verl.measure.intervals import check_n_boot, check_seed, enough_units, ratio_interval
from rlalign_verl.measure.tensor_inputs import (
    check_ids,
    check_int,
    check_log_probs,
    check_step,
    check_str,
)
from rlalign_verl.measure.turns import round_findings, round_metrics, unexplained_mask

__all__ = ["PREFIX", "signatures", "findings", "diagnose_signature", "check_context", "GapTrend", "Doctor",
           # the verdict thresholds (rlalign_verl.measure.doctor_verdicts), importable from here as before
           "MIN_TOKENS", "MIN_SEQS", "BIAS_FLOOR", "BIAS_SHARE", "ONE_SIDED_SHARE", "SCALE_CORR", "HEAVY_SHARE",
           "DUP_SHARE", "GROWTH_REL"]  # fmt: skip

N_BOOT = 1000
LEVEL = 0.95
CHUNK_ELEMENTS = 1 << 22
"""Tokens per chunk of rows: bounds the float64 temporaries (about 32 MiB each)."""

WHERE = "doctor.signatures"


def _fail(msg: str) -> MetricsInputError:
    return MetricsInputError(f"{WHERE}: {msg}")


def _check_groups(uid: Any, responses: Any, shape: tuple[int, ...]) -> None:
    """The duplicate-rate inputs: ``uid`` and ``responses`` together, one group id per row, token ids."""
    if (uid is None) != (responses is None):
        raise _fail("give uid and responses together (the group-duplicate rate needs both), or neither")
    if responses is None:
        return
    check_ids(WHERE, "responses", responses, shape, hint=" (batch['responses'])")
    if isinstance(uid, str | bytes) or not hasattr(uid, "__len__") or len(uid) != shape[0]:
        n = len(uid) if hasattr(uid, "__len__") else type(uid).__name__
        raise _fail(
            f"uid must hold one group id per sequence ({shape[0]}), got {n}; pass non_tensor_batch['uid']"
        )


def _moments(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype):
    """One pass over row chunks: per-sequence (count, sum Δ), global sums and the nonfinite count."""
    rows = max(1, CHUNK_ELEMENTS // train.shape[1])
    bound = torch.finfo(dtype).max ** 0.25  # |Δ| <= bound keeps every sum of squares finite
    n_seq, s_seq, totals = [], [], None
    for r0 in range(0, train.shape[0], rows):
        t, r = train[r0 : r0 + rows].to(dtype), rollout[r0 : r0 + rows].to(dtype)
        m = mask[r0 : r0 + rows] != 0
        v = m & torch.isfinite(t) & torch.isfinite(r)
        d = torch.where(v, t - r, 0.0).clamp(-bound, bound)
        mid = torch.where(v, (t + r) / 2, 0.0).clamp(-bound, bound)
        p = torch.where(v, r.clamp(max=0.0).exp(), 0.0)
        a = d.abs()
        n_seq.append(v.to(dtype).sum(1))
        s_seq.append(d.sum(1))
        sums = torch.stack([(m & ~v).sum().to(dtype), a.sum(), (a > 0.1).sum().to(dtype), (a > 1.0).sum().to(dtype),
                            (d > 0).sum().to(dtype), (d != 0).sum().to(dtype), (d * d).sum(), p.sum(), (p * p).sum(),
                            (d * p).sum(), mid.sum(), (mid * mid).sum(), (d * mid).sum(), (a * p).sum()])  # fmt: skip
        totals = sums if totals is None else totals + sums
    return torch.cat(n_seq), torch.cat(s_seq), totals


def _corr(sxy: float, sx: float, sy: float, sxx: float, syy: float, n: float) -> float | None:
    cov = sxy / n - (sx / n) * (sy / n)
    vx, vy = sxx / n - (sx / n) ** 2, syy / n - (sy / n) ** 2
    if vx <= 1e-12 * sxx / n or vy <= 1e-12 * syy / n:
        return None  # constant (within float64) on one side: no correlation to speak of
    return max(-1.0, min(1.0, cov / math.sqrt(vx * vy)))


def _duplicates(uid: Any, responses: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Rows equal to another row of their group: a two-word hash buckets them, an exact comparison confirms."""
    index: dict[Any, int] = {}
    keys = [u.item() if hasattr(u, "item") else u for u in uid]  # numpy/torch scalars -> hashable
    groups = torch.tensor([index.setdefault(k, len(index)) for k in keys], device=responses.device)
    has = (mask != 0).any(1)
    ids, groups = responses.long().masked_fill(mask == 0, -1)[has], groups[has]
    if ids.shape[0] == 0:
        return {}
    weights = torch.randint(-(2**62), 2**62, (2, ids.shape[1]), generator=torch.Generator().manual_seed(0))
    rows = max(1, CHUNK_ELEMENTS // ids.shape[1])
    # int64 products and sums wrap modulo 2**64: two independent linear hashes of each row
    h = torch.cat([torch.stack([(c * w).sum(1) for w in weights.to(ids.device)], 1) for c in ids.split(rows)])
    _, bucket, count = torch.unique(
        torch.cat([groups[:, None], h], 1), dim=0, return_inverse=True, return_counts=True
    )
    own = torch.arange(ids.shape[0], device=ids.device)
    rep = torch.full_like(count, ids.shape[0]).scatter_reduce(0, bucket, own, "amin")[
        bucket
    ]  # bucket's first row
    same = torch.cat([(c == ids[r]).all(1) for c, r in zip(ids.split(rows), rep.split(rows), strict=True)])
    dup = same & (rep != own)  # equal to its bucket's first row: a hash collision fails this exact test
    dup = dup.index_fill(0, rep[dup], True)  # and that first row is a duplicate too
    size = torch.bincount(groups, minlength=len(index))
    distinct = torch.bincount(groups[~dup | (rep == own)], minlength=len(index))
    out = {"dup_rate": float(dup.double().mean())}
    if bool((size >= 2).any()):
        out["dup_groups"] = float((distinct[size >= 2] == 1).double().mean())
    return out


def signatures(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    uid: Any = None,
    responses: torch.Tensor | None = None,
    seed: int = 0,
    n_boot: int = N_BOOT,
    prefix: str = PREFIX,
) -> dict[str, float]:
    """The ``mismatch/doctor/*`` signature of one step (see the module docstring); finite floats only.

    ``uid`` (one GRPO group id per sequence, e.g. ``batch.non_tensor_batch['uid']``) and ``responses`` (the
    ``[B, T]`` token ids) add the duplicate rates. Raises :class:`MetricsInputError` on malformed inputs
    (:func:`~rlalign_verl.measure.tensor_inputs.check_log_probs`), and on a ``seed`` that is not an int, an
    ``n_boot`` under 100 (:func:`~rlalign_verl.measure.intervals.min_draws` at 95%) or a ``prefix`` that is not a str.
    """
    seed = check_seed(WHERE, seed)
    n_boot = check_n_boot(WHERE, n_boot, LEVEL, default=N_BOOT)
    prefix = check_str(WHERE, "prefix", prefix, hint=f" (default {PREFIX!r})")
    logp = {"old_log_probs": old_log_probs, "rollout_log_probs": rollout_log_probs}
    check_log_probs(WHERE, logp, "response_mask", response_mask)
    return _signatures(old_log_probs, rollout_log_probs, response_mask, uid, responses, seed, n_boot, prefix)


def _signatures(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    uid: Any,
    responses: torch.Tensor | None,
    seed: int,
    n_boot: int,
    prefix: str,
) -> dict[str, float]:
    """:func:`signatures` on inputs that passed its checks (the tensors, ``seed``, ``n_boot`` and ``prefix``)."""
    _check_groups(uid, responses, tuple(old_log_probs.shape))
    device = old_log_probs.device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    train, rollout = old_log_probs.detach(), rollout_log_probs.detach().to(device)
    mask = response_mask.detach().to(device)
    if train.numel() == 0:
        return {f"{prefix}{k}": 0.0 for k in ("num_tokens", "num_seqs", "nonfinite_tokens")}
    n_seq, s_seq, totals = _moments(train, rollout, mask, dtype)
    nonfinite, sa, n01, n1, npos, nz, sdd, sp, spp, sdp, sm, smm, sdm, sap = totals.tolist()  # one transfer
    keep = n_seq > 0
    n_tok, n_seqs = float(n_seq.sum()), int(keep.sum())
    out = {"num_tokens": n_tok, "num_seqs": float(n_seqs), "nonfinite_tokens": nonfinite}
    if n_tok == 0:
        return {prefix + k: float(v) for k, v in out.items()}
    sd = float(s_seq.sum())
    bias, abs_mean = sd / n_tok, sa / n_tok
    out["bias"] = bias
    if enough_units(n_seqs):  # fewer sequences carry no interval: its keys are left out, nothing is separated
        out["bias_lo"], out["bias_hi"] = ratio_interval(
            s_seq[keep], n_seq[keep], seed=seed, n_boot=n_boot, level=LEVEL
        )
    out.update(abs_mean=abs_mean, share_above_0p1=n01 / n_tok, share_above_1=n1 / n_tok,
               exact_share=1.0 - nz / n_tok)  # fmt: skip
    out["bias_share"] = abs(bias) / abs_mean if abs_mean > 0 else 0.0
    if nz > 0:
        out["pos_share"] = npos / nz
    corrs = {"corr_prob": _corr(sdp, sd, sp, sdd, spp, n_tok), "corr_logprob": _corr(sdm, sd, sm, sdd, smm, n_tok),
             "abs_corr_prob": _corr(sap, sa, sp, sdd, spp, n_tok)}  # fmt: skip
    out.update({k: v for k, v in corrs.items() if v is not None})
    if responses is not None:
        out.update(_duplicates(uid, responses.detach().to(device), mask))
    return {prefix + k: float(v) for k, v in out.items() if math.isfinite(v)}


_SHAPE_CAUSES = ("bias", "temperature", "tails")
"""Causes read from the shape of Δ, which tokens with other ids or another history distort."""


class Doctor:
    """Per-step signature, gap trend and verdict lines; a cause is said again only every ``repeat_every`` steps."""

    def __init__(
        self, context: dict[str, Any] | None = None, *, window: int = 20, repeat_every: int = 50
    ) -> None:
        """``context``: the run's sampling settings (:func:`check_context`); ``window``: steps of the gap trend
        (an int >= :data:`~rlalign_verl.measure.doctor_trend.MIN_POINTS`); ``repeat_every``: an int >= 1."""
        self.context = check_context("Doctor", context)
        window = check_int("Doctor", "window", window, minimum=MIN_POINTS,
                           hint=f": the gap trend fits its slope over at least {MIN_POINTS} steps (default 20)")  # fmt: skip
        self.repeat_every = check_int("Doctor", "repeat_every", repeat_every, minimum=1,
                                      hint=": steps before a cause is said again (default 50)")  # fmt: skip
        self.trend = GapTrend(window=window)
        self.said: dict[str, int] = {}

    def step(
        self,
        step: int,
        old_log_probs: torch.Tensor,
        rollout_log_probs: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        uid: Any = None,
        responses: torch.Tensor | None = None,
        trainer_ids: torch.Tensor | None = None,
        rollout_ids: torch.Tensor | None = None,
    ) -> tuple[dict[str, float], list[str]]:
        """``mismatch/doctor/*`` (``findings``: how many causes), per-round ``mismatch/round_{k}/*`` of a multi-turn
        batch (:mod:`rlalign_verl.measure.turns`), and the verdict lines due for logging now.

        ``trainer_ids``/``rollout_ids``: the ``[B, T]`` ids the trainer scored at the response positions and the ids
        the rollout sampled, for ``mismatch/doctor/token_id_mismatch``. ``step``: an int (it seeds the bootstrap).
        Raises :class:`MetricsInputError` on malformed inputs (:mod:`rlalign_verl.measure.tensor_inputs`).
        """
        step = check_seed("Doctor.step", check_step("Doctor.step", step), name="step")
        logp = {"old_log_probs": old_log_probs, "rollout_log_probs": rollout_log_probs}
        check_log_probs("Doctor.step", logp, "response_mask", response_mask)  # once, for every part below
        sig = _signatures(
            old_log_probs, rollout_log_probs, response_mask, uid, responses, step, N_BOOT, PREFIX
        )
        if PREFIX + "abs_mean" in sig:
            sig.update(self.trend.update(step, sig[PREFIX + "abs_mean"]))
        sig.update(round_metrics(old_log_probs, rollout_log_probs, response_mask, trainer_ids=trainer_ids,
                                 rollout_ids=rollout_ids, inputs_checked=True, where="Doctor.step"))  # fmt: skip
        by_round = round_findings(sig)
        found = judge(sig_values("Doctor.step", sig), self.context)
        if (
            by_round
        ):  # other ids or another history explain their tokens: the rest of the batch is judged alone
            rest = unexplained_mask(response_mask, [c for c, _ in by_round], trainer_ids, rollout_ids)
            alone = _signatures(old_log_probs, rollout_log_probs, rest, None, None, step, N_BOOT, PREFIX)
            alone = judge(sig_values("Doctor.step", alone), self.context)
            found = [f for f in found if f[0] not in _SHAPE_CAUSES] + [
                f for f in alone if f[0] in _SHAPE_CAUSES
            ]
        found += by_round
        sig[PREFIX + "findings"] = float(len(found))
        lines = []
        for cause, line in found:
            last = self.said.get(cause)
            if last is None or not 0 <= step - last < self.repeat_every:
                self.said[cause] = step
                lines.append(f"step {step}: {line}")
        return sig, lines
