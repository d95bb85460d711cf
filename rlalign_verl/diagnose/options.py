"""What one ``diagnose`` run is asked to do: a frozen :class:`DiagnoseOptions`, checked up front."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

from ..errors import AlignmentError
from ..regions import REGIONS, normalize_regions

DEFAULT_SETTINGS = "none,rope,swiglu,rmsnorm,all"


@dataclass(frozen=True)
class DiagnoseOptions:
    """The command's options (see ``rlalign-verl diagnose --help``); ``seeds`` sampling repeats pooled."""

    model: str | None = None
    tiny: str | None = None
    engine: str | None = None
    num_prompts: int = 32
    max_tokens: int = 32
    rollout_logprobs: str | None = None
    write_rollouts: str | None = None
    settings: str = DEFAULT_SETTINGS
    out: str = "rlalign-diagnose"
    seed: int = 0
    seeds: int = 1
    temperature: float = 1.0
    floor: bool = True
    probe: bool = True
    plots: bool = True
    threads: int | None = None
    engine_head_dtype: str | None = None
    ladder: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DiagnoseOptions:
        """From the parsed command line (``--no-floor`` etc. become ``floor=False``)."""
        names = {f.name for f in fields(cls)} - {"floor", "probe", "plots", "ladder"}
        kw = {n: getattr(args, n) for n in names if hasattr(args, n)}
        kw.update(floor=not args.no_floor, probe=not args.no_probe, plots=not args.no_plots)
        kw.update(ladder=not getattr(args, "no_ladder", False))
        return cls(**kw)

    def check(self) -> list[tuple[str, tuple[str, ...]]]:
        """Raise a one-line :class:`AlignmentError` for a bad value; returns the parsed settings."""
        for name in ("num_prompts", "max_tokens", "seeds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                flag = "--" + name.replace("_", "-")
                raise AlignmentError(f"{flag} must be an integer >= 1, got {v!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise AlignmentError(f"--temperature must be a finite number >= 0, got {t!r}")
        if self.threads is not None and self.threads < 1:
            raise AlignmentError(f"--threads must be >= 1, got {self.threads!r}")
        if self.engine_head_dtype is not None:
            from .head import check_head_option

            check_head_option(self.engine_head_dtype)
        if self.rollout_logprobs:  # the dump's own samples are used: a sampling option would be ignored
            ignored = [
                f"--{n.replace('_', '-')}" for n in SAMPLING_OPTIONS if getattr(self, n) != _DEFAULTS[n]
            ]
            if ignored:
                raise AlignmentError(
                    f"{', '.join(ignored)} set how the engine samples, but --rollout-logprobs reads samples made "
                    f"elsewhere (the dump's own); drop {', '.join(ignored)}, or drop --rollout-logprobs to sample here"
                )
            if self.write_rollouts:
                raise AlignmentError(
                    "--write-rollouts writes the engine's samples, but --rollout-logprobs samples nothing here; "
                    "drop one of them"
                )
        return parse_settings(self.settings)


SAMPLING_OPTIONS = ("num_prompts", "max_tokens", "seeds", "temperature")
"""Options that only shape the engine's sampling here; meaningless with a dump (``--rollout-logprobs``)."""
_DEFAULTS = {f.name: f.default for f in fields(DiagnoseOptions)}


def parse_settings(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """``"none,rope,all,rope+swiglu"`` -> ``[(label, regions), ...]`` (deduplicated, order kept)."""
    out: list[tuple[str, tuple[str, ...]]] = []
    seen: set[tuple[str, ...]] = set()
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        regions = normalize_regions(item.replace("+", ","))
        if regions in seen:
            continue
        seen.add(regions)
        out.append((label(regions), regions))
    if not out:
        raise AlignmentError(f"--settings {text!r} names no setting; e.g. --settings {DEFAULT_SETTINGS}")
    return out


def label(regions: tuple[str, ...]) -> str:
    """A setting's display name: ``none``, ``all`` or regions joined with ``+``."""
    if not regions:
        return "none"
    if regions == REGIONS:
        return "all"
    if set(REGIONS) < set(regions):  # all + an opt-in region (moe)
        return "+".join(("all", *(r for r in regions if r not in REGIONS)))
    return "+".join(regions)
