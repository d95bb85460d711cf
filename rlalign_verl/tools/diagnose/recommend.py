"""Which regions to align: the cheapest setting that is as good as the best, within the 95% intervals.

Rule: among the evaluated settings, take the smallest region set reaching >= 90% of the all-regions
reduction of mean |Δlogp| (point estimates). Then, if a cheaper setting (fewer regions, ``none``
included) has a 95% interval overlapping the chosen one's, the data cannot tell them apart: the
cheaper one is named and the tie is said. A setting whose interval overlaps the floor's is reported
as *at the floor, within noise* (never as better than the floor, even when its mean is lower).
"""

from __future__ import annotations

from typing import Any

from rlalign_verl.measure.intervals import MIN_UNITS, enough_units
from rlalign_verl.tools.diagnose.moe_routes import FLIP_KEY
from rlalign_verl.tools.diagnose.stats import interval, separated

KEY = "mismatch/logp_abs_diff_mean"
RECOMMEND_FRACTION = 0.9


def floor_relation(row: dict[str, Any], floor: dict[str, Any] | None) -> str | None:
    """``"at floor (within noise)"`` or ``"above floor"`` (``None`` without a floor)."""
    if floor is None:
        return None
    if not separated(row, floor) or row[KEY] <= floor[KEY]:
        return "at floor (within noise)"
    return "above floor"


def flip_change(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """``"drop"``/``"rise"`` when the route-flip intervals are separated, else ``"within noise"``."""
    if FLIP_KEY not in before or FLIP_KEY not in after:
        return None
    if not separated(before, after, FLIP_KEY):
        return "within noise"
    return "drop" if after[FLIP_KEY] < before[FLIP_KEY] else "rise"


def _flip_note(results: dict[str, Any], label: str) -> str:
    change = flip_change(results["none"], results[label]) if label != "none" else None
    if change is None:
        return ""
    a, b = 100 * results["none"][FLIP_KEY], 100 * results[label][FLIP_KEY]
    what = "a drop" if change == "drop" else ("a rise" if change == "rise" else "within noise, not a drop")
    return f"; route flips {a:.2f}% -> {b:.2f}% ({what}: 95% intervals)"


def _first_sufficient(results: dict[str, Any], base: float, reduction: float) -> tuple[str, float]:
    candidates = sorted((len(r["regions"]), r[KEY], label) for label, r in results.items() if label != "none")
    for _n, mean, label in candidates:
        got = (base - mean) / reduction
        if got >= RECOMMEND_FRACTION:
            return label, got
    return "all", 1.0


def _cheaper_tie(results: dict[str, Any], label: str) -> str | None:
    """The cheapest setting with fewer regions than ``label`` that the intervals cannot tell apart."""
    chosen = results[label]
    ties = [
        (len(r["regions"]), r[KEY], lab)
        for lab, r in results.items()
        if len(r["regions"]) < len(chosen["regions"]) and not separated(r, chosen)
    ]
    return min(ties)[2] if ties else None


def _floor_part(out: dict[str, Any], base: float, full: float, floor: dict[str, Any]) -> None:
    f = floor[KEY]
    out["floor"] = f
    out["aligned_over_floor"] = full / f if f > 0 else None
    out["reducible_part_removed"] = (base - full) / (base - f) if base > f else None


def recommend(
    results: dict[str, Any], floor: dict[str, Any] | None, tp: int = 1, prompts: int | None = None
) -> dict[str, Any]:
    """The recommendation dict (``regions``, ``setting``, ``text``, ...) for the settings' rows; ``tp``: the
    rollout's tensor-parallel size (> 1 adds a line on the ``tp`` region unless a row already measured it);
    ``prompts``: the distinct prompts the intervals resample (below :data:`MIN_UNITS` nothing is recommended:
    their intervals cannot separate the settings)."""
    if prompts is not None and not enough_units(prompts):
        out = {
            "regions": None,
            "text": f"no recommendation: {prompts} distinct prompts are too few to separate the settings (the 95% "
            f"intervals resample prompts and need >= {MIN_UNITS}); rerun with --num-prompts {MIN_UNITS} or more",
        }
    else:
        out = _recommend(results, floor)
    if tp > 1 and not any("tp" in r.get("regions", ()) for r in results.values()):
        out["tp_note"] = (
            f"the rollouts ran at tensor parallel {tp}: the engine's all-reduce is one more rounding location, "
            "which the tp region mirrors (alignment.regions=[...,tp]); the ladder's '+ tp' rung measures what it "
            "removes"
        )
        out["text"] = out.get("text", "") + "; " + out["tp_note"]
    return out


def _recommend(results: dict[str, Any], floor: dict[str, Any] | None) -> dict[str, Any]:
    if "none" not in results or "all" not in results:
        return {"regions": None, "text": "add 'none' and 'all' to --settings for a recommendation"}
    base, full = results["none"][KEY], results["all"][KEY]
    reduction = base - full
    out: dict[str, Any] = {"baseline": base, "all_regions": full, "all_regions_reduction": reduction}
    if floor is not None:
        _floor_part(out, base, full, floor)
    if reduction <= 0:
        out.update(regions=[], text=f"aligning does not reduce mean |dlogp| here ({base:.4g} -> {full:.4g})")
        return out
    label, got = _first_sufficient(results, base, reduction)
    tie = _cheaper_tie(results, label)
    if tie == "none":
        lo, hi = interval(results[label])
        out.update(
            regions=[],
            setting="none",
            tie_with=label,
            text=f"no alignment needed: {label} ({lo:.4g}-{hi:.4g}) is within noise of no alignment (95% intervals overlap)",
        )
        return out
    note = ""
    if tie is not None:
        note = f"; tie with {label} (95% intervals overlap), so the cheaper one"
        out["tie_with"], label = label, tie
        got = (base - results[label][KEY]) / reduction
    regions = list(results[label]["regions"])
    rel = floor_relation(results[label], floor)
    out.update(
        regions=regions,
        setting=label,
        fraction_of_all=got,
        text=(
            f"align {label} (alignment.regions={regions}): {100 * got:.0f}% of the all-regions reduction "
            f"(mean |dlogp| {base:.4g} -> {results[label][KEY]:.4g}){', ' + rel if rel else ''}{note}"
            f"{_flip_note(results, label)}"
        ),
        route_flips=flip_change(results["none"], results[label]),
    )
    return out


def extra_settings(
    results: dict[str, Any], evaluated: list, prompts: int | None = None
) -> list[tuple[str, tuple[str, ...]]]:
    """Region pairs to evaluate when no evaluated setting smaller than 'all' reaches the target (none when the
    ``prompts`` are too few for a recommendation)."""
    if prompts is not None and not enough_units(prompts):
        return []
    from itertools import combinations

    from rlalign_verl.request.regions import REGIONS
    from rlalign_verl.tools.diagnose.options import label

    labels = {lab for lab, _ in evaluated}
    if "none" not in labels or "all" not in labels:
        return []
    if recommend(results, None).get("regions") not in (None, list(REGIONS)):
        return []
    have = {tuple(r) for _, r in evaluated}
    return [(label(p), p) for p in combinations(REGIONS, 2) if p not in have]
