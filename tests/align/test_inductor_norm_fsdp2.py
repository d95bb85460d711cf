"""compiled_norm under FSDP2 (verl's wrapping) and non-reentrant activation checkpointing (CPU, gloo, one process).

Forward: the FSDP2-wrapped, checkpointed training forward (grad enabled) gives logits bit-identical to the
same aligned model in bf16 without FSDP2 under ``no_grad``: the compiled norm kernels do not depend on
autograd, sharding or recomputation. Backward: the wrapped, checkpointed model's parameter gradients
(fp32, FSDP2's reduce dtype) match the plain bf16 model's (bf16 grads) to bf16 precision. Runs in a fresh process (``python this_file child <paths>``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gloo_fsdp import child_env

from rlalign_verl.align.regions.compiled import inductor_available

_OK, _WHY = inductor_available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _OK, reason=f"Inductor cannot compile here: {_WHY}")]
REGIONS = ("rope", "swiglu", "rmsnorm")


def test_fsdp2_checkpointed_compiled_norm(tiny_checkpoint):
    paths = {arch: str(tiny_checkpoint(arch)) for arch in ("qwen3", "llama")}
    env = child_env(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run(
        [sys.executable, __file__, "child", json.dumps(paths)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["arch"] for r in results] == list(paths)
    for r in results:
        assert r["forward_equal"], r
        # same forward bits and backward math; the reference's grads are stored in bf16 (relative
        # rounding 2**-9) and summed in another order: 2**-7 of each gradient's max magnitude
        assert r["max_rel_grad_diff"] <= 2**-7, r
        assert r["n_grads"] > 10, r


def _train_forward(base, ids, mesh, mp):
    import copy

    from torch.distributed.fsdp import fully_shard

    from rlalign_verl.align.patch import apply_alignment

    m = copy.deepcopy(base).train()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_alignment(m, regions=REGIONS, engine="vllm-cpu", compiled_norm=True)
    for layer in m.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(m, mesh=mesh, mp_policy=mp)
    logits = m(input_ids=ids).logits
    logits.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad.full_tensor().float() for n, p in m.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _child(paths: dict[str, str]) -> None:
    import copy

    import torch
    import torch.distributed as dist
    from gloo_fsdp import init_gloo_fsdp  # tests/support: on PYTHONPATH (child_env)
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlalign_verl.align.patch import apply_alignment

    mesh, mp = init_gloo_fsdp()
    ids = torch.randint(3, 1000, (2, 40), generator=torch.Generator().manual_seed(1))
    results = []
    for arch, path in paths.items():
        config = AutoConfig.from_pretrained(path, attn_implementation="sdpa")
        base = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
        ref = copy.deepcopy(base).eval()
        for p in ref.parameters():
            p.data = p.data.to(torch.bfloat16)
        apply_alignment(ref, regions=REGIONS, engine="vllm-cpu", compiled_norm=True)
        with torch.no_grad():
            want = ref(input_ids=ids).logits
        ref.train()
        ref(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        g_ref = {n: p.grad.float() for n, p in ref.named_parameters() if p.grad is not None}
        got, g_fsdp = _train_forward(base, ids, mesh, mp)
        assert g_fsdp.keys() == g_ref.keys()
        rel = max(
            float((g_fsdp[n] - g_ref[n]).abs().max() / g_ref[n].abs().max().clamp_min(1e-12)) for n in g_ref
        )
        results.append(
            {
                "arch": arch,
                "forward_equal": bool(torch.equal(got, want)),
                "max_rel_grad_diff": rel,
                "n_grads": len(g_ref),
            }
        )
    dist.destroy_process_group()
    print(json.dumps(results))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "child":
    _child(json.loads(sys.argv[2]))
