"""When in-run verification runs, and what its verdict does (:mod:`rlalign_verl.measure.verify` computes it).

Shared by the verl and OpenRLHF integrations: :func:`schedule` (step 1, then every ``verify.every`` steps;
forced at step 1 on an engine the profile was never verified on), :func:`act_on` (``on_worse`` / ``on_worse_later``:
stop with one line naming the fix, or warn) and :class:`Verifier` (one run's state: the log line per verify
step, "within noise" said once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from rlalign_verl.base.options import key_name, key_setting
from rlalign_verl.catalog.fingerprint import EngineFingerprint
from rlalign_verl.measure.intervals import MIN_UNITS
from rlalign_verl.measure.tensor_inputs import check_bool, check_step, check_str
from rlalign_verl.measure.verify import VerifyFailedError, VerifyResult, finite
from rlalign_verl.request.spec import AlignmentSpec


@dataclass(frozen=True)
class Schedule:
    """Which steps verify: step 1, then every ``every`` steps (``every=0``: step 1 only); none when ``off``."""

    first: bool
    every: int

    def due(self, step: int) -> bool:
        step = check_step("Schedule.due", step)
        if not self.first:
            return False
        return step == 1 or (self.every > 0 and step > 1 and (step - 1) % self.every == 0)


def schedule(spec, unverified_engine: bool) -> Schedule:
    """The verify steps for ``spec`` (an AlignmentSpec): none without regions; step 1 at least on an unverified
    engine unless ``verify.skip_unverified_engine``; step 1 and every ``verify.every`` when ``verify.enable``."""
    unverified_engine = check_bool("verify_policy.schedule", "unverified_engine", unverified_engine)
    v = spec.verify
    if not spec.regions:
        return Schedule(False, 0)
    if v.enable:
        return Schedule(True, v.every)
    forced = unverified_engine and not v.skip_unverified_engine
    return Schedule(forced, 0)


def act_on(result: VerifyResult, *, first: bool, spec, fingerprint: str) -> str | None:
    """What a verdict does: raise :class:`VerifyFailedError` (stop) or return a warning line (``None``: fine).
    Keys are named as the surface that runs the check spells them (:func:`~rlalign_verl.base.options.spelled_as`)."""
    first = check_bool("verify_policy.act_on", "first", first)
    fingerprint = check_str(
        "verify_policy.act_on", "fingerprint", fingerprint, hint=" (the engine, described)"
    )
    no_interval = result.decision_ci is None or result.gain_ci is None  # too few sequences: nothing to act on
    if result.verdict >= 0 or no_interval:
        return None
    policy = spec.verify.on_worse if first else spec.verify.on_worse_later
    key = "verify." + ("on_worse" if first else "on_worse_later")
    lo, hi = result.gain_ci
    engine = spec.engine if isinstance(spec.engine, str) else spec.engine.name
    what = (
        f"alignment makes the trainer farther from the rollout engine: profile {engine} on {fingerprint}, "
        f"mean |Δlogp| aligned {result.aligned:.4g} vs unaligned {result.unaligned:.4g} (gain {result.gain:.3g}x "
        f"[{lo:.3g}, {hi:.3g}]); use another {key_name('engine')} (rlalign-verl profiles) or fewer "
        f"{key_name('regions')}"
    )
    if policy == "stop":
        raise VerifyFailedError(f"{what}, or {key_setting(key, 'warn')} to continue anyway")
    return f"{what} (the run continues: {key_setting(key, 'warn')})"


def within_noise_line(result: VerifyResult) -> str:
    """The once-per-run line of a verdict 0: too few sequences, or an interval around 0."""
    if result.paired_diff_ci is None:
        return (
            f"verify: {result.num_seqs} sequence(s) with response tokens are too few to separate aligned from "
            f"unaligned (a verdict needs >= {MIN_UNITS}); the verdict stays 'within noise' until a verify step has "
            "that many"
        )
    return (
        f"verify: aligned and unaligned are within noise of each other ({result.num_seqs} seqs; paired difference "
        f"{result.paired_diff:.3g} [{result.paired_diff_ci[0]:.3g}, {result.paired_diff_ci[1]:.3g}] nats/token): the "
        f"engine may already round like the trainer, or these regions do not matter for this model"
    )


@dataclass
class Verifier:
    """One run's verification state (verl: one ``fit``; OpenRLHF: one PPO trainer process)."""

    spec: AlignmentSpec
    profile: str
    fingerprint: EngineFingerprint
    sched: Schedule
    first_done: bool = False
    said_noise: bool = False
    done: set[int] = field(default_factory=set)
    pending: dict[int, dict[str, float]] = field(default_factory=dict)
    """Metrics of verify steps whose logging comes later in the step (verl's legacy trainer in bypass mode)."""
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("rlalign_verl"))

    @classmethod
    def start(
        cls,
        spec: AlignmentSpec,
        profile: str,
        fp: EngineFingerprint,
        unverified: bool,
        logger: logging.Logger,
    ) -> Verifier | None:
        """The plan for a run aligned by ``spec`` to ``profile`` on engine ``fp`` (``None``: nothing to verify)."""
        sched = schedule(spec, check_bool("Verifier.start", "unverified", unverified))
        if not sched.first:
            return None
        when = "step 1" + (f" and every {sched.every} steps" if sched.every else "")
        logger.info("in-run verification on %s: %s, up to %d sequences per check", fp.describe(), when,
                    spec.verify.max_seqs)  # fmt: skip
        return cls(spec, profile, fp, sched, logger=logger)

    def due(self, step: int) -> bool:
        step = check_step("Verifier.due", step)
        return self.sched.due(step) and step not in self.done

    def warn_skipped(self, err: BaseException) -> None:
        self.logger.warning("in-run verification skipped for this step: %s: %s", type(err).__name__, err)

    def record(self, step: int, result: VerifyResult, ladder: dict[str, float]) -> dict[str, float]:
        """Log the step's line, apply the verdict policy (may raise :class:`VerifyFailedError`), return metrics."""
        step = check_step("Verifier.record", step)
        self.done.add(step)
        decided = (
            result.decision_ci is not None
        )  # too few sequences: nothing decided, the first check still to come
        first = not self.first_done
        self.first_done = self.first_done or decided
        self.logger.info("%s", result.line(step, self.profile))
        if result.verdict == 0 and not (decided and self.said_noise):  # too few: said at every such check
            self.said_noise = self.said_noise or decided
            self.logger.info("%s", within_noise_line(result))
        try:
            warning = act_on(result, first=first, spec=self.spec.replace(engine=self.profile),
                             fingerprint=self.fingerprint.describe())  # fmt: skip
        except VerifyFailedError as err:
            from rlalign_verl.base.errors import one_line

            self.logger.error("%s", one_line(err).split("] ERROR ", 1)[1])  # in the trainer process's log too
            raise
        if warning is not None:
            self.logger.warning("%s", warning)
        return finite({**result.metrics(), **ladder})
