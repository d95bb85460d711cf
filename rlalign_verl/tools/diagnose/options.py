"""What one ``diagnose`` run is asked to do: a frozen :class:`DiagnoseOptions`, checked up front."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, fields

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.request.regions import REGIONS, normalize_regions

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
    tp: int = 1

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
        for name in (
            "model",
            "tiny",
            "engine",
            "rollout_logprobs",
            "write_rollouts",
            "out",
            "engine_head_dtype",
        ):
            v = getattr(self, name)
            text = os.fspath(v) if isinstance(v, os.PathLike) else v  # a pathlib.Path from Python is a path
            if v is not None and (
                not isinstance(text, str) or not text.strip()
            ):  # an unset shell variable, a typo
                flag = "--" + name.replace("_", "-")
                raise AlignmentError(
                    f"{flag} is {v!r}, not a name or path; give one, or drop {flag} for its default"
                )
        for name in ("num_prompts", "max_tokens", "seeds", "tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                flag = "--" + name.replace("_", "-")
                raise AlignmentError(f"{flag} must be an integer >= 1, got {v!r}")
        if self.num_prompts * self.seeds > MAX_ROLLOUTS:
            raise AlignmentError(
                f"--num-prompts {self.num_prompts} x --seeds {self.seeds} = {self.num_prompts * self.seeds} "
                f"rollouts, more than {MAX_ROLLOUTS}: each is recomputed once per setting, one sequence at a time; "
                "use fewer (32-256 prompts give 95% intervals a few percent wide)"
            )
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise AlignmentError(f"--temperature must be a finite number >= 0, got {t!r}")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED:
            raise AlignmentError(
                f"--seed must be an integer from 0 to {MAX_SEED} (what vLLM's and numpy's seeding accept), got {s!r}"
            )
        if self.threads is not None:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            n = self.threads
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cpus:
                raise AlignmentError(
                    f"--threads must be an integer from 1 to {cpus} (the CPUs this process may use), got {n!r}"
                )
        if self.engine_head_dtype is not None:
            from rlalign_verl.tools.diagnose.head import check_head_option

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


MAX_SEED = 2**32 - 1
"""vLLM seeds Python's, numpy's and torch's generators with ``--seed`` (numpy takes 0 .. 2**32 - 1); each
request gets ``seed * 100003 + index``, well within a torch generator's 64 bits."""
MAX_ROLLOUTS = 100_000
"""``--num-prompts x --seeds`` above this would take days to recompute (one sequence at a time, per setting)."""

SAMPLING_OPTIONS = ("num_prompts", "max_tokens", "seeds", "temperature", "tp")
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
