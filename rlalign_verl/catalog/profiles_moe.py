"""MoE rounding data (:class:`MoeRounding`) and the engine paths' values; re-exported by :mod:`.profiles`.

Notation as in :mod:`.profiles`: ``R(.)`` rounds fp32 to bf16 (round-to-nearest-even).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

COMBINES = ("bf16", "fp32", "slot")
STORES = ("nearest", "truncate", "vllm-cpu-kernel")
"""How a kernel stores an fp32 result in bf16: round to nearest even (``R``), truncate (``T``: the low 16
bits dropped), or as vLLM's CPU C++ kernels do on this host (nearest with AVX512-BF16, else truncation;
:func:`rlalign_verl.catalog.placement.vllm_cpu_kernel_store`)."""
BLOCK_SUMS = ("bf16", "fp32", "fused")


@dataclass(frozen=True)
class MoeRounding:
    """Mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE).

    Expert internals belong to the swiglu region: ``expert_gemm`` "bf16" = each expert's gate_up GEMM
    output stored in bf16 (HF's per-expert ``F.linear``; its down GEMM output too, unless ``combine`` is
    "slot"), "fp32" = kept fp32 with SwiGLU applied to the fp32 GEMM output (a fused expert kernel);
    ``expert_act_roundings`` as :class:`~.profiles.SwigluRounding`. Router and combine belong to the moe
    region: ``router_softmax`` "all" = fp32 softmax over all experts, top-k of the probabilities,
    renormalised by division (HF); "topk" = top-k of the logits, softmax over those k only.
    ``weights_dtype``: routing weights rounded to "bf16" or kept "fp32". ``combine`` "bf16" =
    ``R(R(d_k) * w_k)`` added one expert at a time into a bf16 buffer (HF's ``index_add_``); "fp32" =
    ``R(sum_k w_k * d_k)`` with fp32 ``d_k`` (one rounding); "slot" = ``R(w_k * d_k)`` per slot from the
    down GEMM's fp32 accumulator, the slots then summed in slot order in bf16 (each add rounds) when
    ``top_k <= slot_sum_bf16_max_k``, else in fp32 with one rounding.
    ``block_sum``: Qwen2-MoE's block output ``sigmoid(gate) * shared + routed`` "bf16" = each op's output
    rounded (HF's eager ops), "fp32" = ``R(sigmoid(gate))`` times the bf16 shared output plus the bf16
    routed output in fp32, handed on unrounded into the next add + RMSNorm (applied with rmsnorm aligned);
    "fused" = one kernel from the block input: the gate logit ``x . w_gate`` accumulated in fp32 (never
    rounded), ``sigmoid``, product and sum in fp32, one rounding ``R(sigmoid(x . w_gate) * shared + routed)``
    (applied with moe aligned; the output is bf16, so it needs no rmsnorm).
    ``store`` (with ``expert_gemm`` or ``combine`` "fp32"): how the fused expert kernel stores its bf16 results,
    the SwiGLU output of the fp32 GEMM and the fp32 combined sum (one of :data:`STORES`).
    ``verified``: False for data read from source and not yet checked against the engine's ops; such a
    rounding is used only with the explicit opt-in ``unverified=("moe",)`` (:mod:`..unverified`).
    """

    expert_gemm: str = "bf16"
    expert_act_roundings: int = 2
    router_softmax: str = "all"
    weights_dtype: str = "bf16"
    combine: str = "bf16"
    slot_sum_bf16_max_k: int = 4
    block_sum: str = "bf16"
    store: str = "nearest"
    verified: bool = True

    def __post_init__(self) -> None:
        ok = (
            self.expert_gemm in ("bf16", "fp32")
            and self.expert_act_roundings in (1, 2)
            and self.router_softmax in ("all", "topk")
            and self.weights_dtype in ("bf16", "fp32")
            and self.combine in COMBINES
            and self.slot_sum_bf16_max_k >= 0
            and self.block_sum in BLOCK_SUMS
            and self.store in STORES
            and (self.store == "nearest" or "fp32" in (self.expert_gemm, self.combine))
        )
        if not ok:
            raise ValueError(f"invalid MoeRounding {self}")


# vLLM CPU: torch.ops._C.cpu_fused_moe (an opaque custom op on both execution paths) keeps both GEMM
# outputs fp32, rounds silu(g)*u once, sums w_k*d_k in fp32; CPURouter._softmax_topk takes the top-k of
# the bf16 logits and softmaxes those k. Eager: torch.softmax on bf16 rounds its output, then .float();
# compiled: the router is inside the Inductor graph, which drops that bf16 round trip (weights stay fp32).
# Compiled, Qwen2-MoE: Inductor fuses sigmoid(gate) * shared + routed into the next fused add + RMSNorm
# kernel; only the [T, 1] sigmoid is stored (bf16), product and sums stay fp32 (docs/moe.md, block_sum).
# Its bf16 stores follow the kernel build (csrc/cpu/cpu_types_x86.hpp): nearest with AVX512-BF16, else
# truncation (measured on an AVX2 host: 99.99% bit-identical with truncation, 17% with nearest).
CPU_FUSED_MOE = MoeRounding(
    expert_gemm="fp32", expert_act_roundings=1, router_softmax="topk", weights_dtype="bf16", combine="fp32",
    store="vllm-cpu-kernel",
)  # fmt: skip
CPU_FUSED_MOE_COMPILED = dataclasses.replace(CPU_FUSED_MOE, weights_dtype="fp32", block_sum="fp32")

# vLLM CUDA, unquantized Triton path (both vllm and vllm-eager: the experts run inside the opaque
# moe_forward op, so Inductor does not touch them). READ FROM SOURCE (vllm 0.31 line), NOT RUN ON A GPU:
# - fused_moe/fused_moe.py::fused_moe_kernel: w13 GEMM fp32 accumulator stored as accumulator.to(
#   compute_type) (bf16); w2 GEMM: MUL_ROUTED_WEIGHT multiplies the fp32 accumulator by the fp32 weight
#   before the bf16 store, i.e. R(w_k * d_k) per slot;
# - fused_moe/activation.py::apply_moe_activation -> torch.ops._C.silu_and_mul: R(R(silu(g)) * u);
# - csrc/moe/moe_align_sum_kernels.cu::moe_sum: moe_sum_kernel<scalar_t, TOPK> for top-k 2..4 (a
#   scalar_t running sum: each add rounds), default at::sum_out (fp32 accumulation, one rounding);
# - fused_moe/router/fused_topk_router.py::fused_topk -> csrc/moe/topk_softmax_kernels.cu: fp32 softmax
#   over all experts of the logits, top-k, fp32 renormalisation, fp32 weights.
# scripts/gpu_moe_check.py checks each of these fields against the real ops on a GPU.
CUDA_TRITON_MOE = MoeRounding(
    expert_gemm="bf16",
    expert_act_roundings=2,
    router_softmax="all",
    weights_dtype="fp32",
    combine="slot",
    slot_sum_bf16_max_k=4,
    verified=False,
)


# SGLang CUDA, unquantized Triton runner (default --moe-runner-backend auto: Qwen2-MoE on every CUDA GPU, Qwen3-MoE
# on SM90 and older; SM100 switches bf16 Qwen3-MoE to flashinfer_trtllm, not read). READ FROM SOURCE (sglang
# 0.5.23 wheel with sglang-kernel 0.4.10; moe_sum_reduce.cu from the sgl-project/sglang main tree), NOT RUN ON A GPU:
# - srt/layers/moe/topk.py::select_experts -> fused_topk -> kernels/ops/moe/moe_fused_gate.py::moe_fused_gate
#   (_router_triton_kernel, SCORING_FUNC softmax): bf16 logits loaded as fp32, softmax over all experts, top-k
#   ranked on the logit (lowest id wins ties), renormalised by fp32 division, fp32 weights;
# - srt/layers/moe/moe_runner/triton_utils/fused_moe.py::_fused_moe_kernel_sequence with
#   kernels/ops/moe/fused_moe_triton_kernels.py::fused_moe_kernel: w13 GEMM fp32 accumulator stored
#   accumulator.to(compute_type) (bf16); kernels/ops/activation/activation.py::silu_and_mul -> JIT
#   kernels/jit/csrc/elementwise/activation.cuh (default, not kRoundActivation): cast<T>(silu(g) * u) in fp32,
#   one rounding (the opt-in SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED up-GEMM epilogue rounds the same way);
#   w2 GEMM: MUL_ROUTED_WEIGHT multiplies the fp32 accumulator by the fp32 weight before the bf16 store,
#   R(w_k * d_k) per slot;
# - fused_moe.py::moe_combine_topk: top-k 2 torch.add of the two bf16 slots (one rounding of their exact sum);
#   top-k > 2 moe_sum_reduce_triton (<= 32 tokens, SM90+) / sgl_kernel moe_sum_reduce
#   (kernels/aot/csrc/moe/moe_sum_reduce.cu: every variant an fp32 acc over the slots, one __float2bfloat16_rn)
#   / torch.sum (<= 32 tokens, pre-SM90): an fp32 sum, one rounding;
# - srt/models/qwen2_moe.py::Qwen2MoeSparseMoeBlock.forward (use_fused_gate on CUDA) ->
#   kernels/ops/elementwise/elementwise.py::_fused_gate_sigmoid_mul_add_kernel: sigmoid(sum(h * w) in fp32) * s
#   + f in fp32, stored once into the bf16 routed output (block_sum="fused").
# Differs from vLLM's CUDA data in the expert SwiGLU (one rounding), the slot sum above top-k 2 and block_sum.
SGLANG_TRITON_MOE = dataclasses.replace(
    CUDA_TRITON_MOE, expert_act_roundings=1, slot_sum_bf16_max_k=2, block_sum="fused"
)
