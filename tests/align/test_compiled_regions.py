"""The opt-in Inductor-compiled regions keep the eager rounding (rlalign_verl.align.regions.compiled).

SwiGLU and RoPE must be bit-identical to the eager region functions, outputs and gradients, for every
profile. The compiled norms (``exact=False``) round in the same places but sum the squares in
Inductor's order: we require every output within one bf16 ulp of the eager one and at most 1 % of the
elements off by that ulp. Skipped when Inductor cannot compile here (no C++ compiler).
"""

from __future__ import annotations

import pytest
import torch

from rlalign_verl.align.regions import rmsnorm, rope, swiglu
from rlalign_verl.align.regions.compiled import compiled_regions, inductor_available
from rlalign_verl.catalog.profiles import PROFILES

BF = torch.bfloat16
EPS = 1e-6

_OK, _WHY = inductor_available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _OK, reason=f"Inductor cannot compile here: {_WHY}")]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each profile compiles its own graphs; keep the recompile limit out of play
    yield
    torch._dynamo.reset()


def leaf(t: torch.Tensor, dtype=BF) -> torch.Tensor:
    return t.to(dtype).detach().requires_grad_(True)


def grads_of(fn, inputs: list[torch.Tensor], seeds: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    sum((o.float() * g).sum() for o, g in zip(outs, seeds, strict=True)).backward()
    return [o.detach() for o in outs], [t.grad for t in inputs]


def assert_bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), (x.float() - y.float()).abs().max()


def distinct(region: str) -> list[str]:
    """One profile per distinct rounding of ``region`` (compiling costs seconds per profile)."""
    first: dict[object, str] = {}
    for name in sorted(PROFILES):
        first.setdefault(getattr(PROFILES[name], region), name)
    return sorted(first.values())


@pytest.mark.parametrize("profile", distinct("swiglu"))
def test_compiled_swiglu_is_bit_identical(profile: str) -> None:
    p = PROFILES[profile]
    c = compiled_regions(profile)
    for seed, (t, i) in enumerate([(37, 704), (8, 2816)]):
        torch.manual_seed(seed)
        gate, up = leaf(torch.randn(t, i) * 3), leaf(torch.randn(t, i))
        gy = [torch.randn(t, i)]
        eager = grads_of(lambda g, u: swiglu.swiglu(g, u, p.swiglu), [gate, up], gy)
        comp = grads_of(c.swiglu, [gate, up], gy)
        assert_bit_equal(eager[0], comp[0])
        assert_bit_equal(eager[1], comp[1])


@pytest.mark.parametrize("profile", distinct("rope"))
def test_compiled_rope_is_bit_identical(profile: str) -> None:
    p = PROFILES[profile]
    c = compiled_regions(profile)
    for seed, t in enumerate([29, 64]):
        torch.manual_seed(seed)
        # q/k as the attention forward makes them: transposed views of the projection output
        q = leaf(torch.randn(1, t, 4, 64)).transpose(1, 2)
        k = leaf(torch.randn(1, t, 2, 64)).transpose(1, 2)
        inv = 1.0 / (1e6 ** (torch.arange(0, 64, 2).float() / 64))
        cos, sin = rope.rope_table(inv, torch.arange(t)[None] + 3)
        if p.rope.table == "bf16":
            cos, sin = cos.to(BF), sin.to(BF)
        gy = [torch.randn(1, 4, t, 64), torch.randn(1, 2, t, 64)]
        qk = [q, k]
        for x in qk:
            x.retain_grad()
        eager = grads_of(lambda a, b, cs=(cos, sin): rope.apply_rope(a, b, *cs, p.rope), qk, gy)
        comp = grads_of(lambda a, b, cs=(cos, sin): c.apply_rope(a, b, *cs), qk, gy)
        assert_bit_equal(eager[0], comp[0])
        assert_bit_equal(eager[1], comp[1])


def within_one_ulp(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of elements that differ; asserts every difference is one step of ``a``'s dtype."""
    if a.dtype == torch.float32:
        assert torch.equal(a, b)
        return 0.0
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    diff = (ai - bi).abs()
    assert int(diff.max()) <= 1, int(diff.max())
    return float((diff > 0).float().mean())


@pytest.mark.parametrize("profile", ["vllm", "vllm-eager", "sglang"])
def test_compiled_norms_round_in_the_same_places(profile: str) -> None:
    p = PROFILES[profile]
    c = compiled_regions(profile, exact=False)
    torch.manual_seed(0)
    h, r = (torch.randn(64, 896) * 2).to(BF), (torch.randn(64, 896) * 5).to(BF)
    rf, w = torch.randn(64, 896) * 5, (1 + 0.1 * torch.randn(896)).to(BF)
    fractions = []
    for residual in (r, rf):
        for round_residual in (True, False):
            ref = rmsnorm.add_rms_norm(h, residual, w, EPS, p.norm, round_residual=round_residual)
            got = c.add_rms_norm(h, residual, w, EPS, round_residual=round_residual)
            fractions += [within_one_ulp(ref[0], got[0]), within_one_ulp(ref[1], got[1])]
    fractions.append(within_one_ulp(rmsnorm.rms_norm(h, w, EPS, p.norm), c.rms_norm(h, w, EPS)))
    assert max(fractions) <= 0.01, fractions


def test_exact_default_keeps_the_eager_norms() -> None:
    c = compiled_regions("vllm")
    assert c.exact and hasattr(c.swiglu, "_torchdynamo_orig_callable")
    assert not hasattr(c.add_rms_norm, "_torchdynamo_orig_callable")
    torch.manual_seed(1)
    h, rf, w = torch.randn(16, 320).to(BF), torch.randn(16, 320) * 3, (1 + 0.1 * torch.randn(320)).to(BF)
    ref = rmsnorm.add_rms_norm(h, rf, w, EPS, PROFILES["vllm"].norm, round_residual=False)
    got = c.add_rms_norm(h, rf, w, EPS, round_residual=False)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
