"""Under FSDP2 an aligned model's per-parameter gradients equal the unsharded aligned model's, bit for bit.

The fp32 remainder of the residual stream crosses a decoder-layer boundary inside a per-forward carry,
not as a layer argument, so FSDP2 neither casts it nor wraps it in its post-backward hook; only the
visible ``[B, T, H]`` output does. This checks that FSDP2's hooks still fire in the right order (params
unsharded before each layer's backward, gradients reduced after it) for every carry kind — ``PAIR``
(``sglang``, ``vllm-cpu-eager``), ``FP32_SUM`` (``vllm``, ``vllm-cpu``), ``ROUNDED_SUM`` (``hf``,
``vllm-eager``) — and the ``tp`` region's split projections (rollout TP 2), with and without verl's
non-reentrant gradient checkpointing, on 2 gloo ranks (CPU); and a Qwen2-MoE with ``moe`` + ``tp``, whose shared expert's
rank partials join the routed ones before one all-reduce (its block reads the experts' and shared expert's
parameters inside the layer FSDP2 unshards).

Expected: bit-identical. Both ranks see the same batch, so FSDP2's fp32 reduce gives ``(g + g) / 2 = g``
exactly, and ``g`` is the bf16 gradient of the reference (parameters in bf16, as FSDP2 computes with
``param_dtype=bf16``) converted to fp32. Runs in a fresh process so the process group does not leak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from gloo_fsdp import child_env

PROFILES = ("hf", "vllm-eager", "sglang", "vllm-cpu-eager", "vllm", "vllm-cpu")
THREE = ("rope", "swiglu", "rmsnorm")
CASES = [(p, THREE, 1, "qwen3") for p in PROFILES] + [
    ("vllm-cpu", (*THREE, "tp"), 2, "qwen3"),
    ("vllm-cpu", (*THREE, "moe", "tp"), 2, "qwen2_moe"),
]
"""(profile, regions, rollout TP, model): every carry kind, the tp region's per-rank GEMMs + reduction, per MoE rank."""
WORLD = 2


@pytest.mark.slow
def test_fsdp2_gradients_equal_unsharded_for_every_carry_kind(tmp_path) -> None:
    out_file = tmp_path / "grads.json"
    env = child_env(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    for _ in range(2):  # a rank killed by a signal (gloo's transport, not the numbers) gets one more try
        out = subprocess.run(
            [sys.executable, __file__, "child", str(out_file)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        if out.returncode == 0 or "terminated with signal" not in out.stderr:
            break
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out_file.read_text())
    assert len(results) == len(CASES) * 2
    for r in results:
        assert r["params"] > 10 and r["mismatched"] == [], r
        assert r["logits_equal"], r
    # the profiles change the gradients (otherwise bit-identity could hold by accident of no alignment)
    sums = {r["case"]: r["grad_sum"] for r in results if not r["checkpointing"]}
    assert len(set(sums.values())) >= 5, sums


def _build(arch: str = "qwen3"):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3Config

    common = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    if arch == "qwen2_moe":
        cfg = Qwen2MoeConfig(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                             num_experts_per_tok=2, norm_topk_prob=True, **common)  # fmt: skip
    else:
        cfg = Qwen3Config(head_dim=16, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # fp32 master weights holding bf16 values, as a bf16 checkpoint
            p.copy_(
                (torch.randn_like(p) * 0.1 if p.dim() > 1 else 1.0 + 0.2 * torch.randn_like(p)).bfloat16()
            )
    return model.train()


def _grads(model, ids, checkpointing: bool):
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach()


def _rank(rank: int, out_file: str) -> None:
    import copy

    import torch
    import torch.distributed as dist
    from gloo_fsdp import init_gloo_fsdp  # tests/support: on PYTHONPATH (child_env)
    from torch.distributed.fsdp import fully_shard

    from rlalign_verl.align.patch import apply_alignment

    mesh, mp = init_gloo_fsdp(WORLD, rank)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    bases = {arch: _build(arch) for arch in {c[3] for c in CASES}}
    results = []
    for profile, regions, tp, arch in CASES:
        base = bases[arch]
        for checkpointing in (False, True):
            ref = copy.deepcopy(base)
            for p in ref.parameters():
                p.data = p.data.to(torch.bfloat16)  # buffers stay fp32, as under FSDP2
            wrapped = copy.deepcopy(base)
            for m in (ref, wrapped):
                apply_alignment(m, regions=regions, engine=profile, rollout_tp=tp)
            for layer in wrapped.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(wrapped, mesh=mesh, mp_policy=mp)
            want = _grads(ref, ids, checkpointing)
            got = _grads(wrapped, ids, checkpointing)
            names = [n for n, _ in ref.named_parameters()]
            pairs = zip(names, ref.parameters(), wrapped.parameters(), strict=True)
            mismatched = [n for n, a, b in pairs if not torch.equal(a.grad.float(), b.grad.full_tensor())]
            grad_sum = sum(float(p.grad.float().abs().sum()) for p in ref.parameters())
            results.append(
                {
                    "profile": profile,
                    "case": f"{arch} {profile} {'+'.join(regions)} tp{tp}",
                    "checkpointing": checkpointing,
                    "params": len(names),
                    "mismatched": mismatched,
                    "logits_equal": bool(torch.equal(got, want)),
                    "grad_sum": grad_sum,
                }
            )
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _child(out_file: str) -> None:
    import torch.multiprocessing as mp
    from gloo_fsdp import free_port  # tests/support: on PYTHONPATH (child_env)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.spawn(_rank, args=(out_file,), nprocs=WORLD, join=True)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "child":
    _child(sys.argv[2])
