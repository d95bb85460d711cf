"""MoE experts + combine through the engine's own op (opt-in ``experimental.moe_variant=engine-op``, vLLM CPU
only; its checks: :func:`rlalign_verl.request.checks.check_moe_variant`).

The emulated experts (:func:`~rlalign_verl.align.regions.moe.mix_experts` with the vllm-cpu roundings) match
``torch.ops._C.cpu_fused_moe`` on ~99.9% of elements: the op's GEMMs sum over K in an order no torch
matmul reproduces (docs/moe.md). With ``engine-op`` the forward *is* that op, called as
``fused_moe/experts/cpu_moe.py::CPUUnquantizedExperts.apply`` calls it (its AMX subclass
``X86CPUUnquantizedExperts`` where AMX tiles work): the intermediate dimension zero-padded to a multiple of
32 as ``_pad_moe_intermediate`` does, both weights prepacked for the ISA (``cpu_prepack_moe_weight``), fp32
routing weights, int32 expert ids, activation ``silu``. It runs inside an ``autograd.Function`` whose backward
is the emulated path's: ``mix_experts`` recomputed from the saved inputs and differentiated, so the gradients
are exactly those of ``moe_variant="emulate"`` (the op's output rounding is straight-through).

Memory: the prepacked (and padded) weights are a transient copy of the layer's expert weights, made inside
the call and freed when the op returns; nothing is kept between calls (the weights change every optimizer
step, so a persistent packed copy would also have to be invalidated). Backward saves the same tensors as
the emulated path's recompute needs: the layer input, the routing and references to the weights.
"""

from __future__ import annotations

import functools

import torch

from rlalign_verl.align.regions.moe import mix_experts, rank_experts
from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.catalog.profiles import MoeRounding

ALIGNMENT = 32
"""``CPUUnquantizedExperts.output_alignment`` (= the lcm with ``reduction_alignment`` for vec and AMX): the
engine pads the expert intermediate dimension to a multiple of it and needs the hidden size divisible by it."""


def engine_op_available() -> tuple[bool, str]:
    """Whether vLLM's CPU expert op can be called here; the reason if not."""
    try:
        import vllm._custom_ops  # noqa: F401 - loads the kernel library built for this CPU (AVX2/AVX512/AMX)

        torch.ops._C.cpu_fused_moe  # noqa: B018
    except Exception as e:  # noqa: BLE001 - any import/registration failure means "not here"
        return False, f"{type(e).__name__}: {e}".splitlines()[0]
    return True, ""


@functools.cache
def engine_isa() -> str:
    """The ISA vLLM's CPU experts use here: ``amx`` (``X86CPUUnquantizedExperts``) or ``vec``."""
    if torch.cpu._is_amx_tile_supported():
        # AMX tiles need the XCOMP permission: in the engine oneDNN's first bf16 GEMM requests it before any MoE
        # layer runs; a process whose first AMX op is this one dies of SIGILL without it
        torch.cpu._init_amx()
        return "amx"
    return "vec"


def pad_intermediate(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad the intermediate dimension to a multiple of ``ALIGNMENT`` as ``_pad_moe_intermediate`` does:
    gate rows ``[0, I)``, up rows ``[P, P + I)`` of ``w13 [E, 2P, H]``; ``w2 [E, H, P]``."""
    e, two_i, h = gate_up.shape
    inter = two_i // 2
    pad = -inter % ALIGNMENT
    if pad == 0:
        return gate_up.contiguous(), down.contiguous()
    p = inter + pad
    w13 = gate_up.new_zeros(e, 2 * p, h)
    w13[:, :inter] = gate_up[:, :inter]
    w13[:, p : p + inter] = gate_up[:, inter:]
    w2 = down.new_zeros(e, h, p)
    w2[:, :, :inter] = down
    return w13, w2


def engine_fused_moe(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``cpu_fused_moe`` on ``x [T, H]`` (bf16) with HF-layout weights (``gate_up [E, 2I, H]``, gate rows first,
    ``down [E, H, I]``), routing ``weights``/``ids [T, k]``; returns ``[T, H]`` in ``x.dtype``."""
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    if x.dtype != torch.bfloat16 or x.shape[-1] % ALIGNMENT:
        raise AlignmentError(
            f"moe_variant=engine-op needs bf16 activations and a hidden size divisible by {ALIGNMENT} (vLLM CPU's "
            f"expert kernel), got {x.dtype} and {x.shape[-1]}; use moe_variant=emulate"
        )
    isa = engine_isa()
    # the engine holds the checkpoint's bf16 expert weights (a no-op for bf16 parameters)
    w13, w2 = pad_intermediate(gate_up.detach().to(x.dtype), down.detach().to(x.dtype))
    out = torch.empty_like(x)
    cpu_fused_moe(
        out,
        x.contiguous(),
        cpu_prepack_moe_weight(w13, isa),
        cpu_prepack_moe_weight(w2, isa),
        None,
        None,
        weights.float().contiguous(),  # .float(): the engine's router hands the op fp32 weights
        ids.to(torch.int32).contiguous(),
        "silu",
        isa,
    )
    return out


class _EngineExpertsFn(torch.autograd.Function):
    """Forward: ``cpu_fused_moe``. Backward: the emulated experts + combine recomputed and differentiated."""

    @staticmethod
    def forward(ctx, x, ids, weights, gate_up, down, rounding, rank):  # type: ignore[override]
        ctx.save_for_backward(x, ids, weights, gate_up, down)  # the full weights: a rank's slice is rebuilt
        ctx.rounding, ctx.rank = rounding, rank
        if rank is not None:
            gate_up, down = rank_experts(gate_up.detach(), down.detach(), *rank)
        return engine_fused_moe(x.detach(), gate_up, down, weights.detach(), ids)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[:5]
        with torch.enable_grad():
            leaves = [
                t.detach().requires_grad_(n) if n else t.detach() for t, n in zip(saved, needs, strict=True)
            ]
            x, ids, weights, gate_up, down = leaves
            y = mix_experts(x, ids, weights, gate_up, down, ctx.rounding, rank=ctx.rank)
            wanted = [t for t, n in zip(leaves, needs, strict=True) if n]
            got = iter(torch.autograd.grad(y, wanted, grad) if wanted else ())
        return (*(next(got) if n else None for n in needs), None, None)


def engine_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    rounding: MoeRounding,
    rank: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The routed experts + weighted combine of ``x [T, H]`` by the engine's op; gradients as
    ``mix_experts(x, ids, weights, gate_up, down, rounding)``'s (``rounding``: the emulated path's). ``rank=(r,
    tp)``: tensor-parallel rank ``r``'s part (its slice of the weights is rebuilt in backward, not kept)."""
    return _EngineExpertsFn.apply(x, ids, weights, gate_up, down, rounding, rank)
