"""MoE part of the GPU profile check: vLLM's CUDA router and Triton experts vs the roundings in docs/moe.md.

Run on a CUDA machine with vLLM installed: ``python scripts/gpu_moe_check.py [--json out.json]``. Without
CUDA it prints one ``skipped`` line and exits 0. For each candidate rounding it prints the fraction of
bit-identical outputs against the engine's ops (``fused_topk`` and ``fused_experts``):

- ``profile``: the vllm / vllm-eager profiles' ``MoeRounding`` (``CUDA_TRITON_MOE``, UNVERIFIED data read
  from source: bf16 w13 GEMM output, ``R(R(silu(g))*u)``, ``R(w_k*d_k)`` per slot from the fp32 accumulator,
  slots summed in bf16 up to top-k 4, fp32 router softmax over all experts, fp32 weights), and the same with
  each field changed to its other value(s);
- ``cuda-doc`` (an independent restatement of the same reading), ``hf`` and ``cpu-fused``.

Where ``sglang`` imports, the same rows (prefixed ``sglang``) for the ``sglang`` profile's ``SGLANG_TRITON_MOE``
(UNVERIFIED, read from sglang 0.5.23) against SGLang's own ops: ``moe_fused_gate`` (router),
``triton_utils.fused_moe.fused_experts`` (experts + ``moe_combine_topk``) and ``fused_gate_sigmoid_mul_add``
(Qwen2-MoE's gated shared + routed sum: rows ``block_sum[...]``, each ``block_sum`` value). Without it one
``sglang rows skipped`` line; a machine where neither engine imports compares nothing and fails.

Exit 1 when a field misses: expert ids not identical, a one-field mutation closer to the engine than the
profile, or the profile's experts (or SGLang's block sum) below 99% bit-identical (top-k 2 and 8). Then the
data must change before ``verified`` is set.
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


def _inputs(device: str, seed: int, top_k: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    T, H, inter, E = 256, 1024, 512, 16
    bf = torch.bfloat16
    x = torch.randn(T, H, generator=g).to(bf).to(device)
    gate_up = (torch.randn(E, 2 * inter, H, generator=g) * 0.03).to(bf).to(device)
    down = (torch.randn(E, H, inter, generator=g) * 0.03).to(bf).to(device)
    logits = (torch.randn(T, E, generator=g) * 2).to(bf).to(device)
    return x, gate_up, down, logits


def _same(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


def router_rows_against(logits, top_k: int, renormalize: bool, prof, w_eng, ids) -> dict[str, float]:
    """``router_ids[...]`` / ``router_weights[...]``: the profile's router (``prof``, a MoE rounding) and its
    ``router_softmax=topk`` variant vs the engine's weights ``w_eng`` and expert ids ``ids``, in expert order."""
    import dataclasses

    from rlalign_verl.align.regions.moe import route

    order = ids.long().argsort(-1)
    rows: dict[str, float] = {}
    for name, r in (
        ("profile", prof),
        ("router_softmax=topk", dataclasses.replace(prof, router_softmax="topk")),
    ):
        w, i = route(logits, top_k, renormalize, r)
        rows[f"router_ids[{name}]"] = float(torch.equal(i.sort(-1).values, ids.long().sort(-1).values))
        rows[f"router_weights[{name}]"] = _same(w.float().gather(1, i.argsort(-1)), w_eng.gather(1, order))
    return rows


def moe_rows(device: str = "cuda", seed: int = 0, top_k: int = 2) -> dict[str, float]:
    """``{row: fraction bit-identical}``: the vllm profile's MoE rounding (and each one-field mutation of it)
    vs vLLM's ``fused_topk`` (router) and Triton ``fused_experts`` (experts + combine)."""

    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

    from rlalign_verl.align.regions.moe import mix_experts
    from rlalign_verl.catalog.profiles import CPU_FUSED_MOE, HF, get_profile

    prof = get_profile("vllm").moe
    x, gate_up, down, logits = _inputs(device, seed, top_k)
    w_eng, ids, _ = fused_topk(x, logits, top_k, True)
    rows = router_rows_against(logits, top_k, True, prof, w_eng, ids)
    y_eng = fused_experts(x, gate_up, down, w_eng, ids)
    for name, r in _mutations(prof, top_k).items():
        w = w_eng if r.weights_dtype == "fp32" else w_eng.to(torch.bfloat16)
        rows[f"experts[{name}]"] = _same(mix_experts(x, ids.long(), w, gate_up, down, r), y_eng)
    rows["experts[hf]"] = _same(
        mix_experts(x, ids.long(), w_eng.to(torch.bfloat16), gate_up, down, HF.moe), y_eng
    )
    rows["experts[cpu-fused]"] = _same(mix_experts(x, ids.long(), w_eng, gate_up, down, CPU_FUSED_MOE), y_eng)
    rows["experts[cuda-doc]"] = _same(cuda_doc_experts(x, gate_up, down, w_eng, ids), y_eng)
    return rows


def _mutations(prof, top_k: int) -> dict:
    """The profile and each expert/combine field changed to its other value(s)."""
    import dataclasses

    out = {"profile": prof}
    for field, values in (
        ("expert_gemm", ("bf16", "fp32")),
        ("expert_act_roundings", (1, 2)),
        ("combine", ("bf16", "fp32", "slot")),
    ):
        for v in values:
            if v != getattr(prof, field):
                out[f"{field}={v}"] = dataclasses.replace(prof, **{field: v})
    # the threshold that switches this top-k between the bf16 running sum and the fp32 sum (for two
    # slots both give R(s_0 + s_1): the fp32 sum of two bf16 values is exact, so only top-k > 2 tells)
    if top_k > 2:
        flip = top_k if top_k > prof.slot_sum_bf16_max_k else top_k - 1
        out[f"slot_sum_bf16_max_k={flip}"] = dataclasses.replace(prof, slot_sum_bf16_max_k=flip)
    return out


EXPERTS_MIN = (
    0.99  # the GEMMs' accumulation order differs (Triton tiles vs torch); rounding points must match
)


def misses(rows: dict[str, float]) -> list[str]:
    """The checks that fail: ids identical, weights and experts of the profile at least as close as every
    one-field mutation, and experts >= EXPERTS_MIN bit-identical."""
    out = []
    if rows["router_ids[profile]"] != 1.0:
        out.append("router: expert ids differ")
    if rows["router_weights[profile]"] < rows["router_weights[router_softmax=topk]"]:
        out.append("router: router_softmax=topk is closer")
    ours = rows["experts[profile]"]
    if ours < EXPERTS_MIN:
        out.append(f"experts: {100 * ours:.3f}% < {100 * EXPERTS_MIN:.0f}% bit-identical")
    out += [f"experts: {k} is closer" for k, v in rows.items() if k.startswith("experts[") and v > ours]
    return out


def block_candidates(x, gate_w, shared, routed) -> dict:
    """Qwen2-MoE's block output under each ``block_sum`` value (``x`` the block input, ``gate_w`` ``[1, H]``)."""
    from rlalign_verl.align.regions.moe import fused_gate_sum

    bf = x.dtype
    sig = torch.sigmoid(F.linear(x, gate_w))  # the gate Linear and the sigmoid, each stored in bf16
    return {
        "profile": fused_gate_sum(x, gate_w, shared, routed),  # block_sum="fused"
        "fp32": (sig.float() * shared.float() + routed.float()).to(bf),  # Inductor's fp32 sum, rounded here
        "bf16": (sig * shared) + routed,  # eager ops, each output rounded
    }


def sglang_rows(device: str = "cuda", seed: int = 0, top_k: int = 2) -> dict[str, float] | None:
    """The rows of :func:`moe_rows` and ``block_sum[...]`` for the ``sglang`` profile vs SGLang's own ops;
    ``None`` (with one printed line) where ``sglang`` does not import."""

    try:
        from sglang.kernels.ops.elementwise.elementwise import fused_gate_sigmoid_mul_add
        from sglang.kernels.ops.moe.moe_fused_gate import moe_fused_gate
        from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
    except Exception as exc:  # not installed, or a build that cannot load here: nothing to compare
        print(f"gpu_moe_check: sglang rows skipped: {type(exc).__name__}: {exc}")
        return None
    from rlalign_verl.align.regions.moe import mix_experts
    from rlalign_verl.catalog.profiles import CPU_FUSED_MOE, HF, get_profile

    prof = get_profile("sglang").moe
    x, gate_up, down, logits = _inputs(device, seed, top_k)
    w_eng, ids = moe_fused_gate(logits, None, top_k, scoring_func="softmax", renormalize=True)
    rows = router_rows_against(logits, top_k, True, prof, w_eng, ids)
    n_exp = gate_up.shape[0]
    config = MoeRunnerConfig(num_experts=n_exp, num_local_experts=n_exp, top_k=top_k, inplace=False)
    y_eng = fused_experts(x, gate_up, down, (w_eng, ids, logits), config)
    for name, r in _mutations(prof, top_k).items():
        w = w_eng if r.weights_dtype == "fp32" else w_eng.to(torch.bfloat16)
        rows[f"experts[{name}]"] = _same(mix_experts(x, ids.long(), w, gate_up, down, r), y_eng)
    rows["experts[hf]"] = _same(
        mix_experts(x, ids.long(), w_eng.to(torch.bfloat16), gate_up, down, HF.moe), y_eng
    )
    rows["experts[cpu-fused]"] = _same(mix_experts(x, ids.long(), w_eng, gate_up, down, CPU_FUSED_MOE), y_eng)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    gate_w = (torch.randn(1, x.shape[1], generator=g) * 0.05).to(x.dtype).to(device)
    shared = torch.randn(x.shape, generator=g).to(x.dtype).to(device)
    out = y_eng.clone()  # the kernel adds the gated shared output into the routed output in place
    fused_gate_sigmoid_mul_add(x, gate_w.squeeze(0).contiguous(), shared, out)
    for name, y in block_candidates(x, gate_w, shared, y_eng).items():
        rows[f"block_sum[{name}]"] = _same(y, out)
    return rows


def sglang_misses(rows: dict[str, float]) -> list[str]:
    """:func:`misses` plus the block sum: the profile's >= EXPERTS_MIN and at least as close as the others."""
    out = misses(rows)
    ours = rows["block_sum[profile]"]
    if ours < EXPERTS_MIN:
        out.append(f"block_sum: {100 * ours:.3f}% < {100 * EXPERTS_MIN:.0f}% bit-identical")
    out += [f"block_sum: {k} is closer" for k, v in rows.items() if k.startswith("block_sum[") and v > ours]
    return out


def _vllm_rows(top_k: int) -> dict[str, float] | None:
    """:func:`moe_rows`, or ``None`` (one printed line) where vLLM does not import."""
    try:
        import vllm.model_executor.layers.fused_moe.fused_moe  # noqa: F401
    except Exception as exc:  # not installed, or a build that cannot load here
        print(f"gpu_moe_check: vllm rows skipped: {type(exc).__name__}: {exc}")
        return None
    return moe_rows(top_k=top_k)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_moe_check: skipped: no CUDA device (run on a GPU machine with vLLM or SGLang installed)")
        return 0
    result, failed = {}, []
    engines = (("", _vllm_rows, misses), ("sglang ", lambda k: sglang_rows(top_k=k), sglang_misses))
    for prefix, rows_of, misses_of in engines:
        for top_k in (2, 8):  # 2: a bf16 add of two slots; 8: above either profile's slot_sum_bf16_max_k
            try:
                rows = rows_of(top_k)
            except Exception as exc:  # an op that imports but cannot run is a miss, not a crash
                failed.append(f"{prefix}top-{top_k} {type(exc).__name__}: {exc}")
                continue
            if rows is None:
                break
            for name, frac in rows.items():
                print(f"{prefix}top-{top_k} {name:<44} {100 * frac:8.3f}% bit-identical")
            result[f"{prefix.strip()}_top{top_k}".lstrip("_")] = rows
            failed += [f"{prefix}top-{top_k} {m}" for m in misses_of(rows)]
    if not result:
        failed.append("nothing compared: neither vLLM nor sglang imports on this machine")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "misses": failed}, f, indent=1)
    for m in failed:
        print(f"MISS {m}")
    print(
        "gpu_moe_check: " + ("FAILED: a profile's MoE rounding is not what the GPU does" if failed else "ok")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
