"""MoE part of the GPU profile check: vLLM's CUDA router and Triton experts vs the roundings in docs/moe.md.

Run on a CUDA machine with vLLM installed: ``python scripts/gpu_moe_check.py [--json out.json]``. Without
CUDA it prints one ``skipped`` line and exits 0. For each candidate rounding it prints the fraction of
bit-identical outputs against the engine's ops (``fused_topk`` and ``fused_experts``):

- ``cuda-doc``: what docs/moe.md reads from the source — bf16 w13 GEMM output, ``R(R(silu(g))*u)``, the w2
  fp32 accumulator times the fp32 routing weight rounded per slot, slots summed in bf16 (``moe_sum``);
- ``hf`` and ``cpu-fused``: the two roundings implemented in ``rlalign_verl.regions.moe``.

A CUDA ``MoeRounding`` is written only once ``cuda-doc`` is (near) 100% here.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F


def cuda_doc_experts(x, gate_up, down, weights, ids) -> torch.Tensor:
    """The Triton path as read from source (see the module docstring); ``x [T, H]`` bf16."""
    dtype, inter = x.dtype, down.shape[-1]
    out = None
    for k in range(ids.shape[1]):
        e = ids[:, k].long()
        gu = torch.einsum("th,tih->ti", x.float(), gate_up[e].float()).to(dtype)  # stored bf16
        a = (F.silu(gu[:, :inter].float()).to(dtype).float() * gu[:, inter:].float()).to(dtype)
        d = torch.einsum("ti,thi->th", a.float(), down[e].float())  # fp32 accumulator
        slot = (d * weights[:, k : k + 1].float()).to(dtype)  # MUL_ROUTED_WEIGHT before the store
        out = slot if out is None else (out.float() + slot.float()).to(dtype)  # moe_sum in scalar_t
    return out


def moe_rows(device: str = "cuda", seed: int = 0) -> dict[str, float]:
    """``{candidate: fraction bit-identical}`` for the router weights and the experts' output."""
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

    from rlalign_verl.profiles import HF, MoeRounding
    from rlalign_verl.regions.moe import mix_experts, route

    g = torch.Generator(device="cpu").manual_seed(seed)
    T, H, inter, E, K = 256, 1024, 512, 8, 2
    bf = torch.bfloat16
    x = torch.randn(T, H, generator=g).to(bf).to(device)
    gate_up = (torch.randn(E, 2 * inter, H, generator=g) * 0.03).to(bf).to(device)
    down = (torch.randn(E, H, inter, generator=g) * 0.03).to(bf).to(device)
    logits = (torch.randn(T, E, generator=g) * 2).to(bf).to(device)
    w_eng, ids, _ = fused_topk(x, logits, K, True)
    ours_w, ours_ids = route(logits, K, True, MoeRounding(router_softmax="all", weights_dtype="fp32"))
    same_ids = torch.equal(ours_ids.sort(-1).values, ids.long().sort(-1).values)
    w_ours_sorted = ours_w.gather(1, ours_ids.argsort(-1))
    w_eng_sorted = w_eng.gather(1, ids.long().argsort(-1))
    y_eng = fused_experts(x, gate_up, down, w_eng, ids)
    rows = {
        "router_ids_identical": float(same_ids),
        "router_weights_fp32_softmax_all": (w_ours_sorted == w_eng_sorted).float().mean().item(),
        "experts_cuda-doc": (cuda_doc_experts(x, gate_up, down, w_eng, ids) == y_eng).float().mean().item(),
        "experts_hf": (mix_experts(x, ids.long(), w_eng.to(bf), gate_up, down, HF.moe) == y_eng)
        .float()
        .mean()
        .item(),
    }
    from rlalign_verl.profiles import CPU_FUSED_MOE

    fused = mix_experts(x, ids.long(), w_eng, gate_up, down, CPU_FUSED_MOE)
    rows["experts_cpu-fused"] = (fused == y_eng).float().mean().item()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_moe_check: skipped: no CUDA device (run on a GPU machine with vLLM installed)")
        return 0
    rows = moe_rows()
    for name, frac in rows.items():
        print(f"{name:<36} {100 * frac:8.3f}% bit-identical")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
