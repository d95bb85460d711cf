"""Backward of every region matches an fp64 autograd reference.

Tolerance: the gradients are returned in the input dtype (bf16), i.e. rounded once at the end
(relative error <= 2^-9), and the fp32 backward math can cancel (the RMSNorm gradient subtracts two
terms of the size of the largest element), so we allow ``rtol = 2^-7`` and ``atol = 2^-7 * max|ref|``.
Roundings inside the forward are straight-through, so the reference is the unrounded formula.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from rlalign_verl.align.regions.residual_stream import Carry, ResidualCarry, carry_for, hand_on, join
from rlalign_verl.align.regions.rmsnorm import add_rms_norm, rms_norm
from rlalign_verl.align.regions.rope import apply_rope, rope_table
from rlalign_verl.align.regions.swiglu import swiglu
from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.catalog.profiles import PROFILES, Mean, get_profile

BF = torch.bfloat16
EPS = 1e-6


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    ref = ref.double()
    tol = 2**-7
    torch.testing.assert_close(ours.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


def leaf(t: torch.Tensor, dtype=BF) -> torch.Tensor:
    return t.to(dtype).detach().requires_grad_(True)


def grads_match(
    loss: Callable[..., torch.Tensor], loss64: Callable[..., torch.Tensor], inputs: tuple
) -> None:
    """Backprop ``loss(*inputs)`` and ``loss64`` of float64 copies of ``inputs``; :func:`close` on every gradient."""
    for t in inputs:
        t.grad = None
    loss(*inputs).backward()
    copies = tuple(t.detach().double().requires_grad_(True) for t in inputs)
    loss64(*copies).backward()
    for t, t64 in zip(inputs, copies, strict=True):
        close(t.grad, t64.grad)


def _ref_norm64(s, w, mean: Mean):
    var = (
        s.pow(2).mean(-1, keepdim=True) if mean is Mean.MEAN else s.pow(2).sum(-1, keepdim=True) / s.shape[-1]
    )
    return s * torch.rsqrt(var + EPS) * w


@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize("residual_dtype", [BF, torch.float32])
def test_add_rms_norm_grad(profile: str, residual_dtype: torch.dtype) -> None:
    p = get_profile(profile)
    torch.manual_seed(0)
    h, r = leaf(torch.randn(3, 5, 896) * 2), leaf(torch.randn(3, 5, 896) * 5, residual_dtype)
    w = leaf(1 + 0.2 * torch.randn(896))
    gy, gr = torch.randn(3, 5, 896), torch.randn(3, 5, 896)
    for round_residual in (True, False):

        def loss(h, r, w, round_residual=round_residual):
            y, res = add_rms_norm(h, r, w, EPS, p.norm, round_residual=round_residual)
            return (y.float() * gy).sum() + (res.float() * gr).sum()

        def loss64(h, r, w):
            return (_ref_norm64(h + r, w, p.norm.mean) * gy.double()).sum() + ((h + r) * gr.double()).sum()

        grads_match(loss, loss64, (h, r, w))
        assert h.grad.dtype == BF and r.grad.dtype == residual_dtype and w.grad.dtype == BF


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_rms_norm_grad(profile: str) -> None:
    p = get_profile(profile)
    torch.manual_seed(1)
    x, w = leaf(torch.randn(4, 7, 128) * 3), leaf(1 + 0.2 * torch.randn(128))
    gy = torch.randn(4, 7, 128)
    for keep_fp32 in (False, True):
        grads_match(
            lambda x, w, keep=keep_fp32: (rms_norm(x, w, EPS, p.norm, keep_fp32=keep).float() * gy).sum(),
            lambda x, w: (_ref_norm64(x, w, p.norm.mean) * gy.double()).sum(),
            (x, w),
        )


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_swiglu_grad(profile: str) -> None:
    p = get_profile(profile)
    torch.manual_seed(2)
    g, u = leaf(torch.randn(3, 11, 300) * 3), leaf(torch.randn(3, 11, 300) * 2)
    go = torch.randn(3, 11, 300)
    grads_match(
        lambda g, u: (swiglu(g, u, p.swiglu).float() * go).sum(),
        lambda g, u: (F.silu(g) * u * go.double()).sum(),
        (g, u),
    )


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_rope_grad(profile: str) -> None:
    p = get_profile(profile)
    torch.manual_seed(3)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 64, 2).float() / 64))
    pos = torch.randint(0, 5000, (2, 13))
    cos32, sin32 = rope_table(inv_freq, pos)
    cos, sin = (cos32, sin32) if p.rope.table == "fp32" else (cos32.to(BF), sin32.to(BF))
    q, k = leaf(torch.randn(2, 4, 13, 64) * 2), leaf(torch.randn(2, 2, 13, 64))
    gq, gk = torch.randn(2, 4, 13, 64), torch.randn(2, 2, 13, 64)

    def loss(q, k):
        qo, ko = apply_rope(q, k, cos, sin, p.rope)
        return (qo.float() * gq).sum() + (ko.float() * gk).sum()

    c = (cos.double() if p.rope.table == "fp32" else cos.float().double()).unsqueeze(1)
    s = (sin.double() if p.rope.table == "fp32" else sin.float().double()).unsqueeze(1)

    def rot64(x):
        x1, x2 = x[..., :32], x[..., 32:]
        return x * c + torch.cat((-x2, x1), -1) * s

    grads_match(loss, lambda q, k: (rot64(q) * gq.double()).sum() + (rot64(k) * gk.double()).sum(), (q, k))


def test_residual_remainder_is_exact_forward_and_backward() -> None:
    """A layer hands on R(s) ([..., H], bf16) and the fp32 remainder s - R(s) in the carry; the next norm's
    ``join`` rebuilds s exactly, and the fp32 gradient of s travels back exactly (R(g) through the visible
    tensor, the rest through the remainder)."""
    torch.manual_seed(4)
    r = (torch.randn(2, 3, 64) * torch.logspace(-20, 20, 64)).requires_grad_(True)  # wide exponent range
    h = torch.zeros(2, 3, 64, dtype=BF)
    box = ResidualCarry()
    visible = hand_on(h, r, Carry.FP32_SUM, box, 0)  # the fp32 sum 0 + r == r
    assert visible.dtype == BF and visible.shape == (2, 3, 64) and torch.equal(visible, r.detach().to(BF))
    visible = visible.to(BF)  # what FSDP2's cast_forward_inputs does: a no-op on bf16
    s = join(visible, box.rest_before(1, keep=False))
    assert s.dtype == torch.float32 and len(box) == 0
    assert torch.equal(s, r.detach()), "R(s) plus the fp32 remainder must give the fp32 sum exactly"
    g = torch.randn(2, 3, 64) * torch.logspace(-10, 10, 64)
    (s * g).sum().backward()
    assert torch.equal(r.grad, g), "the fp32 gradient must travel back through the boundary exactly"


def test_residual_pair_rounded_sum_and_missing_carry() -> None:
    """PAIR: the remainder of R(h + r) for bf16 h, r is itself bf16 (TwoSum), across a wide exponent range;
    its gradient goes through the visible tensor, as the engine pair's bf16 h and r each receive R(g)."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(4096, generator=g).to(BF)
    r = (
        torch.randn(4096, generator=g) * torch.exp2(torch.randint(-40, 41, (4096,), generator=g).float())
    ).to(BF)
    h.requires_grad_(True)
    box = ResidualCarry()
    visible = hand_on(h, r, Carry.PAIR, box, 0)
    assert visible.shape == (4096,) and torch.equal(visible, (h + r).detach()), "R(h + r): HF's bf16 add"
    s = join(visible, box.rest_before(1, keep=True))
    assert box._rest[0].dtype == BF and len(box) == 1  # kept for a checkpoint recompute
    assert torch.equal(s, h.detach().float() + r.float()), "R(s) + the bf16 remainder must give the fp32 sum"
    gs = torch.randn(4096, generator=g) * torch.logspace(-10, 10, 4096)
    (s * gs).sum().backward()
    assert torch.equal(h.grad, gs.to(BF))
    plain = torch.randn(5, 32).to(BF)
    assert (
        torch.equal(hand_on(plain, plain, Carry.ROUNDED_SUM, None, 0), plain + plain)
        and join(plain, None) is plain
    )
    with pytest.raises(AlignmentError, match="without the residual carry"):
        hand_on(plain, plain, Carry.FP32_SUM, None, 0)
    with pytest.raises(AlignmentError, match="found no residual stream from layer 2"):
        ResidualCarry().rest_before(3, keep=False)


def test_carry_follows_what_the_next_norm_reads() -> None:
    want = {"hf": Carry.ROUNDED_SUM, "vllm-eager": Carry.ROUNDED_SUM, "vllm-cpu-eager": Carry.PAIR,
            "sglang": Carry.PAIR, "vllm": Carry.FP32_SUM, "vllm-cpu": Carry.FP32_SUM}  # fmt: skip
    assert {name: carry_for(get_profile(name)) for name in PROFILES} == want
