"""Each region x profile is bit-exact against an independent reference that spells out the profile's formula.

The references below are written per profile by hand from the profile docstrings (not generated
from the profile fields), with every rounding written out: ``bf(v)`` rounds an fp32 value to bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlalign_verl.align.regions.rmsnorm import add_rms_norm, rms_norm
from rlalign_verl.align.regions.rope import apply_rope, rope_table
from rlalign_verl.align.regions.swiglu import swiglu
from rlalign_verl.catalog.profiles import PROFILES, get_profile

BF = torch.bfloat16
EPS = 1e-6


def bf(v: torch.Tensor) -> torch.Tensor:
    return v.to(BF).float()


def trunc(v: torch.Tensor) -> torch.Tensor:
    """bf16 by truncation (round toward zero), as fp32: the value whose magnitude is not above |v|."""
    r = v.to(BF).float()
    toward_zero = torch.nextafter(r.to(BF), torch.zeros((), dtype=BF)).float()
    return torch.where(r.abs() > v.abs(), toward_zero, r)


def mean_sq(v: torch.Tensor) -> torch.Tensor:
    return v.pow(2).mean(-1, keepdim=True)


def sum_sq_div_n(v: torch.Tensor) -> torch.Tensor:
    return v.pow(2).sum(-1, keepdim=True) / v.shape[-1]


# ---- references: (h, r, w) -> (out, residual_out) for the fused add + norm ------------------------
def ref_add_norm(profile: str, h, r, w):
    s = h.float() + r.float()
    w = w.float()
    if profile == "hf":  # h' = R(h + r); R(w * R(h' * rt(h')))
        hr = bf(s)
        return bf(w * bf(hr * torch.rsqrt(mean_sq(hr) + EPS))), hr
    if profile == "vllm-cpu-eager":  # residual R(s); R(R(s * rt(s)) * w)
        return bf(bf(s * torch.rsqrt(mean_sq(s) + EPS)) * w), bf(s)
    if profile in ("vllm-cpu", "vllm"):  # R(s * rt(s) * w); residual s (fp32) or R(s)
        return bf(s * torch.rsqrt(mean_sq(s) + EPS) * w), s
    if profile == "vllm-eager":  # residual R(s); variance and normalisation from R(s); sum/N; one rounding
        hr = bf(s)
        return bf(hr * torch.rsqrt(sum_sq_div_n(hr) + EPS) * w), hr
    if profile == "sglang":  # residual R(s); variance and output from s; sum/N; one rounding
        return bf(s * torch.rsqrt(sum_sq_div_n(s) + EPS) * w), bf(s)
    raise AssertionError(profile)


def ref_norm(profile: str, x, w):
    x, w = x.float(), w.float()
    if profile in ("hf", "vllm-cpu-eager"):
        return bf(bf(x * torch.rsqrt(mean_sq(x) + EPS)) * w)
    if profile in ("vllm-cpu", "vllm"):
        return bf(x * torch.rsqrt(mean_sq(x) + EPS) * w)
    if profile in ("vllm-eager", "sglang"):
        return bf(x * torch.rsqrt(sum_sq_div_n(x) + EPS) * w)
    raise AssertionError(profile)


def ref_swiglu(profile: str, g, u):
    a = F.silu(g.float())
    if profile in ("hf", "vllm-cpu-eager", "vllm-eager"):
        return bf(bf(a) * u.float())
    return bf(a * u.float())


def ref_rope(profile: str, x, cos32, sin32):
    half = x.shape[-1] // 2
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    if profile == "sglang":
        c, s = cos32[..., :half], sin32[..., :half]  # fp32 table, never rounded
    else:
        c, s = bf(cos32[..., :half]), bf(sin32[..., :half])
    c, s = c.unsqueeze(1), s.unsqueeze(1)
    if profile == "hf":
        return torch.cat((bf(bf(x1 * c) - bf(x2 * s)), bf(bf(x2 * c) + bf(x1 * s))), -1)
    if profile == "vllm-cpu-eager" and not torch.cpu._is_avx512_bf16_supported():
        # vLLM's C++ rotary_embedding without AVX512-BF16 drops the fp32 result's low 16 bits
        return torch.cat((trunc(x1 * c - x2 * s), trunc(x2 * c + x1 * s)), -1)
    return torch.cat((bf(x1 * c - x2 * s), bf(x2 * c + x1 * s)), -1)


NORM_ROUNDS_RESIDUAL = {
    "hf": True,
    "vllm-cpu-eager": True,
    "vllm-eager": True,
    "sglang": True,
    "vllm-cpu": False,
    "vllm": False,
}
SHAPES = [(2, 10), (1, 30)]  # leading dims; the token rows span every scale in SCALES
HIDDEN = [64, 128, 896, 1000, 2048]
SCALES = torch.tensor([1e-3, 1e-2, 1e-1, 1.0, 10.0, 1e2])


def _inputs(seed: int, shape, hidden: int, scale: float = 1.0):
    """bf16 ``h, r, w``; token rows cycle through value scales 1e-3 .. 1e2 (times ``scale``)."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.tensor(shape).prod())
    row_scale = (SCALES.repeat(n // len(SCALES) + 1)[:n] * scale).reshape(*shape, 1)
    h = (torch.randn(*shape, hidden, generator=gen) * row_scale).to(BF)
    r = (torch.randn(*shape, hidden, generator=gen) * row_scale * 4).to(BF)
    w = (1.0 + 0.3 * torch.randn(hidden, generator=gen)).to(BF)
    return h, r, w


@pytest.mark.parametrize("profile", sorted(set(PROFILES)))
def test_add_rms_norm_bit_exact(profile: str) -> None:
    p = get_profile(profile)
    for i, (shape, hidden) in enumerate((s, h) for s in SHAPES for h in HIDDEN):
        h, r, w = _inputs(i, shape, hidden)
        for r_in in (r, r.float() + 1e-3 * torch.randn(r.shape)):  # bf16 residual, and an fp32 one
            y, res = add_rms_norm(h, r_in, w, EPS, p.norm, round_residual=NORM_ROUNDS_RESIDUAL[profile])
            y_ref, res_ref = ref_add_norm(profile, h, r_in, w)
            assert y.dtype == BF
            assert torch.equal(y.float(), y_ref), (profile, shape, hidden, (y.float() != y_ref).sum())
            assert torch.equal(res.float(), res_ref.float())
            assert res.dtype == (BF if NORM_ROUNDS_RESIDUAL[profile] else torch.float32)


@pytest.mark.parametrize("profile", sorted(set(PROFILES)))
def test_rms_norm_bit_exact(profile: str) -> None:
    p = get_profile(profile)
    for i, (shape, hidden) in enumerate((s, h) for s in SHAPES for h in HIDDEN):
        x, _, w = _inputs(100 + i, shape, hidden)
        y = rms_norm(x, w, EPS, p.norm)
        assert torch.equal(y.float(), ref_norm(profile, x, w)), (profile, shape, hidden)


@pytest.mark.parametrize("profile", sorted(set(PROFILES)))
def test_swiglu_bit_exact(profile: str) -> None:
    p = get_profile(profile)
    for i, (shape, hidden) in enumerate((s, h) for s in SHAPES for h in (64, 896, 4864)):
        g, u, _ = _inputs(200 + i, shape, hidden)
        out = swiglu(g, u, p.swiglu)
        assert out.dtype == BF
        assert torch.equal(out.float(), ref_swiglu(profile, g, u)), (profile, shape, hidden)


@pytest.mark.parametrize("profile", sorted(set(PROFILES)))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_bit_exact(profile: str, head_dim: int) -> None:
    p = get_profile(profile)
    gen = torch.Generator().manual_seed(head_dim)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    for scale in SCALES.tolist():
        # batch 2, 9 heads, 33 tokens; long positions (up to 131k) and a packed layout restarting at 0
        pos = torch.stack([torch.randint(0, 131072, (33,), generator=gen), torch.arange(33) % 11])
        cos32, sin32 = rope_table(inv_freq, pos)
        q = (torch.randn(2, 9, 33, head_dim, generator=gen) * scale).to(BF)
        k = (torch.randn(2, 3, 33, head_dim, generator=gen) * scale).to(BF)
        table = (cos32, sin32) if p.rope.table == "fp32" else (cos32.to(BF), sin32.to(BF))
        qo, ko = apply_rope(q, k, *table, p.rope)
        assert torch.equal(qo.float(), ref_rope(profile, q, cos32, sin32)), (profile, scale)
        assert torch.equal(ko.float(), ref_rope(profile, k, cos32, sin32)), (profile, scale)


def test_hf_rope_matches_transformers_apply_rotary_pos_emb() -> None:
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    pos = torch.randint(0, 40000, (2, 21))
    cos, sin = (t.to(BF) for t in rope_table(inv_freq, pos))
    q, k = torch.randn(2, 4, 21, 64).to(BF) * 3, torch.randn(2, 2, 21, 64).to(BF)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    q_us, k_us = apply_rope(q, k, cos, sin, get_profile("hf").rope)
    assert torch.equal(q_hf, q_us) and torch.equal(k_hf, k_us)


def test_regions_keep_fp32_under_autocast() -> None:
    """Autocast(bf16) must not change the region math (it is disabled locally)."""
    p = get_profile("vllm-cpu")
    h, r, w = _inputs(7, (2, 6), 896)
    plain = add_rms_norm(h, r, w, EPS, p.norm, round_residual=False)
    with torch.autocast("cpu", dtype=BF):
        under = add_rms_norm(h, r, w, EPS, p.norm, round_residual=False)
    assert torch.equal(plain[0], under[0]) and torch.equal(plain[1], under[1])
    assert under[1].dtype == torch.float32
