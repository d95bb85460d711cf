"""Per-region micro-benchmark: HF's ops vs the aligned region vs its compiled variants, forward + backward."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from peak_memory import peak_memory
from saved_bytes import saved_bytes


def _hf_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen2RMSNorm's ops (fp32 statistics, rounded to the input dtype before the weight)."""
    v = x.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return w * v.to(x.dtype)


def micro_cases(profile: str, tokens: int, hidden: int, inter: int, compiled: bool) -> dict[str, dict]:
    """``region -> {variant: fn}`` at one layer's shapes; each fn runs forward and backward (``fn.forward``
    and ``fn.inputs`` give its forward alone, for :func:`saved_bytes`)."""
    import torch.nn.functional as F
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    from rlalign_verl.align.regions.rmsnorm import add_rms_norm
    from rlalign_verl.align.regions.rope import apply_rope, rope_table
    from rlalign_verl.align.regions.swiglu import swiglu
    from rlalign_verl.catalog.profiles import get_profile

    p = get_profile(profile)
    bf = torch.bfloat16
    g = torch.Generator().manual_seed(0)

    def leaf(*shape: int, scale: float = 1.0, dtype: torch.dtype = bf) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_(True)

    def fwd_bwd(fn: Callable[..., object], *xs: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            out = fn(*xs)
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward([o for o in outs], [torch.ones_like(o) for o in outs])

        run.forward, run.inputs = (lambda: fn(*xs)), xs  # type: ignore[attr-defined]  # for saved_bytes
        return run

    gate, up = leaf(tokens, inter, scale=3.0), leaf(tokens, inter)
    h, w = leaf(tokens, hidden), leaf(hidden)
    res = leaf(tokens, hidden, scale=4.0, dtype=torch.float32 if p.residual.value == "at_attention" else bf)
    heads, kv, hd = hidden // 64, max(1, hidden // 256), 64
    q = leaf(1, tokens, heads, hd).transpose(1, 2)
    k = leaf(1, tokens, kv, hd).transpose(1, 2)
    cos32, sin32 = rope_table(
        1.0 / (1e6 ** (torch.arange(0, hd, 2).float() / hd)), torch.arange(tokens)[None]
    )
    cos, sin = cos32.to(bf), sin32.to(bf)
    tcos, tsin = (cos32, sin32) if p.rope.table == "fp32" else (cos, sin)
    hres = res.detach().to(bf).requires_grad_(True)
    cases: dict[str, dict] = {
        "swiglu": {
            "hf": fwd_bwd(lambda a, b: F.silu(a) * b, gate, up),
            "aligned": fwd_bwd(lambda a, b: swiglu(a, b, p.swiglu), gate, up),
        },
        "add+rmsnorm": {
            "hf": fwd_bwd(lambda a, r, ww: (lambda s: (_hf_rmsnorm(s, ww, 1e-6), s))(r + a), h, hres, w),
            "aligned": fwd_bwd(
                lambda a, r, ww: add_rms_norm(a, r, ww, 1e-6, p.norm, round_residual=True), h, res, w
            ),
        },
        "rope": {
            "hf": fwd_bwd(lambda a, b: apply_rotary_pos_emb(a, b, cos, sin), q, k),
            "aligned": fwd_bwd(lambda a, b: apply_rope(a, b, tcos, tsin, p.rope), q, k),
        },
    }
    cases.update(_opt_in_cases(p, tokens, hidden, leaf, fwd_bwd))
    if compiled:
        _add_compiled_cases(cases, p, fwd_bwd, (gate, up), (h, res, w), (q, k, tcos, tsin))
    return cases


def _add_compiled_cases(cases: dict[str, dict], p, fwd_bwd: Callable, swiglu_in: tuple, norm_in: tuple,
                        rope_in: tuple) -> None:  # fmt: skip
    """The torch.compile variant of each region, and ``cnorm`` (the forward compiled as the engine compiles it)."""
    from rlalign_verl.align.regions.compiled import compiled_regions

    c = compiled_regions(p, exact=False)
    q, k, tcos, tsin = rope_in
    cases["swiglu"]["compiled"] = fwd_bwd(c.swiglu, *swiglu_in)
    cases["add+rmsnorm"]["compiled"] = fwd_bwd(
        lambda a, r, ww: c.add_rms_norm(a, r, ww, 1e-6, round_residual=True), *norm_in
    )
    cases["rope"]["compiled"] = fwd_bwd(lambda a, b: c.apply_rope(a, b, tcos, tsin), q, k)
    if p.norm_inductor:  # compiled_norm: the forward compiled as the engine compiles it (inductor_norm)
        from rlalign_verl.align.regions.inductor_norm import inductor_norms

        c_add = inductor_norms(p)[1]
        cases["add+rmsnorm"]["cnorm"] = fwd_bwd(
            lambda a, r, ww: c_add(a, r, ww, 1e-6, p.norm, round_residual=True, index=2), *norm_in
        )


def _opt_in_cases(p, tokens: int, hidden: int, leaf: Callable, fwd_bwd: Callable) -> dict[str, dict]:
    """attention (vLLM CPU profiles: engine op / fp32 SDPA vs HF's bf16 SDPA) and lm_head (fp32 head vs bf16)."""
    import torch.nn.functional as F

    from rlalign_verl.align.engine_ops.attention_op import engine_attention, engine_op_available
    from rlalign_verl.align.regions.attention import aligned_attention
    from rlalign_verl.align.regions.lm_head import Fp32HeadFn

    vocab = 32 * hidden
    hh, wh = leaf(tokens, hidden), leaf(vocab, hidden, scale=0.05)
    cases: dict[str, dict] = {"lm_head": {
        "hf": fwd_bwd(lambda a, ww: F.linear(a, ww), hh, wh),
        "aligned": fwd_bwd(lambda a, ww: Fp32HeadFn.apply(a, ww, None, p.device == "cuda"), hh, wh),
    }}  # fmt: skip
    if p.engine != "vllm" or p.device != "cpu":
        return cases
    heads, kv, hd = hidden // 64, max(1, hidden // 256), 64
    q, k, v = leaf(1, heads, tokens, hd), leaf(1, kv, tokens, hd), leaf(1, kv, tokens, hd)
    pos = torch.arange(tokens)[None]

    def hf(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)

    cases["attention"] = {"hf": fwd_bwd(hf, q, k, v)}
    if engine_op_available()[0]:
        cases["attention"]["aligned"] = fwd_bwd(
            lambda a, b, c: aligned_attention(a, b, c, pos, None, engine_attention), q, k, v
        )
    cases["attention"]["sdpa-fp32"] = fwd_bwd(lambda a, b, c: aligned_attention(a, b, c, pos, None), q, k, v)
    return cases


def _time_rotated(variants: dict[str, Callable[[], None]], repeat: int) -> dict[str, list[float]]:
    """CPU ms of each variant per round, the order rotated every round, after two warm-up rounds."""
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(2 + repeat):  # two warm-up rounds (compilation happens in the first)
        for j in range(len(names)):
            n = names[(j + rnd) % len(names)]
            t0 = time.thread_time()  # this thread's CPU time: robust to other load on the machine
            variants[n]()
            if rnd >= 2:
                times[n].append((time.thread_time() - t0) * 1e3)
    return times


def run_micro(
    profiles: list[str], tokens: int, hidden: int, inter: int, repeat: int, compiled: bool
) -> list[dict]:
    """One row per (profile, region, variant): median CPU ms, peak and saved-for-backward bytes, ratios to hf."""
    rows = []
    for profile in profiles:
        for region, variants in micro_cases(profile, tokens, hidden, inter, compiled).items():
            names = list(variants)
            times = _time_rotated(variants, repeat)
            base = statistics.median(times["hf"])
            peaks = {n: peak_memory(variants[n], "cpu")[0] for n in names}
            saved = {n: saved_bytes(variants[n].forward, variants[n].inputs) for n in names}
            for n in names:
                med = statistics.median(times[n])
                rows.append({"profile": profile, "region": region, "variant": n, "median_cpu_ms": med,
                             "ratio": med / base, "peak_bytes": peaks[n], "peak_ratio": peaks[n] / peaks["hf"],
                             "saved_bytes": saved[n][0], "saved_new_bytes": saved[n][1],
                             "tokens": tokens, "hidden": hidden, "inter": inter})  # fmt: skip
    return rows


def format_micro(rows: list[dict]) -> str:
    """The ``--micro`` table: CPU time, peak and saved-for-backward MiB of each variant, ratios to ``hf``."""
    lines = [f"{'profile':<11} {'region':<12} {'variant':<9} {'cpu ms':>9} {'x hf':>6} {'peak MiB':>9} {'x hf':>6}"
             f" {'saved MiB':>9} {'new MiB':>8}   (fwd+bwd, 2048 tokens, H 1024, I 2816; saved: for backward,"
             " new: beyond the inputs)"]  # fmt: skip
    for r in rows:
        lines.append(f"{r['profile']:<11} {r['region']:<12} {r['variant']:<9} {r['median_cpu_ms']:9.2f} {r['ratio']:6.2f} "
                     f"{r['peak_bytes'] / 2**20:9.1f} {r['peak_ratio']:6.2f} {r['saved_bytes'] / 2**20:9.1f} "
                     f"{r['saved_new_bytes'] / 2**20:8.1f}")  # fmt: skip
    return "\n".join(lines)
