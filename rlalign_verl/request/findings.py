"""Start-up findings shared by the verl and OpenRLHF confounder checks: what one is, and how it is settled.

A :class:`Finding` names a setting that makes the train-vs-rollout gap something other than rounding, its effect on
the ratio ``pi_train / pi_rollout`` and the fix, in one line. Errors stop the run before anything starts unless the
user acknowledges their key (verl: ``alignment.doctor.allow=[key]``, OpenRLHF: ``--alignment.doctor.allow key``).
Torch-, verl- and OpenRLHF-free (the spec validates ``doctor.allow`` against :data:`FINDING_KEYS`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from rlalign_verl.base.errors import AlignmentError

__all__ = ["Finding", "FINDING_KEYS", "DoctorConfigError", "settle", "raise_or_lines"]

FINDING_KEYS: tuple[str, ...] = (
    "logprobs_mode",
    "top_p_top_k",
    "temperature",
    "calculate_log_probs",
    "micro_batch",
    "async_staleness",
    "multi_turn",
    "routing_replay",
    "dtype",
    "quantization",
)
"""Every key a :class:`Finding` can carry (and ``doctor.allow`` can list)."""


class DoctorConfigError(AlignmentError):
    """A setting that makes the rollout log-probs feed a wrong ratio into the loss, not acknowledged."""


@dataclass(frozen=True)
class Finding:
    """One confounder: ``key`` (one of :data:`FINDING_KEYS`), ``severity`` ("error" | "warn"), ``line``."""

    key: str
    severity: str
    line: str


def _allowed(allow: Iterable[str] | None, allow_key: str) -> set[str]:
    if allow is None:
        return set()
    if isinstance(allow, str) or not isinstance(allow, Iterable):
        raise DoctorConfigError(
            f"{allow_key} is {allow!r}; give a list of finding keys, e.g. {allow_key}=[top_p_top_k]"
        )
    names = [str(a) for a in allow]
    unknown = [a for a in names if a not in FINDING_KEYS]
    if unknown:
        raise DoctorConfigError(
            f"{allow_key} names {unknown}, not finding keys; use some of {list(FINDING_KEYS)}"
        )
    return set(names)


def settle(found: Iterable[Finding], allow: Iterable[str] | None, allow_key: str, how: str) -> list[Finding]:
    """Errors whose key is in ``allow`` become warnings; the others say how to acknowledge them (``how``: the
    spelling of that, e.g. ``alignment.doctor.allow=[{key}]``). Raises :class:`DoctorConfigError` for an unknown
    key in ``allow``."""
    allowed = _allowed(allow, allow_key)
    out = []
    for f in found:
        if f.severity == "error" and f.key in allowed:
            f = replace(f, severity="warn", line=f"{f.line} (acknowledged in {allow_key})")
        elif f.severity == "error":
            f = replace(f, line=f"{f.line}; or acknowledge it: {how.format(key=f.key)}")
        out.append(f)
    return out


def raise_or_lines(found: Iterable[Finding]) -> list[str]:
    """Raise :class:`DoctorConfigError` with the first error's line; else the warning lines."""
    found = list(found)
    errors = [f for f in found if f.severity == "error"]
    if errors:
        raise DoctorConfigError(errors[0].line)
    return [f.line for f in found]
