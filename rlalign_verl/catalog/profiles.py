"""Engine profiles: where each inference-engine execution path rounds to BF16, as data.

Notation used in every docstring here: ``R(.)`` rounds an fp32 value to the activation dtype
(bf16) with round-to-nearest-even; everything inside ``R`` is fp32. ``s = h + r`` is the fp32 sum
of the incoming hidden state and the residual; ``rt(v) = rsqrt(mean(v**2) + eps)``.

A profile is one frozen object per engine *execution path* (the same engine rounds differently
compiled vs eager). The region functions in :mod:`rlalign_verl.align.regions` read only these fields;
there is no per-engine code anywhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from rlalign_verl.base.errors import UnknownProfileError
from rlalign_verl.catalog.fingerprint import VerifiedOn
from rlalign_verl.catalog.profiles_moe import (
    CPU_FUSED_MOE,
    CPU_FUSED_MOE_COMPILED,
    CUDA_TRITON_MOE,
    SGLANG_TRITON_MOE,
    STORES,
    MoeRounding,
)


class Residual(str, Enum):
    """Where the residual stream between decoder layers is rounded to bf16."""

    EVERY_ADD = "every_add"
    """Stored in bf16 after every residual add (eager kernels; HF itself)."""
    AT_ATTENTION = "at_attention"
    """Graph split at attention (vLLM's piecewise CUDA graphs): rounded once per layer, where it
    leaves the compiled piece before attention (i.e. at the input norm); the post-attention sum is
    never stored, so it crosses the decoder-layer boundary in fp32."""
    NEVER = "never"
    """The whole model is one compiled graph: the residual stays fp32 across all layers."""


class Source(str, Enum):
    """Which tensor a residual RMSNorm reads: the fp32 sum ``s`` or its bf16 rounding ``R(s)``."""

    FP32_SUM = "fp32_sum"
    ROUNDED_SUM = "rounded_sum"


class Mean(str, Enum):
    """How the mean of squares is formed."""

    MEAN = "mean"
    """``torch.mean`` (what HF and vLLM's native PyTorch ops call)."""
    SUM_DIV_N = "sum_div_n"
    """``sum(v**2) / N`` (what the CUDA kernels do; differs from ``mean`` when N is no power of two)."""


@dataclass(frozen=True)
class RopeRounding:
    """RoPE (NeoX / rotate-half style).

    ``table``: dtype of the cos/sin table the rotation reads ("bf16": computed in fp32, then
    rounded; "fp32": never rounded). ``roundings``: 3 = ``R(R(x1*c) - R(x2*s))`` (bf16 eager ops,
    as in HF), 1 = ``R(x1*c - x2*s)`` in fp32. ``store`` (``roundings=1`` only): how the fp32 rotation
    is stored in bf16: ``"nearest"`` (round-to-nearest-even, ``R``), ``"truncate"`` (the low 16 bits
    dropped, ``T``), or ``"vllm-cpu-kernel"``: what vLLM's CPU C++ kernel does on this host, nearest with
    AVX512-BF16 and truncation without (:func:`rlalign_verl.catalog.placement.vllm_cpu_kernel_store`).
    """

    table: str = "bf16"
    roundings: int = 3
    store: str = "nearest"

    def __post_init__(self) -> None:
        if self.table not in ("bf16", "fp32") or self.roundings not in (1, 3):
            raise ValueError(f"invalid RopeRounding {self}")
        if self.store not in STORES or (self.store != "nearest" and self.roundings != 1):
            raise ValueError(f"invalid RopeRounding {self}")


@dataclass(frozen=True)
class SwigluRounding:
    """SwiGLU ``silu(g) * u``. ``roundings``: 2 = ``R(R(silu(g)) * u)``, 1 = ``R(silu(g) * u)``."""

    roundings: int = 2

    def __post_init__(self) -> None:
        if self.roundings not in (1, 2):
            raise ValueError(f"invalid SwigluRounding {self}")


@dataclass(frozen=True)
class NormRounding:
    """RMSNorm, with and without the fused residual add.

    ``variance``: the tensor the mean of squares is taken over. ``normalize``: the tensor that is
    multiplied by ``rt``. ``output_roundings``: 2 = ``R(R(v*rt) * w)`` (also HF's
    ``R(w * R(v*rt))``: the product of two bf16 values is exact in fp32, so the order of ``w`` does
    not matter), 1 = ``R(v*rt*w)``. ``mean``: see :class:`Mean`. Without a residual there is no
    sum and ``variance``/``normalize`` do not apply.
    """

    variance: Source = Source.ROUNDED_SUM
    normalize: Source = Source.ROUNDED_SUM
    output_roundings: int = 2
    mean: Mean = Mean.MEAN

    def __post_init__(self) -> None:
        if self.output_roundings not in (1, 2):
            raise ValueError(f"invalid NormRounding {self}")


@dataclass(frozen=True)
class EngineProfile:
    """Where one engine execution path rounds, per region.

    ``residual`` and ``qk_norm_rounded_before_rope`` belong to the rmsnorm region (the residual
    stream is what the fused add + norm produces); ``qk_norm_rounded_before_rope`` only matters when
    both the rmsnorm and the rope region are aligned (Qwen3's q/k-norm feeding RoPE).
    """

    name: str
    summary: str
    rope: RopeRounding
    swiglu: SwigluRounding
    norm: NormRounding
    residual: Residual
    qk_norm_rounded_before_rope: bool
    engine: str
    """The rollout engine this path belongs to ("hf", "vllm", "sglang")."""
    device: str
    """"cpu" or "cuda"."""
    verified: str
    """How the profile was established: what was run against which real op, or "read from source"."""
    sources: tuple[str, ...] = ()
    moe: MoeRounding | None = None
    """MoE experts, router and combine; ``None``: not established for this path (MoE models then refuse
    the swiglu and moe regions with this profile)."""
    norm_inductor: tuple[tuple[str, object], ...] = ()
    """The Inductor options the engine compiles its norms with, as ``(key, value)`` pairs; empty: the path
    runs no Inductor-compiled norm the trainer can reproduce (``compiled_norm`` is then refused)."""
    verified_on: tuple[VerifiedOn, ...] = ()
    """The (engine, versions, path, device) a recorded check ran this profile against; a run elsewhere is
    unverified and verifies itself at step 1 (:mod:`rlalign_verl.catalog.fingerprint`)."""

    def with_name(self, name: str, **changes: object) -> EngineProfile:
        """A copy under another name with some fields changed (for user-defined variants)."""
        return dataclasses.replace(self, name=name, **changes)


# --- the training stack itself -------------------------------------------------------------

HF = EngineProfile(
    name="hf",
    summary="HF transformers' own bf16 rounding (aligning to it changes nothing; used to verify the patcher)",
    rope=RopeRounding(table="bf16", roundings=3),
    swiglu=SwigluRounding(roundings=2),
    norm=NormRounding(Source.ROUNDED_SUM, Source.ROUNDED_SUM, output_roundings=2, mean=Mean.MEAN),
    residual=Residual.EVERY_ADD,
    qk_norm_rounded_before_rope=True,
    moe=MoeRounding(),
    engine="hf",
    device="any",
    verified="bit-identical logits to unpatched HF Qwen2/Qwen3/Llama (tests/align/test_patch_model.py)",
    sources=("transformers/models/qwen2/modeling_qwen2.py (5.10.4)",),
)

# --- vLLM CPU build ------------------------------------------------------------------------

VLLM_CPU = EngineProfile(
    name="vllm-cpu",
    summary=(
        "vLLM CPU build, default config: the whole model is one Inductor graph; fp32 residual stream "
        "across all layers, each norm output R(s*rt(s)*w), SwiGLU R(silu(g)*u), RoPE R(x1*c - x2*s) with "
        "a bf16 table, Qwen3 q/k-norm handed to RoPE unrounded"
    ),
    rope=RopeRounding(table="bf16", roundings=1),
    swiglu=SwigluRounding(roundings=1),
    norm=NormRounding(Source.FP32_SUM, Source.FP32_SUM, output_roundings=1, mean=Mean.MEAN),
    residual=Residual.NEVER,
    qk_norm_rounded_before_rope=False,
    moe=CPU_FUSED_MOE_COMPILED,
    # vllm/platforms/cpu.py check_and_update_config: the whole-model compile's inductor_compile_config
    norm_inductor=(
        ("dce", True),
        ("size_asserts", False),
        ("nan_asserts", False),
        ("epilogue_fusion", True),
        ("cpp.dynamic_threads", True),
    ),
    engine="vllm",
    device="cpu",
    verified_on=(
        VerifiedOn(
            "vllm",
            "==0.31.0",
            "compiled",
            "cpu",
            "tests/align/test_engine_ops.py op by op, tests/tools/test_exact_zero_gap.py",
        ),
        # the version matrix (scripts/test_matrix.sh, .venv-vllm032): op by op and diagnose's default run
        VerifiedOn(
            "vllm",
            "==0.32.0",
            "compiled",
            "cpu",
            "tests/align/test_engine_ops.py op by op on the version matrix",
        ),
    ),
    verified=(
        "verified here against vllm-cpu 0.31.0: each region vs the engine's own op module compiled "
        "with Inductor (tests/align/test_engine_ops.py), and end to end vs log-probs of the real compiled "
        "engine (tests/align/test_engine_e2e.py)"
    ),
    sources=(
        "vllm/platforms/cpu.py (whole-model compilation on CPU)",
        "vllm/ir/ops/layernorm.py (native rms_norm / fused_add_rms_norm)",
        "vllm/model_executor/layers/activation.py (SiluAndMul.forward_native)",
        "vllm/model_executor/layers/rotary_embedding/base.py (forward_native)",
    ),
)

VLLM_CPU_EAGER = EngineProfile(
    name="vllm-cpu-eager",
    summary=(
        "vLLM CPU build with enforce_eager=True: norms and SiluAndMul run their PyTorch forward_native "
        "eagerly (residual R(s) stored, variance and normalisation from the fp32 s, R(R(s*rt(s))*w)); "
        "RoPE runs the C++ op torch.ops._C.rotary_embedding, R(x1*c - x2*s) with a bf16 table, stored "
        "by truncation where vLLM loads its kernels built without AVX512-BF16 (_C_AVX2, _C_AVX512)"
    ),
    # csrc/cpu/cpu_types_x86.hpp: BF16Vec8/16 from FP32Vec8/16 is _mm*_cvtneps_pbh (nearest) only with
    # __AVX512BF16__, else a 16-bit shift (truncation); vllm/platforms/cpu.py import_kernels picks the build
    rope=RopeRounding(table="bf16", roundings=1, store="vllm-cpu-kernel"),
    swiglu=SwigluRounding(roundings=2),
    norm=NormRounding(Source.FP32_SUM, Source.FP32_SUM, output_roundings=2, mean=Mean.MEAN),
    residual=Residual.EVERY_ADD,
    qk_norm_rounded_before_rope=True,
    moe=CPU_FUSED_MOE,
    engine="vllm",
    device="cpu",
    verified_on=(
        VerifiedOn(
            "vllm",
            "==0.31.0",
            "eager",
            "cpu",
            "tests/align/test_engine_ops.py op by op, tests/tools/test_exact_zero_gap.py",
        ),
        # the version matrix (scripts/test_matrix.sh, .venv-vllm032): op by op and diagnose's default run
        VerifiedOn(
            "vllm",
            "==0.32.0",
            "eager",
            "cpu",
            "tests/align/test_engine_ops.py op by op on the version matrix",
        ),
    ),
    verified=(
        "verified here against vllm-cpu 0.31.0: bit-identical to RMSNorm (with and without residual), "
        "SiluAndMul and get_rope's rotary embedding run eagerly (tests/align/test_engine_ops.py), and end to "
        "end vs the real engine with enforce_eager=True (tests/align/test_engine_e2e.py)"
    ),
    sources=(
        "vllm/ir/ops/layernorm.py (native rms_norm / fused_add_rms_norm)",
        "vllm/model_executor/layers/activation.py (SiluAndMul.forward_native)",
        "csrc/cpu/pos_encoding.cpp (rotary_embedding)",
    ),
)

# --- vLLM on CUDA --------------------------------------------------------------------------

VLLM = EngineProfile(
    name="vllm",
    summary=(
        "vLLM V1 default on GPUs (what verl launches): Inductor-compiled native ops, graph split at "
        "attention; residual rounded once per layer where it leaves the piece before attention, the "
        "post-attention sum crosses the layer boundary in fp32; norms R(s*rt(s)*w) with the mean of "
        "squares lowered to sum/N, SwiGLU R(silu(g)*u), RoPE R(x1*c - x2*s) with a bf16 table, Qwen3 "
        "q/k-norm fused into RoPE unrounded"
    ),
    rope=RopeRounding(table="bf16", roundings=1),
    swiglu=SwigluRounding(roundings=1),
    norm=NormRounding(Source.FP32_SUM, Source.FP32_SUM, output_roundings=1, mean=Mean.SUM_DIV_N),
    residual=Residual.AT_ATTENTION,
    qk_norm_rounded_before_rope=False,
    moe=CUDA_TRITON_MOE,  # UNVERIFIED (read from source): opt-in, see profiles_moe.py
    engine="vllm",
    device="cuda",
    verified=(
        "rounding locations verified on vllm-cpu 0.31.0 run piecewise (test-only override of the CPU "
        "platform's one-graph mode): every piece bit-identical to a reference from these fields, 9/9 "
        "single-field mutations killed (scripts/piecewise_probe.py), end to end at the piecewise floor "
        "(scripts/piecewise_cpu_check.py); not run on a GPU yet: scripts/gpu_profile_check.py compares each "
        "region with the Inductor-compiled native op on CUDA. Not bit-exact there by construction: Triton's "
        "approximate fp32 division/exp/rsqrt and the reduction order"
    ),
    sources=(
        "vllm 0.31.0 vllm/config/vllm.py VllmConfig.__post_init__ (custom_ops 'none' under Inductor; "
        "enforce_eager -> CompilationMode.NONE)",
        "vllm 0.31.0 vllm/platforms/cuda.py CudaPlatform.get_default_ir_op_priority (['native'] when "
        "compiling with Inductor)",
        "vllm 0.31.0 vllm/config/compilation.py CompilationConfig.set_splitting_ops_for_v1 / _attention_ops "
        "(graph split at unified_attention_with_output + unified_kv_cache_update)",
        "vllm 0.31.0 vllm/config/vllm.py OPTIMIZATION_LEVEL_02 pass_config (enable_qk_norm_rope_fusion "
        "False; fuse_allreduce_rms only for TP>1 on SM90/SM100 with FlashInfer)",
        "vllm 0.31.0 vllm/ir/ops/layernorm.py rms_norm / fused_add_rms_norm (native)",
        "vllm 0.31.0 vllm/model_executor/layers/activation.py SiluAndMul.forward_native",
        "vllm 0.31.0 vllm/model_executor/layers/rotary_embedding/base.py RotaryEmbedding.forward_static, "
        "_compute_cos_sin_cache (fp32 on the GPU, then .to(model dtype))",
        "torch 2.13 torch/_inductor/config.py emulate_precision_casts=False, "
        "eager_numerics.division_rounding=False; torch/_inductor/lowering.py mean -> div(sum, N)",
    ),
)

VLLM_EAGER = EngineProfile(
    name="vllm-eager",
    summary=(
        "vLLM with enforce_eager=True on GPUs: custom CUDA kernels (IR priority vllm_c, custom ops 'all'). "
        "rms_norm R(x*rt(x)*w); fused_add_rms_norm stores R(s) and takes variance and normalisation from "
        "it, R(R(s)*rt(R(s))*w); sum/N; SiluAndMul R(R(silu(g))*u); rotary_embedding R(x1*c - x2*s) with "
        "a bf16 table"
    ),
    rope=RopeRounding(table="bf16", roundings=1),
    swiglu=SwigluRounding(roundings=2),
    norm=NormRounding(Source.ROUNDED_SUM, Source.ROUNDED_SUM, output_roundings=1, mean=Mean.SUM_DIV_N),
    residual=Residual.EVERY_ADD,
    qk_norm_rounded_before_rope=True,
    moe=CUDA_TRITON_MOE,  # UNVERIFIED (read from source): opt-in, see profiles_moe.py
    engine="vllm",
    device="cuda",
    verified=(
        "read from source (vLLM CUDA kernels of the 0.31 line; the kernel wrappers and op schemas match the "
        "installed vllm 0.31.0 Python); not run on a GPU yet: scripts/gpu_profile_check.py compares each "
        "region with torch.ops._C on CUDA. Caveat: the single output rounding of both norm kernels was "
        "reverted and re-applied upstream (PRs #40860, #42379, #46070; open: #49639 two roundings, #52243 "
        "variance from the fp32 sum), so re-check per vLLM version"
    ),
    sources=(
        "vllm-project/vllm csrc/libtorch_stable/layernorm_kernels.cu @0b9c5412 rms_norm_kernel "
        "(static_cast<scalar_t>(x * s_variance * w), rsqrtf(variance / hidden_size + eps))",
        "vllm-project/vllm csrc/libtorch_stable/layernorm_kernels.cu @0b9c5412 fused_add_rms_norm_kernel "
        "(both specialisations: residual = R(input + residual) stored, variance and output from it, "
        "one rounding)",
        "vllm-project/vllm csrc/libtorch_stable/activation_kernels.cu @04c8ba43 silu_kernel / "
        "packed_silu_kernel (silu rounded to scalar_t) + compute/packed_compute (product rounded)",
        "vllm-project/vllm csrc/libtorch_stable/pos_encoding_kernels.cu @1051220e "
        "apply_token_rotary_embedding (fp32 x*cos - y*sin, one rounding; cache dtype = query dtype)",
        "vllm 0.31.0 vllm/platforms/cuda.py get_default_ir_op_priority (['vllm_c', 'native'] without "
        "Inductor); vllm/kernels/vllm_c.py rms_norm / fused_add_rms_norm -> torch.ops._C",
        "vllm 0.31.0 vllm/model_executor/layers/rotary_embedding/base.py forward_cuda -> ops.rotary_embedding "
        "with the bf16 cos_sin_cache (computed in fp32 on the GPU at init, cast to the model dtype)",
    ),
)

# --- SGLang --------------------------------------------------------------------------------

SGLANG = EngineProfile(
    name="sglang",
    summary=(
        "SGLang's CUDA kernels (default, no --rl-on-policy-target): fp32 cos/sin table never rounded, "
        "RoPE rounded once; fused add+RMSNorm stores R(s), variance and output from the fp32 s, "
        "R(s*rt(s)*w), sum/N; plain RMSNorm R(x*rt(x)*w); SwiGLU R(silu(g)*u)"
    ),
    rope=RopeRounding(table="fp32", roundings=1),
    swiglu=SwigluRounding(roundings=1),
    norm=NormRounding(Source.FP32_SUM, Source.FP32_SUM, output_roundings=1, mean=Mean.SUM_DIV_N),
    residual=Residual.EVERY_ADD,
    qk_norm_rounded_before_rope=True,
    moe=SGLANG_TRITON_MOE,  # UNVERIFIED (read from source): opt-in, see profiles_moe.py
    engine="sglang",
    device="cuda",
    verified=(
        "read from source (SGLang main, 2026, sgl-kernel built against FlashInfer bc29697b = v0.3.1-22); "
        "not run on a GPU yet: scripts/gpu_profile_check.py compares with sgl_kernel when it is installed. "
        "Not bit-exact by construction: rsqrt.approx, the SM90 build's -use_fast_math (approximate "
        "exp/division), and FMA contraction in the fp32-table rotation. MoE rounding read from sglang 0.5.23, "
        "UNVERIFIED and opt-in (scripts/gpu_moe_check.py checks it where sglang is installed)"
    ),
    sources=(
        "sgl-project/sglang python/sglang/srt/layers/layernorm.py RMSNorm.forward_cuda -> "
        "sgl_kernel.rmsnorm / fused_add_rmsnorm",
        "sgl-project/sglang python/sglang/kernels/aot/csrc/elementwise/fused_add_rms_norm_kernel.cu "
        "sgl_fused_add_rmsnorm -> flashinfer norm::FusedAddRMSNorm",
        "flashinfer-ai/flashinfer include/flashinfer/norm.cuh @bc29697b FusedAddRMSNormKernel (fp32 sum "
        "staged in smem_x, residual (T)x, output x*rms_rcp*w), RMSNormKernel",
        "sgl-project/sglang python/sglang/kernels/aot/csrc/elementwise/activation.cu silu_and_mul -> "
        "flashinfer activation::act_and_mul_kernel<silu> (silu in fp32, one rounding)",
        "sgl-project/sglang python/sglang/srt/layers/rotary_embedding.py RotaryEmbedding.__init__ "
        "(cache kept fp32 on CUDA) / forward_cuda -> apply_rope_with_cos_sin_cache_inplace",
        "flashinfer-ai/flashinfer include/flashinfer/pos_enc.cuh @bc29697b vec_apply_llama_rope_cos_sin",
        "sgl-project/sglang python/sglang/kernels/aot/CMakeLists.txt (flashinfer pin; SM90 build with "
        "-use_fast_math, SM100 build precise)",
        "sgl-project/sglang python/sglang/srt/models/utils.py apply_qk_norm (Qwen3 q/k-norm: JIT "
        "fused_inplace_qknorm or RMSNorm, written to bf16 before RoPE; the fused qk-norm+RoPE kernel is "
        "off by default, --enable-fused-qk-norm-rope)",
        "sglang 0.5.23 srt/layers/moe/topk.py fused_topk -> kernels/ops/moe/moe_fused_gate.py moe_fused_gate "
        "(fp32 softmax over all experts, top-k, fp32 renormalisation; MoE data UNVERIFIED, profiles_moe.py)",
        "sglang 0.5.23 srt/layers/moe/moe_runner/triton_utils/fused_moe.py _fused_moe_kernel_sequence / "
        "moe_combine_topk, kernels/ops/moe/fused_moe_triton_kernels.py fused_moe_kernel (bf16 w13 output, "
        "R(w*d) per slot), kernels/jit/csrc/elementwise/activation.cuh (R(silu(g)*u)), "
        "kernels/aot/csrc/moe/moe_sum_reduce.cu (fp32 slot sum)",
        "sglang 0.5.23 srt/models/qwen2_moe.py Qwen2MoeSparseMoeBlock.forward -> kernels/ops/elementwise/"
        "elementwise.py fused_gate_sigmoid_mul_add (fp32 gate logit, sigmoid, product and sum; one rounding)",
    ),
)

INDISTINGUISHABLE_ON_CPU: dict[str, str] = {
    "norm.mean": (
        "MEAN and SUM_DIV_N agree in float64, and torch's CPU mean gives the same bits as sum/N, so nothing "
        "on this CPU separates them (on CUDA Inductor's approximate division and the kernels' block sums do); "
        "tests/align/test_profile_mutations.py checks SUM_DIV_N's defining property instead: the variance is the "
        "correctly rounded fp32 sum/N"
    ),
}
"""Profile fields whose values this CPU cannot tell apart through a float64 reference, and why."""

PROFILES: dict[str, EngineProfile] = {
    p.name: p for p in (VLLM, VLLM_EAGER, VLLM_CPU, VLLM_CPU_EAGER, SGLANG, HF)
}
DEFAULT_PROFILE = "vllm"


def get_profile(name: str | EngineProfile) -> EngineProfile:
    """The profile called ``name`` (a profile object passes through); a clear error otherwise."""
    if isinstance(name, EngineProfile):
        return name
    key = str(name).strip().lower()
    if key not in PROFILES:
        raise UnknownProfileError(
            f"unknown engine profile {name!r}; valid profiles: {', '.join(PROFILES)} "
            f"(set alignment.engine / engine= to one of them)"
        )
    return PROFILES[key]
