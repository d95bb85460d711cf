"""Multi-turn: the train-vs-rollout gap per assistant round, and whether the trainer scores the rollout's tokens.

In a multi-turn rollout (verl's agent loop, OpenRLHF's agent mode) a response holds the assistant's rounds with
the environment's tokens (tool output, user turns) between them; the response mask is 1 on the assistant's
tokens and 0 on the rest (verl: ``response_mask``, "1 for LLM generated tokens, 0 for observation/padding"). So
round ``k`` of a row is its ``k``-th run of 1s, and a single-turn response is one round.

:func:`round_metrics` returns, when some sequence of the batch has two or more rounds:

- ``mismatch/round_{k}/<name>`` for ``k = 1 ..`` :data:`MAX_ROUNDS` (the last also holds every later round):
  the :mod:`rlalign_verl.measure.metrics` statistics in :data:`ROUND_KEYS` over that round's tokens, ``share_above_1``
  (share of its tokens with ``|Δ| > 1`` nat) and, given both id tensors, ``token_id_mismatch``;
- ``mismatch/rounds/per_seq_mean``, ``mismatch/rounds/per_seq_max``: assistant rounds per sequence (uncapped; the
  ``_max`` suffix makes verl's metric merge take the max).

Given the ids the trainer scored at the response positions and the ids the rollout sampled,
``mismatch/doctor/token_id_mismatch`` is the share of masked tokens whose ids differ (single-turn batches too; it
sees ids, not log-probs: log-probs filed one position late next to the right ids show as heavy tails instead).
:func:`round_findings` names what the keys show that is not
rounding: ids that differ, or later rounds with heavy tails behind a first round that has rounding's gap.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from rlalign_verl.measure.metrics import compute_mismatch_metrics
from rlalign_verl.measure.tensor_inputs import (
    check_bool,
    check_ids,
    check_int,
    check_log_probs,
    check_mapping,
    check_mask,
    check_str,
    input_error,
)

__all__ = [
    "MAX_ROUNDS",
    "ROUND_KEYS",
    "CAUSES",
    "check_max_rounds",
    "round_index",
    "round_metrics",
    "round_findings",
    "unexplained_mask",
]

MAX_ROUNDS = 8
ROUND_KEYS: tuple[str, ...] = ("logp_abs_diff_mean", "logp_abs_diff_max", "kl_k1", "kl_k3", "ratio_clip_frac",
                               "num_tokens")  # fmt: skip
"""The per-round subset of ``mismatch/*`` (all of it per round would be ~16 keys times 8 rounds every step)."""

# Verdict thresholds (docs/reading-a-mismatch.md): rounding moves a log-prob by ~1e-2 nats, never by 1 nat
MIN_ROUND_TOKENS = 50
CLEAN_SHARE = 0.01
"""A first round with under 1% of tokens off by more than 1 nat has rounding's gap."""
HEAVY_SHARE = 0.05
"""A later round with 5% or more (and 5 times the first round's share) does not."""


CAUSES = ("token_ids", "rounds")
"""The causes :func:`round_findings` names (and :func:`unexplained_mask` takes)."""


def check_max_rounds(where: str, max_rounds: Any, *, allow_none: bool = False) -> int | None:
    """The one rule for ``max_rounds``: an int >= 2 (the last round holds every later one, so 1 would merge all
    rounds into one and 0 or less would label no round); ``None`` (no cap) only where ``allow_none``."""
    if max_rounds is None and allow_none:
        return None
    hint = f" (default {MAX_ROUNDS}" + ("; None: no cap)" if allow_none else ")")
    return check_int(where, "max_rounds", max_rounds, minimum=2, hint=hint)


def _round_index(on: torch.Tensor, max_rounds: int | None) -> torch.Tensor:
    before = torch.cat([torch.zeros_like(on[:, :1]), on[:, :-1]], dim=1) if on.shape[1] else on
    index = (on & ~before).long().cumsum(dim=1)
    if max_rounds is not None:
        index = index.clamp(max=max_rounds)
    return torch.where(on, index, 0)


def round_index(response_mask: torch.Tensor, max_rounds: int | None = MAX_ROUNDS) -> torch.Tensor:
    """``[B, T]`` int64: ``k`` on the ``k``-th run of 1s of the 0/1 (or bool) mask in its row, 0 off the mask.

    Rounds after ``max_rounds`` (an int >= 2, :func:`check_max_rounds`) count as ``max_rounds`` (``None``: no cap).
    """
    max_rounds = check_max_rounds("rounds.round_index", max_rounds, allow_none=True)
    check_mask("rounds.round_index", "response_mask", response_mask)
    return _round_index(response_mask != 0, max_rounds)


def round_metrics(
    train: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    *,
    trainer_ids: torch.Tensor | None = None,
    rollout_ids: torch.Tensor | None = None,
    max_rounds: int = MAX_ROUNDS,
    prefix: str = "mismatch/",
    inputs_checked: bool = False,
    where: str = "rounds.round_metrics",
) -> dict[str, float]:
    """Per-round ``mismatch/*`` and the token-identity share (module docstring); ``{}`` when neither applies.

    ``train``/``rollout``/``mask``: the ``[B, T]`` tensors of :func:`~rlalign_verl.measure.metrics.compute_mismatch_metrics`;
    ``trainer_ids``/``rollout_ids``: the ``[B, T]`` ids the trainer scored and the rollout sampled (both or neither).
    Raises :class:`~rlalign_verl.base.errors.MetricsInputError` on malformed inputs
    (:func:`~rlalign_verl.measure.tensor_inputs.check_log_probs`), each starting with ``where``. ``inputs_checked``: the
    log-probs and the mask already passed that check (:meth:`~rlalign_verl.measure.doctor.Doctor.step` checks its inputs
    once for the signature and the rounds); the ids are checked here either way.
    """
    where = check_str("rounds.round_metrics", "where", where, hint=" (the caller's name for the messages)")
    max_rounds = check_max_rounds(where, max_rounds)
    prefix = check_str(where, "prefix", prefix, hint=" (default 'mismatch/')")
    if not check_bool(where, "inputs_checked", inputs_checked):
        check_log_probs(where, {"train": train, "rollout": rollout}, "mask", mask)
    if (trainer_ids is None) != (rollout_ids is None):
        raise input_error(
            where, "give trainer_ids and rollout_ids together (the identity check compares them), or neither"
        )
    index = _round_index(mask.detach() != 0, None)
    shape = tuple(index.shape)
    same = None
    if trainer_ids is not None:
        a = check_ids(where, "trainer_ids", trainer_ids, shape).detach()
        same = a == check_ids(where, "rollout_ids", rollout_ids, shape).detach().to(a.device)
    out: dict[str, float] = {}
    valid = index.to(same.device) > 0 if same is not None else None
    if same is not None and bool(valid.any()):
        out[f"{prefix}doctor/token_id_mismatch"] = int((~same & valid).sum()) / int(valid.sum())
    per_seq = index.amax(dim=1) if index.numel() else index.new_zeros(index.shape[0])
    if index.numel() == 0 or int(per_seq.max()) < 2:
        return out
    out[f"{prefix}rounds/per_seq_mean"] = float(per_seq[per_seq > 0].double().mean())
    out[f"{prefix}rounds/per_seq_max"] = float(per_seq.max())
    index = index.clamp(max=max_rounds).to(train.device)
    train, rollout = train.detach(), rollout.detach().to(train.device)
    # |Δ| in float64 (float32 on MPS, which has no float64); NaN/inf tokens fall out of the shares
    dtype = torch.float32 if train.device.type == "mps" else torch.float64
    for k in range(1, min(int(per_seq.max()), max_rounds) + 1):
        in_round = index == k
        name = f"{prefix}round_{k}/"
        # the round's tokens packed into one row: every ROUND_KEYS statistic is per token, and only these tokens
        # are upcast (not the whole [B, T] batch once per round)
        t, r = train[in_round][None], rollout[in_round][None]
        stats = compute_mismatch_metrics(
            t, r, torch.ones_like(t, dtype=torch.bool), quantiles=False, prefix=name
        )
        out.update({name + key: float(stats[name + key]) for key in ROUND_KEYS if name + key in stats})
        delta = (t.to(dtype) - r.to(dtype)).abs()
        counted = torch.isfinite(delta)
        if bool(counted.any()):
            out[name + "share_above_1"] = int(((delta > 1.0) & counted).sum()) / int(counted.sum())
        if same is not None:
            here = in_round.to(same.device)
            out[name + "token_id_mismatch"] = int((~same & here).sum()) / int(here.sum())
    return out


def _rounds_text(rounds: list[int]) -> str:
    return ("round " if len(rounds) == 1 else "rounds ") + ", ".join(map(str, rounds))


def round_findings(metrics: dict[str, float], prefix: str = "mismatch/") -> list[tuple[str, str]]:
    """``(cause, line)`` for what :func:`round_metrics`' keys show that is not rounding: ``token_ids``, ``rounds``.

    Raises :class:`~rlalign_verl.base.errors.MetricsInputError` on ``metrics`` that is not a mapping, a value it
    reads that is not a number, or a ``prefix`` that is not a str."""
    where = "rounds.round_findings"
    check_mapping(where, "metrics", metrics, hint=" of metric keys, as round_metrics() returns")
    prefix = check_str(where, "prefix", prefix, hint=" (default 'mismatch/')")

    def get(key: str) -> float | None:
        value = metrics.get(prefix + key)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            value = value.item()
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise input_error(where, f"metrics[{prefix + key!r}]={value!r:.40} is a {type(value).__name__}, not a "
                              "number; pass the dict round_metrics() returns (numbers)")  # fmt: skip
        return None if value is None or not math.isfinite(float(value)) else float(value)

    out: list[tuple[str, str]] = []
    rounds = range(1, MAX_ROUNDS + 1)
    share = get("doctor/token_id_mismatch")
    if share:
        where = [k for k in rounds if (get(f"round_{k}/token_id_mismatch") or 0.0) > 0]
        at = f" ({_rounds_text(where)})" if where else ""
        share_text = f"{share:.2%}" if share >= 1e-4 else "under 0.01%"
        out.append(("token_ids", f"{share_text} of response tokens{at}: the trainer recomputes log-probs on other "
                    "token ids than the rollout sampled — not numerics: a shifted response or a re-tokenised history "
                    "(text decoded and encoded again, a chat template re-applied to past turns); fix: hand the "
                    "rollout's token ids to the trainer unchanged (token-in-token-out, as verl's agent loop does)"))  # fmt: skip
    first = get("round_1/share_above_1")
    if first is None or first >= CLEAN_SHARE or (get("round_1/num_tokens") or 0) < MIN_ROUND_TOKENS:
        return out
    heavy = [k for k in rounds[1:] if (get(f"round_{k}/num_tokens") or 0) >= MIN_ROUND_TOKENS
             and (s := get(f"round_{k}/share_above_1")) is not None and s >= max(HEAVY_SHARE, 5 * first)]  # fmt: skip
    if heavy:
        worst = max(get(f"round_{k}/share_above_1") or 0.0 for k in heavy)
        out.append(("rounds", f"{_rounds_text(heavy)}: up to {worst:.1%} of tokens differ by more than 1 nat while "
                    f"round 1 has rounding's gap ({first:.1%}) — not numerics: the trainer scores later rounds in "
                    "another history than the engine sampled them in (a re-tokenised multi-turn history, a chat "
                    "template that renders past turns differently, e.g. dropping reasoning); fix: keep the rollout's "
                    "token ids for the whole conversation (verl's own agent loops do: token in, token out)"))  # fmt: skip
    return out


def unexplained_mask(
    mask: torch.Tensor,
    causes: Sequence[str],
    trainer_ids: torch.Tensor | None = None,
    rollout_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The masked tokens that ``causes`` (of :func:`round_findings`) do not explain, as a bool ``[B, T]`` mask.

    ``rounds`` explains every round after the first. ``token_ids`` explains a row from its first differing id on
    (every later token is scored in another context) and every round after the first (the ids of the turns between
    rounds are not compared, so their history may differ unseen). What is left is judged on its own: a top-p bias in
    round 1 is still named when round 2 was re-tokenised. ``causes``: a list of :data:`CAUSES` names; the ids: both
    or neither, ``[B, T]`` like the mask.
    """
    where = "rounds.unexplained_mask"
    keep = check_mask(where, "mask", mask) != 0
    if isinstance(causes, str | bytes) or not isinstance(causes, Sequence):
        raise input_error(where, f"causes is a {type(causes).__name__}; give a list of cause names, e.g. "
                          "['rounds'] (the causes of round_findings)")  # fmt: skip
    unknown = [c for c in causes if c not in CAUSES]
    if unknown:
        raise input_error(where, f"unknown cause(s) {unknown!r:.60}; give names among {list(CAUSES)}")
    if (trainer_ids is None) != (rollout_ids is None):
        raise input_error(where, "give trainer_ids and rollout_ids together (the first differing id is where a row "
                          "stops being explained), or neither")  # fmt: skip
    if trainer_ids is not None:
        check_ids(where, "trainer_ids", trainer_ids, tuple(mask.shape))
        check_ids(where, "rollout_ids", rollout_ids, tuple(mask.shape))
    if "rounds" in causes or "token_ids" in causes:
        keep &= _round_index(keep, None) == 1
    if "token_ids" in causes and trainer_ids is not None and rollout_ids is not None:
        differ = (trainer_ids != rollout_ids.to(trainer_ids.device)).to(keep.device) & (mask != 0)
        keep &= differ.long().cumsum(dim=1) == 0
    return keep
