"""Train-vs-rollout log-prob mismatch metrics (pure PyTorch, vectorised, any device).

``compute_mismatch_metrics`` compares the training side's log-probs of the sampled tokens (verl's
``old_log_probs``) with the inference engine's (``rollout_log_probs``) on the valid response tokens and
returns a flat ``{"mismatch/<name>": number}`` dict. With ``d = logp_train - logp_rollout`` (the log of
the importance ratio ``r = pi_train / pi_rollout``) the keys are:

- ``logp_abs_diff_mean``, ``logp_abs_diff_max``, ``logp_abs_diff_p50/p90/p99``: ``|d|`` in nats;
- ``kl_k1`` = mean(-d), ``kl_k2`` = mean(d^2 / 2), ``kl_k3`` = mean(r - 1 - d): estimators of
  KL(pi_rollout || pi_train) from the sampled tokens (nats per token);
- ``prob_abs_diff_mean``, ``prob_abs_diff_max``: ``|exp(logp_train) - exp(logp_rollout)|``;
- ``ratio_mean``, ``ratio_min``, ``ratio_max``: ``r`` per token; ``ratio_clip_frac``: fraction of tokens
  with ``r`` outside the PPO clip range ``[1 - eps_low, 1 + eps_high]``;
- ``seq_log_ratio_abs_mean``, ``seq_log_ratio_abs_max``: ``|sum_t d_t|`` per sequence (the absolute
  sequence-level log importance ratio), over sequences with at least one valid token;
- ``num_tokens`` (valid tokens used), ``num_seqs`` (sequences with a valid token), ``nonfinite_tokens``
  (tokens inside the mask whose log-prob is NaN/inf in either input: excluded, counted).

Empty input (no valid token): only the three counts are returned (all statistics absent, no NaN).
Every value is finite: a per-token log-ratio beyond ``finfo(work dtype).max ** 0.25`` nats (about 1e77 in
float64; only garbage inputs such as -1e200 log-probs reach it) is clamped there, so ``d^2`` sums cannot
overflow. Inputs refused by :func:`rlalign_verl.measure.tensor_inputs.check_log_probs` (not tensors of one 2-D shape,
integer log-probs, a mask of other values than 0/1, probabilities or other positive values on response tokens),
or a clip range that is not a number, raise :class:`~rlalign_verl.base.errors.MetricsInputError` (a ``ValueError``)
naming the fix.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlalign_verl.base.errors import MetricsInputError
from rlalign_verl.measure.tensor_inputs import (
    MAX_LOG_PROB as MAX_LOG_PROB,  # re-exported: it lived here first
)
from rlalign_verl.measure.tensor_inputs import check_bool, check_log_probs, check_str, input_error

__all__ = ["compute_mismatch_metrics", "sorted_quantiles", "METRIC_NAMES", "COUNT_NAMES"]

#: Statistic names (without prefix), present whenever at least one valid token exists.
METRIC_NAMES: tuple[str, ...] = (
    "logp_abs_diff_mean",
    "logp_abs_diff_max",
    "logp_abs_diff_p50",
    "logp_abs_diff_p90",
    "logp_abs_diff_p99",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "prob_abs_diff_mean",
    "prob_abs_diff_max",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "ratio_clip_frac",
    "seq_log_ratio_abs_mean",
    "seq_log_ratio_abs_max",
)
#: Count names (without prefix), always present.
COUNT_NAMES: tuple[str, ...] = ("num_tokens", "num_seqs", "nonfinite_tokens")

_QUANTILES = (0.5, 0.9, 0.99)
# exp() of a log-ratio beyond this would overflow float64 sums; such tokens are already pathological.
MAX_LOG_RATIO = 300.0


def _work_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> fp32 (exact, and a fast path on CPU); fp32/fp64 unchanged."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _clip_eps(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise MetricsInputError(
            f"compute_mismatch_metrics: {name}={value!r} is not a finite number >= 0; give e.g. {name}=0.2"
        )
    return float(value)


def sorted_quantiles(values: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
    """Quantiles of a 1-D tensor with linear interpolation (same as ``torch.quantile``'s default).

    One sort, no size limit (``torch.quantile`` refuses inputs above 16M elements). ``qs``: numbers in [0, 1].
    """
    where = "sorted_quantiles"
    if not isinstance(values, torch.Tensor) or values.ndim != 1 or values.numel() == 0:
        got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise input_error(where, f"values must be a non-empty 1-D tensor, got {got}; pass e.g. x.reshape(-1)")
    if isinstance(qs, str | bytes) or not isinstance(qs, tuple | list) or not qs:
        raise input_error(
            where, f"qs is a {type(qs).__name__}; give a tuple of quantiles in [0, 1], e.g. (0.5,)"
        )
    for q in qs:
        if isinstance(q, bool) or not isinstance(q, int | float) or not 0 <= q <= 1:
            raise input_error(where, f"quantile {q!r:.40} is not a number in [0, 1]; give e.g. qs=(0.5, 0.9)")
    ordered = torch.sort(values).values
    # Positions in float64: float32 cannot address every index of a >16M-element tensor.
    pos = torch.tensor(qs, dtype=torch.float64, device=ordered.device) * (ordered.numel() - 1)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    frac = (pos - lo.to(torch.float64)).to(ordered.dtype)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * frac


def compute_mismatch_metrics(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    quantiles: bool = True,
    prefix: str = "mismatch/",
) -> dict[str, float]:
    """Mismatch statistics between training and rollout log-probs of the sampled tokens.

    Args:
        train_log_probs: ``[batch, response_len]`` log-probs recomputed by the trainer (any float dtype).
        rollout_log_probs: same shape, log-probs reported by the inference engine.
        response_mask: same shape; 1 marks a response token, 0 the rest (bool, int or float).
        clip_ratio, clip_ratio_low, clip_ratio_high: PPO clip range ``[1 - low, 1 + high]`` for
            ``ratio_clip_frac``; ``low``/``high`` default to ``clip_ratio``.
        quantiles: compute ``logp_abs_diff_p50/p90/p99`` (one sort of the valid tokens).
        prefix: prepended to every key.

    Returns:
        ``{prefix + name: value}``; see the module docstring. Counts are ints, the rest floats; all finite.
        With no valid token only ``num_tokens``, ``num_seqs`` and ``nonfinite_tokens`` are returned.

    Raises:
        MetricsInputError: an input refused by :func:`~rlalign_verl.measure.tensor_inputs.check_log_probs`, a
            clip ratio that is not a finite number >= 0, ``quantiles`` that is not a bool or ``prefix`` not a str.
    """
    quantiles = check_bool("compute_mismatch_metrics", "quantiles", quantiles)
    prefix = check_str("compute_mismatch_metrics", "prefix", prefix, hint=" (default 'mismatch/')")
    check_log_probs(
        "compute_mismatch_metrics",
        {"train_log_probs": train_log_probs, "rollout_log_probs": rollout_log_probs},
        "response_mask",
        response_mask,
    )
    eps = _clip_eps("clip_ratio", clip_ratio)
    eps_low = eps if clip_ratio_low is None else _clip_eps("clip_ratio_low", clip_ratio_low)
    eps_high = eps if clip_ratio_high is None else _clip_eps("clip_ratio_high", clip_ratio_high)

    device = train_log_probs.device
    dtype = _work_dtype(device)
    train = _upcast(train_log_probs.detach())
    rollout = _upcast(rollout_log_probs.detach()).to(device)
    mask = response_mask.detach().to(device) != 0
    if train.numel() == 0:
        return {f"{prefix}num_tokens": 0, f"{prefix}num_seqs": 0, f"{prefix}nonfinite_tokens": 0}

    finite = torch.isfinite(train) & torch.isfinite(rollout)
    valid = mask & finite
    tokens_per_seq = valid.sum(dim=1)
    has_tokens = tokens_per_seq > 0
    counts = torch.stack([tokens_per_seq.sum(), has_tokens.sum(), (mask & ~finite).sum()]).tolist()
    n_tokens, n_seqs, n_nonfinite = (int(c) for c in counts)
    out: dict[str, float] = {
        f"{prefix}num_tokens": n_tokens,
        f"{prefix}num_seqs": n_seqs,
        f"{prefix}nonfinite_tokens": n_nonfinite,
    }
    if n_tokens == 0:
        return out

    # Statistics over the valid tokens only (1-D), so NaN/inf and padding never enter a reduction.
    t = train[valid].to(dtype)
    r = rollout[valid].to(dtype)
    bound = torch.finfo(dtype).max ** 0.25  # |d| <= bound keeps every sum of d^2 finite
    d = (t - r).nan_to_num(posinf=bound, neginf=-bound).clamp(-bound, bound)
    abs_d = d.abs()
    ratio = d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    # a (bad) positive log-prob above MAX_LOG_RATIO would give exp() = inf
    prob_abs = (t.clamp(max=MAX_LOG_RATIO).exp() - r.clamp(max=MAX_LOG_RATIO).exp()).abs()
    clipped = (ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)
    seq_abs = torch.zeros(valid.shape, dtype=dtype, device=device).masked_scatter_(valid, d).sum(dim=1).abs()
    seq_abs = seq_abs[has_tokens]

    stats = [
        abs_d.mean(),
        abs_d.max(),
        -d.mean(),
        0.5 * (d * d).mean(),
        (ratio - 1.0 - d).mean(),
        prob_abs.mean(),
        prob_abs.max(),
        ratio.mean(),
        ratio.min(),
        ratio.max(),
        clipped.to(dtype).mean(),
        seq_abs.mean(),
        seq_abs.max(),
    ]
    values = torch.stack(stats).tolist()  # one device -> host transfer
    names = [n for n in METRIC_NAMES if not n.startswith("logp_abs_diff_p")]
    out.update({f"{prefix}{name}": float(v) for name, v in zip(names, values, strict=True)})
    if quantiles:
        q = sorted_quantiles(abs_d, _QUANTILES).tolist()
        for name, v in zip(("logp_abs_diff_p50", "logp_abs_diff_p90", "logp_abs_diff_p99"), q, strict=True):
            out[f"{prefix}{name}"] = float(v)
    return out


def all_nonfinite_line(metrics: dict[str, float]) -> str | None:
    """The warning for a step whose every response token has a NaN/inf log-prob (only the counts are logged then);
    ``None`` otherwise. Said by each trainer's metrics hook, the same words on verl and OpenRLHF."""
    if metrics.get("mismatch/num_tokens", 0) == 0 and metrics.get("mismatch/nonfinite_tokens", 0) > 0:
        return (
            f"all {int(metrics['mismatch/nonfinite_tokens'])} response tokens of this step have a NaN/inf log-prob "
            "(trainer or rollout); only the counts are logged"
        )
    return None
